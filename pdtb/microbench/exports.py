"""What the transport benchmarks (transport.py, shm.py) share: the requests they move and the
rounding of their figures."""
from __future__ import annotations

from kv_transport.testing import TINY_SPEC as BENCH_SPEC
from pdtb.engine.kv_export import KVExport, export_request
from pdtb.engine.page_pool import PagePool


def sig(x: float, digits: int = 4) -> float:
    """x to `digits` significant figures: a ratio of 0.03 keeps its precision as well as one of 30."""
    return float(f"{x:.{digits}g}")


def make_exports(pool: PagePool, sizes: list[int], prefix: str) -> list[KVExport]:
    out = []
    for i, n in enumerate(sizes):
        rid = f"{prefix}{i}"
        pages = pool.allocate(rid, n)
        assert pages is not None, "bench pool too small"
        out.append(export_request(pool, rid, n * BENCH_SPEC.page_size))
        pool.free(rid)
    return out
