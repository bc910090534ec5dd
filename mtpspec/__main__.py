"""`python -m mtpspec ...` is the `mtpspec` command."""

import sys

from .cli import main

sys.exit(main())
