"""Shape of one node's KV pages: the contract that pools and the transport agree on."""
from __future__ import annotations

from dataclasses import dataclass

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (torch at use only: the simulator's pools hold no storage and import no torch)
    import torch

DTYPES = ("float32", "float16", "bfloat16")  # the names; torch_dtype(name) is the torch dtype
ELEMENT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def torch_dtype(name: str) -> torch.dtype:
    import torch

    return getattr(torch, name)


def dtype_name(dtype: torch.dtype) -> str:
    for name in DTYPES:
        if torch_dtype(name) == dtype:
            return name
    raise ValueError(f"unsupported dtype {dtype}")


@dataclass(frozen=True)
class KVSpec:
    """Geometry of a KV page. A page holds K and V of `page_size` tokens for every layer.

    Pool memory layout (one tensor per pool):

        kv[layer, k_or_v, page, slot_in_page, kv_head, head_dim]

    so one request's pages for all layers can be gathered with one index_select on dim 2.
    """

    num_layers: int  # decoder layers of the model
    num_kv_heads: int  # key/value heads per layer (GQA-aware)
    head_dim: int  # channels per head
    page_size: int  # tokens per page
    dtype: str  # one of DTYPES

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "page_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KVSpec.{name} must be positive")
        if self.dtype not in DTYPES:
            raise ValueError(f"KVSpec.dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype)

    @property
    def bytes_per_page(self) -> int:
        elem = ELEMENT_BYTES[self.dtype]  # (a property on the hot path: no tensor made per call)
        return self.num_layers * 2 * self.page_size * self.num_kv_heads * self.head_dim * elem

    def pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold `num_tokens` tokens (ceil division)."""
        return -(-num_tokens // self.page_size)

    def page_shape(self, num_pages: int) -> tuple[int, ...]:
        """Shape of a contiguous export of `num_pages` pages."""
        return (self.num_layers, 2, num_pages, self.page_size, self.num_kv_heads, self.head_dim)
