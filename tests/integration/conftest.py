"""Fixtures of the integration tests; the helpers live in ``tests/service_harness.py``.

Test modules import helpers with ``from service_harness import ...`` (``tests``
is on ``pythonpath``), never ``from conftest import ...``: several directories
have a ``conftest.py`` and the name is ambiguous.
"""

from service_harness import _figures_clock, daemon, module_daemon  # noqa: F401 - pytest fixtures
