"""``python -m anneal.cli ...``: the same as the ``anneal`` command."""

import sys

from anneal.cli import main

sys.exit(main())
