"""`python -m pdtb.client ...` runs `pdtb bench serve`; `python -m pdtb.client report ...` the report."""
import sys

if sys.argv[1:2] == ["report"]:
    from pdtb.figures.report import main as report_main

    sys.exit(report_main(sys.argv[2:]))
from pdtb.client.serve import main

sys.exit(main(sys.argv[1:]))
