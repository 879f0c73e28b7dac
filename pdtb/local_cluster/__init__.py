"""Clusters started on this host by scripts/launch_cluster.sh: their supervision."""
