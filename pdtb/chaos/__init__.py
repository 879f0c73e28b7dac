"""`pdtb chaos`: random faults at random times against a running cluster under a steady greedy
load, checked by an independent checker (transformers.generate on the same checkpoint)."""
