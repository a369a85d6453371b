"""``python -m redsrv`` is the ``redsrv`` command."""

import sys

from redsrv.cli import main

sys.exit(main())
