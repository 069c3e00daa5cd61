"""``python -m mxamp``: the command line of `mxamp.cli`."""
import sys

from .cli import main

sys.exit(main())
