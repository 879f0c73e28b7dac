"""Request timeline components and SLO-miss attribution.

SLO attribution: every request's timeline (pdtb.engine.timeline.Timeline) broken into
causes, and each miss blamed on one.

TTFT = dispatch + queue + prefill + recompute and parked before the first token. The decode phase (TPOT) = transfer + held + parked +
preempted + turn wait + migration pause + decode compute. A miss is attributed to the largest component of the phase
that missed.

A request the router recomputed after a node loss (its timeline's `earlier`) is judged whole, from
its first arrival to its last token:
- no token before the loss: TTFT adds `node_lost` (the lost attempts, the loss found, the new submission);
- tokens before it: TTFT is the lost attempt's, one component `lost_attempt` (its breakdown was
  lost with its node); the decode phase adds `lost_attempt_decode` (its tokens after the first)
  and `node_lost` (from its last token to this attempt's first: the loss and the recompute);
  TPOT counts every token of the request.
"""
from __future__ import annotations

from fairness.config import FairnessConfig
from pdtb.engine.timeline import Timeline


def _gap(tl: Timeline, a: str, b: str) -> float:
    span = tl.span(a, b)
    return 0.0 if span is None else max(0.0, span)


PHASES = {"queue_s": ("prefill_queued", "prefill_start"), "prefill_s": ("prefill_start", "first_token"),
          "transfer_s": ("transfer_start", "transfer_end"), "admission_wait_s": ("transfer_end", "decode_admit"),
          "decode_s": ("decode_admit", "last_token")}


def timing_summary(tl: Timeline) -> dict:
    """Durations (s) of each phase whose stamps are set, plus the stamps and waits themselves."""
    out = {k: round(v, 6) for k, (a, b) in PHASES.items() if (v := tl.span(a, b)) is not None}
    out["stamps"] = tl.to_dict()
    return out


def components(tl: Timeline, num_output: int) -> dict:
    """`num_output`: the tokens of this attempt (a recomputed request's earlier ones are in tl.earlier)."""
    before, parked_before = tl.recompute_ttft_s, tl.parked_ttft_s  # preempted or demoted before the first token
    ttft = {"dispatch": _gap(tl, "router_arrival", "prefill_queued"), "queue": _gap(tl, "prefill_queued", "prefill_start"),
            "prefill": max(0.0, _gap(tl, "prefill_start", "first_token") - before - parked_before),
            "recompute_before_first_token": before, "parked_before_first_token": parked_before}
    decode_total = _gap(tl, "first_token", "last_token")
    held, parked, pre, turn, mig = tl.held_s, tl.parked_s, tl.preempted_s, tl.turn_wait_s, tl.migrating_s
    transfer = max(0.0, _gap(tl, "transfer_start", "transfer_end") - held)
    compute = max(0.0, decode_total - transfer - held - parked - pre - turn - mig)
    tpot = {"transfer": transfer, "held_at_prefill": held, "parked_in_host": parked, "recompute": pre,
            "turn_wait": turn, "migration": mig, "decode_compute": compute}
    e = tl.earlier
    if e is not None and e.tokens == 0:
        ttft["node_lost"] = e.lost_s
    elif e is not None:  # this attempt's TTFT is one more inter-token gap of the whole request
        ttft = {"lost_attempt": e.first_token_s}
        tpot["lost_attempt_decode"] = e.last_token_s - e.first_token_s
        tpot["node_lost"] = e.lost_s - e.last_token_s + _gap(tl, "router_arrival", "first_token")
        decode_total += tpot["lost_attempt_decode"] + tpot["node_lost"]
        num_output += e.tokens
    return {"ttft": ttft, "tpot": tpot, "ttft_s": sum(ttft.values()),
            "tpot_s": decode_total / (num_output - 1) if num_output > 1 else None}


def _target(table: dict, cls: int):
    return table.get(cls, table.get("*"))


def attribute(tl: Timeline, num_output: int, priority: int, cfg: FairnessConfig) -> dict:
    """Components plus, when targets are set for this class, which SLOs missed and why."""
    comp = components(tl, num_output)
    # "cause": the dominant one over every missed SLO; "causes": each missed SLO's own (a TTFT
    # miss and a TPOT miss of one request can have different causes)
    out = {"components": {**comp["ttft"], **comp["tpot"]}, "missed": [], "cause": None, "causes": {}}
    t_ttft, t_tpot = _target(cfg.slo_ttft_s, priority), _target(cfg.slo_tpot_s, priority)
    worst = None
    if t_ttft is not None and comp["ttft_s"] > t_ttft:
        out["missed"].append("ttft")
        worst = max(comp["ttft"].items(), key=lambda kv: kv[1])
        out["causes"]["ttft"] = worst[0]
    if t_tpot is not None and comp["tpot_s"] is not None and comp["tpot_s"] > t_tpot:
        out["missed"].append("tpot")
        cand = max(comp["tpot"].items(), key=lambda kv: kv[1])
        out["causes"]["tpot"] = cand[0]
        worst = cand if worst is None or cand[1] > worst[1] else worst
    out["cause"] = worst[0] if worst else None
    return out
