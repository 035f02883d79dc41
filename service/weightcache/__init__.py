"""weightcache: LLM weights resident in GPU memory, attached by engines in milliseconds.

Engines call :func:`attach`; operators run ``weightcache serve`` under systemd
(one instance per GPU). See README.md and docs/.
"""

from .client import Attachment, attach
from .errors import WeightcacheError

__all__ = ["attach", "Attachment", "WeightcacheError"]
__version__ = "0.1.0"
