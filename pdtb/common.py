"""Helpers shared by the CLI commands."""
from __future__ import annotations

import sys


class CliError(Exception):
    """A user error: printed as one line, exit code 2."""


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
