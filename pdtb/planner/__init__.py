"""Capacity planning on the simulator: the cluster split that serves a workload best per GPU."""
