import sys

from meshd.cli import main

sys.exit(main())
