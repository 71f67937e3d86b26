import sys

from spotguard.cli import main

sys.exit(main())
