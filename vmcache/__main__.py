"""``python -m vmcache``: the same as the ``vmcache`` command."""

import sys

from .cli import main

sys.exit(main())
