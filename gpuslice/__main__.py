"""``python -m gpuslice``: the ``gpuslice`` command, for environments without the console
script on ``PATH``."""

import sys

from gpuslice.cli import main

sys.exit(main())
