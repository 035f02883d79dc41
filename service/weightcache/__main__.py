"""``python -m weightcache``: the same CLI as the ``weightcache`` console script.

weightcache@.service runs the daemon this way (via ``weightcache-launch``),
so that it works from any runtime interpreter, with or without the console
script on ``$PATH``.
"""

import sys

from weightcache.cli import main

if __name__ == "__main__":
    sys.exit(main())
