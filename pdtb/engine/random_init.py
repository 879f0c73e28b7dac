"""A model with random weights built from a config alone: no checkpoint, no tokenizer.

What a step costs depends on the model's shape, not on its weights, so an 8B shape can be
timed on a GPU without downloading 16 GB. The config is a config.json path, a checkpoint
directory, or one of the shapes shipped in `pdtb/shapes/model_configs`.
"""
from __future__ import annotations

from pdtb.engine.model_info import ModelInfo, ModelLoadError, model_info_from_config


def random_model(config: str, device: str = "cpu", dtype: str = "float32"):
    """Return (model, info): the config's model class with random weights, in eval mode, its
    parameters created on `device` at `dtype`. ModelLoadError for a config it cannot build."""
    import torch
    import transformers
    from transformers.utils import logging as hf_logging

    from pdtb.engine.loader import resolve_dtype
    from pdtb.shapes.model_shape import config_path, load_config

    try:
        path = config_path(config)
        cfg = load_config(path)
    except ValueError as e:
        raise ModelLoadError(str(e)) from None
    info: ModelInfo = model_info_from_config(cfg, f"random:{config}", str(path))
    hf_logging.set_verbosity_error()
    fields = {k: v for k, v in cfg.items() if k != "model_type"}
    hf_config = transformers.AutoConfig.for_model(cfg["model_type"], **fields)
    # Parameters are allocated straight on the device: an 8B model initialised on the CPU first
    # would take 16 GB of host memory and minutes of random draws.
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=resolve_dtype(dtype))
    return model.eval(), info
