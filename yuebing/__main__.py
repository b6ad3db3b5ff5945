import sys

from yuebing.cli import main

sys.exit(main())
