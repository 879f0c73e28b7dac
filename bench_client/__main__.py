"""`python -m bench_client ...` runs `pdtb bench serve`; `python -m bench_client report ...` the report."""
import sys

if sys.argv[1:2] == ["report"]:
    from bench_client.report import main as report_main

    sys.exit(report_main(sys.argv[2:]))
from bench_client.cli import main

sys.exit(main(sys.argv[1:]))
