"""Shared model engine: loading, paged KV pool, paged attention, model runner, sampling."""
