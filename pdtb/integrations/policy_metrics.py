"""Prometheus counters of a policy run inside another engine's scheduler: its raised calls and
its illegal answers, served by the scheduler's own process on PDTB_METRICS_PORT.

An engine's `/metrics` is served by its API process from what the engine core reports, and
vLLM's `SchedulerStats` have no field for a policy's errors; so the process that runs the
policy serves its own counters (prometheus_client's documented `start_http_server`, on
loopback unless PDTB_METRICS_HOST says otherwise). Without PDTB_METRICS_PORT nothing is served
and the counters are still kept (`FairScheduler.policy_errors`).
"""
from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter, start_http_server

PORT_ENV = "PDTB_METRICS_PORT"  # a port for the counters (0: any free one, logged)
HOST_ENV = "PDTB_METRICS_HOST"  # the address to bind (default loopback)


class PolicyMetrics:
    """`pdtb_policy_errors_total` and `pdtb_policy_violations_total`, labelled by policy."""

    def __init__(self, policy: str, environ=None, logger: logging.Logger | None = None) -> None:
        self.policy = policy
        self.registry = CollectorRegistry()
        self.errors = Counter("pdtb_policy_errors", "Calls of the policy that raised (each cost its step the "
                              "policy's order)", ["policy"], registry=self.registry)
        self.violations = Counter("pdtb_policy_violations", "Illegal answers of the policy, each replaced by "
                                  "the default answer", ["policy"], registry=self.registry)
        self.errors.labels(policy)  # both series exist from the start, at 0
        self.violations.labels(policy)
        self.port: int | None = None
        self.server = None
        env = environ or {}
        port = env.get(PORT_ENV, "").strip()
        if port:
            try:
                want = int(port)
            except ValueError:
                raise ValueError(f"{PORT_ENV}={port!r}: not a port number") from None
            self.server, _ = start_http_server(want, addr=env.get(HOST_ENV, "127.0.0.1"), registry=self.registry)
            self.port = self.server.server_address[1]
            (logger or logging.getLogger(__name__)).info("pd-testbed policy %s: counters on http://%s:%d/metrics",
                                                         policy, env.get(HOST_ENV, "127.0.0.1"), self.port)

    def raised(self) -> None:
        self.errors.labels(self.policy).inc()

    def violated(self, n: int = 1) -> None:
        self.violations.labels(self.policy).inc(n)

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None
