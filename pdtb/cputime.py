"""A command's CPU seconds, its own processes' (user and system): what it costs, whatever else the
machine runs meanwhile, where its wall seconds stretch with the load beside it.

  python -m pdtb.cputime FILE -- CMD...   runs CMD, writes its CPU seconds to FILE, exits with its status
"""
from __future__ import annotations

import resource
import subprocess
import sys
import time


def children_cpu_s() -> float:
    """CPU seconds of this process's waited-for children so far."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run(cmd: list[str], **kw) -> tuple[subprocess.CompletedProcess, float, float]:
    """subprocess.run(cmd, **kw) and the command's (CPU seconds, wall seconds)."""
    t0, c0 = time.perf_counter(), children_cpu_s()
    p = subprocess.run(cmd, **kw)
    return p, children_cpu_s() - c0, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m pdtb.cputime FILE -- CMD...", file=sys.stderr)
        return 2
    p, cpu, _ = run(argv[2:])
    with open(argv[0], "w") as f:
        f.write(f"{cpu:.1f}\n")
    return p.returncode


if __name__ == "__main__":
    sys.exit(main())
