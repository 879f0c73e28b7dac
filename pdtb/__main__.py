"""`python -m pdtb`: the `pdtb` command run as a module."""
import sys

from pdtb.cli import main

sys.exit(main())
