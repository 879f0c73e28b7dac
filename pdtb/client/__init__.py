"""The load client: workloads, an open/closed-loop SSE client, sweeps, soak and migration runs.

  workloads.py / traces.py / prefix.py -> list[RequestSpec]     (seeded, reproducible)
  load.py + sse.py            -> list[RequestRecord] + samples  (asyncio, aiohttp)
  serve.py                    -> `pdtb bench serve`; sweep.py: `pdtb bench sweep`
  downtime.py                 -> `pdtb bench migration`; soak.py: scripts/soak.sh
  data/                       -> trace excerpts and tenant files the scripts replay
Its figures come from pdtb/figures (summary, results files, reports).
"""
