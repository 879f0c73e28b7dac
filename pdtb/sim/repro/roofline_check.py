"""`pdtb sim roofline --steps FILE`: measured steps against the roofline cost model.

For every step of a `pdtb bench steps --grid --json` file: the measured time, the roofline's
(`--gpu`, `--model-config`, `--tp`, with no fixed overhead unless `--overhead-ms`), their ratio
and which bound the roofline says holds; then the geometric-mean ratio by kind of step (decode
only, prefill only, mixed). A ratio far above 1 is time the engine spends off the roofline
(kernel launches, Python, gathers), which a calibrated cost model keeps and a roofline does not.
"""
from __future__ import annotations

import argparse
import json
import math

from pdtb.common import CliError
from pdtb.sim.roofline import RooflineCost
from pdtb.sim.calibration.samples import SampleError, read_samples


def kind(shape) -> str:
    if shape.decode_rows and shape.prefill_chunks:
        return "mixed"
    return "decode" if shape.decode_rows else "prefill"


def check(path: str, gpu: str, model_config: str, tp: int = 1, overhead_s: float = 0.0) -> dict:
    samples, meta = read_samples(path)
    cost = RooflineCost.of(gpu, model_config, tp=tp, page_size=int(meta.get("page_size") or 16),
                           overhead_s=overhead_s)
    rows = []
    for s in samples:
        t = cost.terms(s.shape)
        rows.append({**{f: getattr(s.shape, f) for f in ("decode_rows", "decode_ctx", "prefill_chunks",
                                                           "prefill_tokens", "prefill_attn")},
                     "kind": kind(s.shape), "measured_ms": s.ms, "roofline_ms": 1e3 * t.total_s,
                     "ratio": s.ms / (1e3 * t.total_s), "bound": t.bound})
    by_kind = {}
    for k in ("decode", "prefill", "mixed"):
        rs = [r["ratio"] for r in rows if r["kind"] == k]
        if rs:
            by_kind[k] = {"steps": len(rs), "geomean_ratio": math.exp(sum(map(math.log, rs)) / len(rs)),
                          "min_ratio": min(rs), "max_ratio": max(rs)}
    return {"steps_file": path, "measured_on": meta.get("device"), "model": meta.get("model"),
            "roofline": cost.name, "rows": rows, "by_kind": by_kind}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="pdtb sim roofline", description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", required=True, help="pdtb bench steps --grid --json output")
    ap.add_argument("--gpu", default="h100-sxm")
    ap.add_argument("--model-config", default="llama-3-8b")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--overhead-ms", type=float, default=0.0)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    try:
        doc = check(a.steps, a.gpu, a.model_config, a.tp, a.overhead_ms / 1e3)
    except (SampleError, ValueError, OSError) as e:
        raise CliError(f"pdtb sim roofline: {e}") from None
    if a.json:
        print(json.dumps(doc))
        return 0
    print(f"{doc['model']} measured on {doc['measured_on']} against {doc['roofline']}")
    print(f"{'kind':<8} {'rows':>5} {'ctx':>7} {'chunks':>6} {'tokens':>6} {'measured ms':>11} {'roofline ms':>11} "
          f"{'ratio':>6} bound")
    for r in doc["rows"]:
        print(f"{r['kind']:<8} {r['decode_rows']:>5} {r['decode_ctx']:>7} {r['prefill_chunks']:>6} "
              f"{r['prefill_tokens']:>6} {r['measured_ms']:>11.2f} {r['roofline_ms']:>11.2f} {r['ratio']:>6.2f} {r['bound']}")
    for k, v in doc["by_kind"].items():
        print(f"{k}: measured / roofline {v['geomean_ratio']:.2f}x geometric mean over {v['steps']} steps "
              f"({v['min_ratio']:.2f}x .. {v['max_ratio']:.2f}x)")
    return 0
