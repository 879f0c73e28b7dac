"""The colocated twin: prefill and decode in one process over one pool."""
