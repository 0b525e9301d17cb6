import sys

from callgate.cli import main

sys.exit(main())
