"""pd-testbed command-line entry points."""
