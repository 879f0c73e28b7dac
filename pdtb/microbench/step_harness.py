"""The engine a measured step runs on and the clock that times it (steps and the grid).

The harness a measured step runs in: the engine it runs on and the clock it is timed by
(`pdtb bench steps`, steps.py, and its grid, step_grid.py)."""
from __future__ import annotations

import argparse
import time


def build_engine(a: argparse.Namespace, num_pages: int):
    """The engine the steps run on: `--model` (or the embedded default) or `--random-init`."""
    from pdtb.common import CliError
    from pdtb.engine.loader import resolve_model_arg
    from pdtb.engine.config import EngineConfig
    from pdtb.engine.engine import LLMEngine

    try:
        if a.random_init:
            from pdtb.engine.random_init import random_model

            model, info = random_model(a.random_init, a.device, a.dtype)
            cfg = EngineConfig(info.model_dir, page_size=a.page_size, num_pages=num_pages, device=a.device,
                               dtype=a.dtype, torch_threads=a.threads)
            return LLMEngine(cfg, model=model, info=info)
        cfg = EngineConfig(resolve_model_arg(a.model), page_size=a.page_size, num_pages=num_pages, device=a.device,
                           dtype=a.dtype, torch_threads=a.threads)
    except ValueError as e:  # a bad device, dtype or config: one line
        raise CliError(str(e).splitlines()[0]) from None
    return LLMEngine(cfg)


def step_timer(device: str):
    """A function that runs one step and returns its milliseconds. A GPU runs kernels after the
    call returns: the device is synchronized before the clock starts and before it is read."""
    import torch

    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def timed(runner, rows) -> float:
        sync()
        t0 = time.perf_counter()
        runner.run(rows)
        sync()
        return 1000 * (time.perf_counter() - t0)
    return timed
