"""``python -m gpu_serde``: the ``gpu-serde`` command line."""

import sys

from gpu_serde.tools.cli import main

sys.exit(main())
