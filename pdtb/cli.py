"""`pdtb`: the single command-line entry point. Subcommands dispatch to their modules."""
from __future__ import annotations

import argparse
import os
import sys
import traceback

from pdtb.common import CliError, die

USAGE = """pdtb <command> [options]

commands:
  model init         write the embedded tiny model as a HF checkpoint directory
  generate           offline batched generation on the paged engine
  bench engine       paged engine vs transformers generate (same run)
  bench transport    KV transport throughput vs raw pyzmq and memcpy (same run)
  bench steps        engine step time by what it carries (long rows, prefill chunks)
  bench roofline     decode step time against the memory roofline, by batch size
  bench decode-kernel  the Triton paged decode kernel's bandwidth by launch setting (GPU)
  cluster            up|down|status: a cluster placed and supervised by Ray (the ray extra)
  bench controller   per-step decision cost of each policy at 100 / 1k / 10k requests
  bench serve        load-test client against an OpenAI-compatible endpoint
  bench sweep        a workload at a series of offered loads: attainment, goodput, knee
  bench migration    live migration downtime between decode nodes under load, against its ITL
  bench lockstep     a workload's hand-offs into a real decode node in a fixed order of events:
                     its admission verdicts, to compare KV transports decision by decision
  policies           the policies by name and source; `policies show REF`: one's settings
  policy check REF   a policy's conformance: legal answers, pages conserved, every request
                     ends, deterministic under a seed (REF: a name, module:Class, file.py:Class)
  sim                simulate a cluster at any scale on the real scheduler and policies
                     (calibrate, validate, roofline, reproduce mcsf|vtc|essay, plan)
  frontier           fairness-throughput frontier of sweep files (table, plot, Pareto points)
  scorecard DIR      every policy of every scenario of scripts/scorecard.sh, against fcfs
  report             markdown report and plots comparing results files
  compare            per-run minnow p99 TTFT/ITL and throughput, with ratios vs fcfs
  prefill            start a prefill node          decode      start a decode node
  colocated          start a colocated node        router      start the HTTP router
  demo               send a few streaming requests to a running router
  keys               write ZeroMQ CURVE keys for --curve-dir (encrypted, authenticated sockets)
"""


def _model_init(argv: list[str]) -> int:
    from pdtb.engine.tiny_model import ARCHS, DEFAULT_SEED, init_tiny_model

    ap = argparse.ArgumentParser(prog="pdtb model init")
    ap.add_argument("--out", required=True, help="directory to write")
    ap.add_argument("--arch", choices=ARCHS, default="llama")
    ap.add_argument("--seed", type=int, default=DEFAULT_SEED)
    a = ap.parse_args(argv)
    path = init_tiny_model(a.out, a.arch, a.seed)
    print(f"wrote {a.arch} tiny model to {path}")
    return 0


def _keys(argv: list[str]) -> int:
    from pdtb.security import generate

    ap = argparse.ArgumentParser(prog="pdtb keys", description="write ZeroMQ CURVE server and client key pairs")
    ap.add_argument("--out", required=True)
    print(f"wrote CURVE keys to {generate(ap.parse_args(argv).out)}")
    return 0


def _dispatch(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "model" and rest[:1] == ["init"]:
        return _model_init(rest[1:])
    if cmd == "keys":
        return _keys(rest)
    if cmd == "generate":
        from pdtb.generate import main

        return main(rest)
    if cmd == "bench" and rest[:1] == ["engine"]:
        from pdtb.engine.bench import main

        return main(rest[1:])
    if cmd == "bench" and rest[:1] == ["serve"]:
        from pdtb.bench.cli import main

        return main(rest[1:])
    if cmd == "bench" and rest[:1] == ["migration"]:
        from pdtb.bench.migration import main

        return main(rest[1:])
    if cmd == "bench" and rest[:1] == ["sweep"]:
        from pdtb.bench.sweep import main

        return main(rest[1:])
    if cmd == "sim":
        from pdtb.sim.cli import main

        return main(rest)
    if cmd == "policies":
        from pdtb.policies.cli import main

        return main(rest)
    if cmd == "policy" and rest[:1] == ["check"]:
        from pdtb.policies.check import main

        return main(rest[1:])
    if cmd == "frontier":
        from pdtb.bench.frontier import main

        return main(rest)
    if cmd == "scorecard":
        from pdtb.bench.scorecard import main

        return main(rest)
    if cmd == "compare":
        from pdtb.bench.compare import main

        return main(rest)
    if cmd == "report":
        from pdtb.bench.report import main

        return main(rest)
    if cmd == "cluster":
        try:
            import ray  # noqa: F401
        except ImportError:
            raise CliError("pdtb cluster needs Ray: pip install 'pd-testbed[ray]'") from None
        from pdtb.ray_cluster.cli import main
        return main(rest)
    if cmd == "bench" and rest[:1] == ["roofline"]:
        from pdtb.engine.bench_roofline import main
        return main(rest[1:])
    if cmd == "bench" and rest[:1] == ["decode-kernel"]:
        from pdtb.engine.bench_decode_kernel import main

        return main(rest[1:])
    if cmd == "bench" and rest[:1] == ["steps"]:
        from pdtb.engine.bench_steps import main

        return main(rest[1:])
    if cmd == "bench" and rest[:1] == ["controller"]:
        from fairness.bench import main

        return main(rest[1:])
    if cmd == "bench" and rest[:1] == ["transport"]:
        from kv_transport.bench import main

        return main(rest[1:])
    if cmd == "bench" and rest[:1] == ["lockstep"]:
        from pdtb.bench.lockstep import main

        return main(rest[1:])
    if cmd in ("prefill", "decode", "colocated"):
        from pdtb.nodes.node_cli import main

        return main(cmd, rest)
    if cmd == "demo":
        from pdtb.demo import main

        return main(rest)
    if cmd == "router":
        from pdtb.router.main import main

        return main(rest)
    raise CliError(f"unknown command {' '.join(argv[:2])!r}\n{USAGE}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        rc = _dispatch(argv)
        sys.stdout.flush()  # (here: a reader gone early is a BrokenPipeError caught below, not at exit)
        return rc
    except CliError as e:
        return die(str(e))
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # stdout closed by its reader (`| head`): nothing more to say, nowhere to say it
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except Exception as e:  # files that cannot be written, addresses that cannot be bound: one line
        from pdtb.engine.model_info import ModelLoadError

        if isinstance(e, ModelLoadError):  # a model the engine cannot load or serve: its own words
            return die(str(e))
        if isinstance(e, OSError) or type(e).__module__.startswith("zmq"):
            return die(f"{type(e).__name__}: {e}")
        # Anything else is still one line (bad input no check foresaw: a results file of another
        # shape, a flag value out of range), with the traceback for whoever debugs it.
        if os.environ.get("PDTB_DEBUG"):
            raise
        where = traceback.extract_tb(e.__traceback__)[-1]
        first = (str(e).strip().splitlines() or [""])[0][:300]
        return die(f"{type(e).__name__}: {first} (at {os.path.basename(where.filename)}:{where.lineno}; "
                   f"PDTB_DEBUG=1 shows the traceback)", 1)


if __name__ == "__main__":
    sys.exit(main())
