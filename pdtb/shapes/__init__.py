"""Accelerators and model shapes: what a GPU offers (accelerators.py) and what a model's
configuration implies for KV pages and step costs (model_shape.py, model_configs/). Below the
engine: the engine's random initialisation and the simulator's cost models both read them."""
