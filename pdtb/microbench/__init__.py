"""Micro-benchmarks, each against a baseline measured in the same run: the engine against
`transformers.generate` (engine.py), a step's parts (steps.py, step_grid.py), the decode kernel
and the memory roofline (decode_kernel.py, roofline.py), the KV transport against raw pyzmq and
memcpy (transport.py, shm.py, link.py), the policies' per-step cost (controller.py), and
hand-offs in lockstep over each transport (lockstep.py). Nothing in the library imports them."""
