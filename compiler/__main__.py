"""`python -m compiler ...`: see compiler/cli.py."""

import sys

from .cli import main

sys.exit(main())
