"""Helpers shared by the CLI commands."""
from __future__ import annotations

import sys


class CliError(Exception):
    """A user error: printed as one line, exit code 2."""


def host_port(host: str, port: int | str) -> str:
    """HOST:PORT for a URL or a ZeroMQ tcp endpoint: an IPv6 address in brackets ([::1]:8000)."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def die(msg: str, code: int = 2) -> int:
    print(f"pdtb: error: {msg}", file=sys.stderr)
    return code


def freeze_heap() -> None:
    """Move every object alive now (model, tokenizer, modules) out of the garbage collector's
    reach. A long-running serving process otherwise pays a full collection over hundreds of
    thousands of long-lived objects every so often: a 10-30 ms stall of the event loop that
    lands in some request's inter-token gap. Call once, after start-up."""
    import gc

    gc.collect()
    gc.freeze()


def host_facts() -> dict:
    """Where a measurement ran: the CPU model, cores, memory, Python and the versions of the
    libraries figures depend on (a calibration, a results document records them)."""
    import importlib.metadata as md
    import os
    import platform
    from pathlib import Path

    cpu = platform.processor() or "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        mem = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30)
    except (ValueError, OSError):
        mem = None
    versions = {}
    for name in ("torch", "transformers", "pyzmq"):
        try:
            versions[name] = md.version(name)
        except md.PackageNotFoundError:
            versions[name] = None
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": mem, "python": platform.python_version(),
            "versions": versions}
