import sys

from pdtb.cli import main

sys.exit(main())
