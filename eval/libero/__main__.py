import sys

from eval.libero.cli import main

sys.exit(main())
