"""Node loss in the simulator, as the real router and prefill nodes handle it.

    --kill NODE@T: at simulated time T the node's process is gone (kill -9): its steps stop,
    messages to it are dropped, a transfer it was sending never lands (the receiver frees
    the pages it reserved), its pages are lost with it
    -> the router's ping loop finds it silent for more than `health_timeout_s` (the router's
       --health-timeout, 3 s) and marks it lost (pdtb/router/following.py `Follower.node_lost`):
       - no request is routed to it any more;
       - every open request that depends on it (its colocated or prefill node until its KV was
         handed off, its decode node) is recomputed: sent anew, its prompt followed by the tokens
         it streamed, for the tokens left, up to `recompute_retries` times, else it fails
         (pdtb/router/completions.py `_recompute`); a request whose decode node died before
         its hand-off, with a live fallback, is left to its prefill node;
       - a lost decode node: every prefill node moves hand-offs off it to their fallbacks, or
         fails them marked retry, and the router recomputes them as above (`NodeDown`,
         prefill_node/node.py `on_node_down`): the router's list of fallbacks may name a node
         the prefill node has dropped already (a transfer to it failed).

A transfer longer than `transfer_timeout_s` (the transport's, 30 s) fails with TIMEOUT: the
receiver frees what it reserved and the prefill node moves the hand-off on, as a real one does.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass


@dataclass(frozen=True)
class Kill:
    node: str  # node id: "prefill-0", "decode-1", "colocated-0" (the simulator's names, in flag order)
    at_s: float

    @classmethod
    def parse(cls, text: str) -> "Kill":
        node, sep, t = text.rpartition("@")
        try:
            at = float(t)
        except ValueError:
            at = -1.0
        if not sep or not node or at < 0:
            raise ValueError(f"--kill takes NODE@SECONDS (e.g. decode-0@30), got {text!r}")
        return cls(node, at)


class Faults:
    def __init__(self, cluster, kills: tuple[Kill, ...], health_timeout_s: float, recompute_retries: int) -> None:
        self.cluster, self.kills = cluster, kills
        self.health_timeout_s, self.recompute_retries = health_timeout_s, recompute_retries
        self.lost: set[str] = set()  # found gone by the router (a gone process: its node's `dead`)
        self.last_seen: dict[str, float] = {}  # node -> the router's last ping it answered
        self.recomputes: Counter = Counter()  # request (its first id) -> times recomputed
        self.recomputed_at: dict[str, float] = {}
        self.tokens_before: dict[str, int] = {}
        self.failed = 0  # requests failed for a lost node (retries spent)
        for k in kills:
            if k.node not in cluster.nodes:
                raise ValueError(f"--kill {k.node}@{k.at_s:g}: no such node (nodes: {', '.join(cluster.nodes)})")

    def start(self) -> None:
        for k in self.kills:
            self.cluster.loop.at(k.at_s, self._kill, k.node)

    def alive(self, nid: str) -> bool:
        return not self.cluster.nodes[nid].dead

    def _kill(self, nid: str) -> None:
        node = self.cluster.nodes[nid]
        if node.dead:
            return
        node.sync()  # the steps it ended before it died, their tokens out
        node.die()

    # ---- the router --------------------------------------------------------------------------------
    def on_ping(self, now: float) -> None:
        for nid, node in self.cluster.nodes.items():
            if not node.dead:
                self.last_seen[nid] = now
            elif nid not in self.lost and now - self.last_seen.get(nid, 0.0) > self.health_timeout_s:
                self._lost(nid)

    def _lost(self, nid: str) -> None:
        c = self.cluster
        self.lost.add(nid)
        role = c.nodes[nid].shape.role
        for root, rid in list(c.attempt.items()):
            req, rec = c.reqs.get(rid), c.records.get(rid)
            if req is None or rec is None or rec.end_time is not None:
                continue
            entry, decode, handed = c.entry[rid], req.decode_node or None, rid in c.landed
            if nid == decode and not handed and self.alive(entry) and \
                    any(t.node_id != nid and t.node_id not in self.lost for t in req.fallbacks):
                continue  # its prefill node moves the hand-off to a fallback
            deps = [entry] if decode is None else ([decode] if handed else [entry, decode])
            if nid in deps:
                self.recompute(root, rid, f"{role} node {nid} stopped answering")
        if role == "decode":
            for p in c.nodes.values():
                if p.shape.role == "prefill" and self.alive(p.node_id):
                    c.loop.after(c.shape.rpc_latency_s, p.deliver, p.on_node_down, nid)

    def recompute(self, root: str, rid: str, why: str) -> None:
        c = self.cluster
        rec = c.records[rid]
        done = len(rec.token_times)
        left = rec.requested_output_tokens - done
        if self.recomputes[root] >= self.recompute_retries or left < 1:
            self.failed += 1
            c.on_failed(rid, f"{why} (not recomputed: {'retries spent' if left >= 1 else 'nothing left'})")
            return
        self.recomputes[root] += 1
        self.recomputed_at[root], self.tokens_before[root] = c.loop.now, done
        c.resubmit(root, rid, f"{root}.r{self.recomputes[root]}", done, left)

    def timing(self, root: str, timing: dict) -> dict:
        """The final timing with what recomputes took (pdtb/router/completions.py `_timing`)."""
        n = self.recomputes.get(root, 0)
        if not n:
            return timing
        rec = self.cluster.records[self.cluster.attempt[root]]
        return {**timing, "recomputed": {"times": n, "lost_s": round(self.recomputed_at[root] - rec.send_time, 6),
                                         "tokens_before": self.tokens_before[root]}}

    def figures(self) -> dict:
        return {"kills": [{"node": k.node, "at_s": k.at_s} for k in self.kills], "lost": sorted(self.lost),
                "recomputed_requests": len(self.recomputes), "recomputes": sum(self.recomputes.values()),
                "failed_for_lost_nodes": self.failed}
