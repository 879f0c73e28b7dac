"""Figures and documents from results files: no sockets, no clock.

  records.py                -> RequestSpec, RequestRecord: the results file's requests
  summary.py + service.py   -> a run's summary: percentiles, goodput, fair-share indexes
  sweep_figures.py          -> a sweep's derived figures (max goodput, knee, saturation)
  frontier.py, compare.py, scorecard.py -> tables across runs, ratios against fcfs
  report.py + plots.py      -> `pdtb report`
  results_doc.py            -> docs/results.md (with gpu_section.py, sim_section.py, *_report.py)
"""
