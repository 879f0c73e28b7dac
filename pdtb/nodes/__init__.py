"""What the router and the nodes share: control-plane messages, node runtime, metrics."""
