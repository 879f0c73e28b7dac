"""Paper reproductions and the simulator's validation, on top of the simulator core:
`pdtb sim reproduce mcsf|vtc|essay` (mcsf.py with mcsf_engine.py and mcsf_hindsight.py, vtc.py,
essay.py; shared flags in args.py), `pdtb sim validate` (validate.py) and `pdtb sim roofline`
(roofline_check.py)."""
