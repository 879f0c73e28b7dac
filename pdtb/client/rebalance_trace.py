"""The rebalancing experiment's trace: a batch request, three long-output whales the router places
on one node, minnows.

`python -m pdtb.client.rebalance_trace OUT [--seed N]`: the trace of the rebalancing experiment
(scripts/migration_results.sh), in the JSON-lines trace format `pdtb bench serve --workload trace:`
replays (pdtb/client/traces.py).

On 1 prefill + 2 decode nodes, the router places a hand-off on the decode node with the most
free pages. It cannot see how long a request will decode, so whales with short prompts and long
outputs look like minnows when they are placed:

    t = 0        "batch": a 400-token prompt, 400 output tokens. The router places it on the first
                 decode node, which then has fewer free pages than the other for a few seconds.
    t = 0.3-0.7  three "whale" requests, 32-token prompts, `whale_output` tokens each. All three go
                 to the second decode node, which has the most free pages. There they grow until
                 they no longer fit together.
    t >= 1.5     "minnow" requests, 48 + 64 tokens, Poisson at `minnow_rate`, until `duration`.

The run shows what happens when placement cannot know output lengths. With the router's
`--rebalance off`, the second node preempts whales while the first has room; `pressure` and
`fair` move whales over.
"""
from __future__ import annotations

import argparse
import json
import random


def rows(seed: int = 1, whale_output: int = 1024, minnow_rate: float = 6.0, duration: float = 25.0) -> list[dict]:
    rng = random.Random(seed)
    out = [{"timestamp": 0, "input_length": 400, "output_length": 400, "tenant": "batch"}]
    out += [{"timestamp": 300 + 200 * i, "input_length": 32, "output_length": whale_output, "tenant": "whale"}
            for i in range(3)]
    t = 1.5
    while t < duration:
        out.append({"timestamp": round(t * 1000), "input_length": 48, "output_length": 64, "tenant": "minnow"})
        t += rng.expovariate(minnow_rate)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pdtb.client.rebalance_trace", description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--whale-output", type=int, default=1024)
    ap.add_argument("--minnow-rate", type=float, default=6.0)
    ap.add_argument("--duration", type=float, default=25.0)
    a = ap.parse_args(argv)
    with open(a.out, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows(a.seed, a.whale_output, a.minnow_rate, a.duration))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
