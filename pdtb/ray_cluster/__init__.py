"""Clusters placed and supervised by Ray (`pdtb cluster up|down|status --ray ...`, the `ray` extra).

Ray places the processes and watches them; KV bytes and control messages go between the
processes as on one host. See launch.py.
"""
