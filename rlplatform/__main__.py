import sys

from rlplatform.cli import main

sys.exit(main())
