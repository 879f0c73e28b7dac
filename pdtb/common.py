"""Helpers shared by the CLI commands."""
from __future__ import annotations

import sys
from pathlib import Path


class CliError(Exception):
    """A user error: printed as one line, exit code 2."""


def resolve_model(model_dir: str | None) -> str:
    """`--model DIR` validated, or the embedded default (created on first use)."""
    from pdtb.engine.model_info import ModelLoadError, read_model_info
    from pdtb.engine.tiny_model import ensure_default_model

    if model_dir is None:
        return str(ensure_default_model())
    try:
        read_model_info(model_dir)
    except ModelLoadError as e:
        raise CliError(str(e)) from None
    return str(Path(model_dir))


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
