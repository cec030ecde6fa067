"""`python -m eval.libero`: the same program as `dreamzero-eval-libero`."""

import sys

from eval.libero.cli import main

if __name__ == "__main__":  # env workers are spawned: importing this module must not start a run
    sys.exit(main())
