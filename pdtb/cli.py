"""`pdtb`: the single command-line entry point. Subcommands dispatch to their modules."""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback
from dataclasses import dataclass

from pdtb.common import CliError, die

@dataclass(frozen=True)
class Command:
    """One `pdtb` command: the words that name it and the `main(argv)` it runs."""

    words: tuple[str, ...]
    target: str  # "module:function"; the function takes the arguments after the words
    summary: str  # one line of `pdtb --help` (continued lines start with a newline)
    role: bool = False  # a node command: the function takes its role (the first word) first
    extra: str = ""  # a module of an optional extra the command needs, checked before it is imported


COMMANDS = (
    Command(("model", "init"), "pdtb.cli:model_init", "write the embedded tiny model as a HF checkpoint directory"),
    Command(("generate",), "pdtb.generate:main", "offline batched generation on the paged engine"),
    Command(("bench", "engine"), "pdtb.microbench.engine:main", "paged engine vs transformers generate (same run)"),
    Command(("bench", "transport"), "pdtb.microbench.transport:main", "KV transport throughput vs raw pyzmq and memcpy (same run)"),
    Command(("bench", "steps"), "pdtb.microbench.steps:main", "engine step time by what it carries (long rows, prefill chunks)"),
    Command(("bench", "roofline"), "pdtb.microbench.roofline:main", "decode step time against the memory roofline, by batch size"),
    Command(("bench", "decode-kernel"), "pdtb.microbench.decode_kernel:main",
            "the Triton paged decode kernel's bandwidth by launch setting (GPU)"),
    Command(("bench", "controller"), "pdtb.microbench.controller:main", "per-step decision cost of each policy at 100 / 1k / 10k requests"),
    Command(("bench", "router"), "pdtb.microbench.router:main",
            "router CPU per request and per token, saturation against a minimal relay, added latency"),
    Command(("bench", "serve"), "pdtb.client.serve:main", "load-test client against an OpenAI-compatible endpoint"),
    Command(("bench", "sweep"), "pdtb.client.sweep:main", "a workload at a series of offered loads: attainment, goodput, knee"),
    Command(("bench", "migration"), "pdtb.client.downtime:main",
            "live migration downtime between decode nodes under load, against its ITL"),
    Command(("bench", "lockstep"), "pdtb.microbench.lockstep:main", "a workload's hand-offs into a real decode node in a fixed "
            "order of events:\nits admission verdicts, to compare KV transports decision by decision"),
    Command(("cluster",), "pdtb.ray_cluster.cli:main", "up|down|status: a cluster placed and supervised by Ray (the ray extra)",
            extra="ray"),
    Command(("chaos",), "pdtb.chaos.cli:main", "a fault campaign under a steady greedy load, checked against "
            "transformers.generate\n(random faults from a seed: kills, drains, pauses, migrations, transfer faults, router kills)"),
    Command(("supervise",), "pdtb.local_cluster.supervise:main",
            "--run-dir DIR: restart a local cluster's processes that exit (launch_cluster.sh --restart-failed)"),
    Command(("policies",), "pdtb.policies.cli:main", "the policies by name and source; `policies show REF`: one's settings"),
    Command(("policy", "check"), "pdtb.policies.check:main", "REF: a policy's conformance: legal answers, pages conserved,\n"
            "every request ends, deterministic under a seed (REF: a name, module:Class, file.py:Class)"),
    Command(("sim",), "pdtb.sim.cli:main", "simulate a cluster at any scale on the real scheduler and policies\n"
            "(calibrate, validate, roofline, reproduce mcsf|vtc|essay, plan)"),
    Command(("frontier",), "pdtb.figures.frontier:main", "fairness-throughput frontier of sweep files (table, plot, Pareto points)"),
    Command(("scorecard",), "pdtb.figures.scorecard:main", "DIR: every policy of every scenario of scripts/scorecard.sh, against fcfs"),
    Command(("report",), "pdtb.figures.report:main", "markdown report and plots comparing results files"),
    Command(("compare",), "pdtb.figures.compare:main", "per-run minnow p99 TTFT/ITL and throughput, with ratios vs fcfs"),
    Command(("prefill",), "pdtb.node_cli:main", "start a prefill node", role=True),
    Command(("decode",), "pdtb.node_cli:main", "start a decode node", role=True),
    Command(("colocated",), "pdtb.node_cli:main", "start a colocated node", role=True),
    Command(("router",), "pdtb.router.main:main", "start the HTTP router"),
    Command(("demo",), "pdtb.demo:main", "send a few streaming requests to a running router"),
    Command(("top",), "pdtb.client.top:main", "URL: a live view of a running cluster: pages per node and tenant "
            "against each share,\ninherited pages, queues, tier moves per second, recent TTFT and ITL per tenant"),
    Command(("keys",), "pdtb.cli:keys", "write ZeroMQ CURVE keys for --curve-dir (encrypted, authenticated sockets)"),
)


def usage() -> str:
    lines = ["pdtb <command> [options]", "", "commands:"]
    for c in COMMANDS:
        first, *more = c.summary.split("\n")
        lines.append(f"  {' '.join(c.words):<20} {first}")
        lines += [f"  {'':<20} {m}" for m in more]
    return "\n".join(lines) + "\n"


def find(argv: list[str]) -> tuple[Command, list[str]] | None:
    """The command `argv` names (the longest match of its words) and the arguments after them."""
    best = max((c for c in COMMANDS if tuple(argv[:len(c.words)]) == c.words), key=lambda c: len(c.words), default=None)
    return None if best is None else (best, argv[len(best.words):])


def model_init(argv: list[str]) -> int:
    from pdtb.engine.tiny_model import ARCHS, DEFAULT_SEED, SIZES, init_tiny_model

    ap = argparse.ArgumentParser(prog="pdtb model init")
    ap.add_argument("--out", required=True, help="directory to write")
    ap.add_argument("--arch", choices=ARCHS, default="llama")
    ap.add_argument("--seed", type=int, default=DEFAULT_SEED)
    ap.add_argument("--size", choices=tuple(SIZES), default="tiny",
                    help="tiny: the embedded model (head size 32); head64: 12M parameters, head size 64")
    a = ap.parse_args(argv)
    path = init_tiny_model(a.out, a.arch, a.seed, a.size)
    print(f"wrote {a.arch} {a.size} model to {path}")
    return 0


def keys(argv: list[str]) -> int:
    from pdtb.security import generate

    ap = argparse.ArgumentParser(prog="pdtb keys", description="write ZeroMQ CURVE server and client key pairs")
    ap.add_argument("--out", required=True)
    print(f"wrote CURVE keys to {generate(ap.parse_args(argv).out)}")
    return 0


def _dispatch(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    found = find(argv)
    if found is None:
        raise CliError(f"unknown command {' '.join(argv[:2])!r}\n{usage()}")
    cmd, rest = found
    if cmd.extra:
        try:
            importlib.import_module(cmd.extra)
        except ImportError:
            raise CliError(f"pdtb {' '.join(cmd.words)} needs {cmd.extra}: pip install 'pd-testbed[{cmd.extra}]'") from None
    module, func = cmd.target.split(":")
    run = getattr(importlib.import_module(module), func)
    return run(cmd.words[0], rest) if cmd.role else run(rest)


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
