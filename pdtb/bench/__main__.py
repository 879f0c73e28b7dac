"""`python -m pdtb.bench ...` runs `pdtb bench serve`; `python -m pdtb.bench report ...` the report."""
import sys

if sys.argv[1:2] == ["report"]:
    from pdtb.bench.report import main as report_main

    sys.exit(report_main(sys.argv[2:]))
from pdtb.bench.cli import main

sys.exit(main(sys.argv[1:]))
