import sys

from lmlab.cli.main import main

sys.exit(main())
