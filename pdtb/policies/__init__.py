"""Tools for policy authors: listing, showing and checking policies.

Tools for policy authors: `pdtb policies` (list, show) and `pdtb policy check` (a
conformance run of any policy through the real scheduler and the decode node's placement)."""
