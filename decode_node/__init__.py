"""Decode node: adopts inherited pages from prefill and decodes with continuous batching."""
