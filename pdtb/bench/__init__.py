"""The bundled load-test client: workloads, an open/closed-loop SSE client, summary figures,
results files and a markdown report.

  workloads.py / traces.py  ->  list[RequestSpec]            (seeded, reproducible)
  runner.py + sse.py        ->  list[RequestRecord] + samples (asyncio, aiohttp)
  summary.py + service.py   ->  summary dict                  (pure functions)
  results.py                ->  results JSON + stdout table
  cli.py                    ->  `pdtb bench serve`
  report.py + plots.py      ->  `pdtb report`
"""
