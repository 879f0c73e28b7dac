"""`RooflineCost`: a step's time from a named accelerator's peak figures and a model's shape.

    step = max(compute, memory) + all-reduce + overhead

    compute  = FLOPs / peak FLOP/s, per GPU:
               (2 * params * tokens  +  4 * layers * heads * head_dim * (decode_ctx + prefill_attn)) / tp
               (a multiply-add per weight per token; QK^T and PV per query-key pair)
    memory   = bytes / HBM bandwidth, per GPU:
               weights / tp  +  KV read (decode_ctx + the prefill chunks' context)  +  KV written (tokens),
               KV at the GPU's share of the KV heads
    all-reduce (tp > 1): 2 per layer (after attention, after the MLP) of tokens * hidden * dtype
               bytes, ring: 2 * (tp - 1) / tp of it over one GPU's NVLink, plus a latency each;
               not overlapped with the layer's work (it sits between layers)
    overhead = fixed per step: scheduling, sampling, kernel launches

Tensor parallel splits the weights and the attention heads over `tp` GPUs. KV heads split too
while `tp` divides them; beyond that each GPU holds one KV head (replicated, as vLLM does).

A chunk's context is not in a `StepShape` (only the sum of its query-key pairs is); the chunks
are taken to be of one size, tokens / chunks, which makes it exact for a single chunk:
n * offset + n * (n + 1) / 2 pairs over n tokens gives offset + n.

KV moves between nodes and tiers split the same way: each GPU moves its own share of a
request's KV over its own link (one NIC and one PCIe link per GPU), all at once.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from pdtb.shapes.accelerators import Accelerator, accelerator, kv_link
from pdtb.sim.cost import LinkModel, StepShape
from pdtb.shapes.model_shape import ModelShape

GIB = 2**30


@dataclass(frozen=True)
class StepTerms:
    """A step's time, term by term (seconds)."""

    compute_s: float  # FLOPs at peak
    memory_s: float  # bytes at HBM bandwidth
    comm_s: float  # tensor-parallel all-reduces
    overhead_s: float  # fixed per step

    @property
    def total_s(self) -> float:
        return max(self.compute_s, self.memory_s) + self.comm_s + self.overhead_s

    @property
    def bound(self) -> str:
        """Which roof the step sits under: "compute" or "memory"."""
        return "compute" if self.compute_s >= self.memory_s else "memory"


def prefill_context(shape: StepShape) -> float:
    """Context tokens the step's prefill chunks read, taking the chunks to be of one size."""
    if not shape.prefill_chunks:
        return 0.0
    n = shape.prefill_tokens / shape.prefill_chunks
    return shape.prefill_attn / n + shape.prefill_chunks * (n - 1) / 2


@dataclass(frozen=True)
class RooflineCost:
    """CostModel of `shape` served at `dtype_bytes` on `tp` GPUs of kind `accel`."""

    accel: Accelerator
    shape: ModelShape
    tp: int = 1  # tensor-parallel GPUs per node
    page_size: int = 16  # tokens per KV page
    dtype_bytes: int = 2  # weights and KV (bf16)
    overhead_s: float = 1e-3  # per step; a CUDA-graph engine's decode step sits near 1 ms above the roofline
    mem_util: float = 0.9  # share of HBM the node may use (vLLM's gpu_memory_utilization default)
    link: LinkModel = field(default_factory=kv_link)  # prefill -> decode KV link, per GPU
    reserve_bytes: float = 2 * GIB  # per GPU, not for KV: activations, CUDA context, NCCL buffers

    def __post_init__(self) -> None:
        s, tp = self.shape, self.tp
        if tp < 1 or s.heads % tp:
            raise ValueError(f"tp={tp} must divide the model's {s.heads} attention heads")
        if s.kv_heads % tp and tp % s.kv_heads:
            raise ValueError(f"tp={tp} and {s.kv_heads} KV heads: one must divide the other")
        if self.page_size < 1 or self.dtype_bytes not in (1, 2, 4):
            raise ValueError("page_size must be >= 1 and dtype_bytes one of 1, 2, 4")
        if not 0 < self.mem_util <= 1 or self.overhead_s < 0 or self.reserve_bytes < 0:
            raise ValueError("mem_util must be in (0, 1]; overhead and reserve non-negative")

    @classmethod
    def of(cls, accel_name: str, model_config, **kw) -> "RooflineCost":
        """From a catalog name and a config (dict, path, checkpoint directory or shipped name)."""
        return cls(accelerator(accel_name), ModelShape.from_config(model_config), **kw)

    @property
    def name(self) -> str:
        return f"roofline:{self.accel.name}:{self.shape.name}:tp{self.tp}"

    @property
    def page_bytes(self) -> int:
        """KV bytes of one page of the logical pool: all layers, K and V, every TP rank's heads."""
        return self.page_size * self.shape.kv_bytes_per_token(self.dtype_bytes)

    @property
    def kv_share(self) -> float:
        """Share of a token's KV that one GPU holds."""
        return max(1, self.shape.kv_heads // self.tp) / self.shape.kv_heads

    def terms(self, s: StepShape) -> StepTerms:
        """The step's time, term by term (see the module docstring)."""
        m, a, tp = self.shape, self.accel, self.tp
        flops = (2 * m.params * s.tokens + m.attn_flops_per_pair() * (s.decode_ctx + s.prefill_attn)) / tp
        kv_token = m.kv_bytes_per_token(self.dtype_bytes) * self.kv_share
        nbytes = m.weight_bytes(self.dtype_bytes) / tp + kv_token * (s.decode_ctx + prefill_context(s) + s.tokens)
        comm = 0.0
        if tp > 1:
            msg = s.tokens * m.hidden * self.dtype_bytes
            comm = 2 * m.layers * (a.peer_latency_s + 2 * (tp - 1) / tp * msg / a.peer_bytes_per_s)
        return StepTerms(flops / a.flops, nbytes / a.hbm_bytes_per_s, comm, self.overhead_s)

    @cached_property
    def _per_step(self) -> tuple:
        """The terms' constants, worked out once (step_s runs once per simulated step)."""
        m, a, tp = self.shape, self.accel, self.tp
        kv_token = m.kv_bytes_per_token(self.dtype_bytes) * self.kv_share
        comm = (2 * m.layers * a.peer_latency_s, 2 * m.layers * 2 * (tp - 1) / tp * m.hidden * self.dtype_bytes
                / a.peer_bytes_per_s) if tp > 1 else (0.0, 0.0)
        return (2 * m.params / tp / a.flops, m.attn_flops_per_pair() / tp / a.flops,
                m.weight_bytes(self.dtype_bytes) / tp / a.hbm_bytes_per_s, kv_token / a.hbm_bytes_per_s, *comm)

    def step_s(self, shape: StepShape) -> float:
        """Seconds one step of this shape takes (`terms(shape).total_s`, from constants worked
        out once); an empty step costs nothing."""
        tokens = shape.decode_rows + shape.prefill_tokens
        if not tokens:
            return 0.0
        per_token, per_pair, weights, per_kv, comm_lat, comm_per_token = self._per_step
        compute = per_token * tokens + per_pair * (shape.decode_ctx + shape.prefill_attn)
        memory = weights + per_kv * (shape.decode_ctx + prefill_context(shape) + tokens)
        return max(compute, memory) + (comm_lat + comm_per_token * tokens if self.tp > 1 else 0.0) + self.overhead_s

    def decode_s(self, rows: int, ctx: int) -> float:
        """`step_s(StepShape(rows, ctx))`, the same sums without building the shape (a run of
        decode steps works out thousands of them: pdtb/sim/coast.py)."""
        per_token, per_pair, weights, per_kv, comm_lat, comm_per_token = self._per_step
        compute = per_token * rows + per_pair * ctx
        memory = weights + per_kv * (ctx + 0.0 + rows)
        return max(compute, memory) + (comm_lat + comm_per_token * rows if self.tp > 1 else 0.0) + self.overhead_s

    def transfer_s(self, nbytes: int) -> float:
        """One hand-off of `nbytes` (whole-model KV): every GPU sends its share over its own NIC."""
        return self.link.seconds(nbytes * self.kv_share)

    def tier_move_s(self, nbytes: int) -> float:
        """A copy of `nbytes` between device and host: every GPU over its own PCIe link."""
        return self.accel.host_link.seconds(nbytes * self.kv_share)

    def pool_pages(self) -> int:
        """Pages of the device KV pool: per GPU, what is left of mem_util * HBM once the
        weights and the reserve are in, over one page's share on that GPU (0: nothing fits)."""
        free = self.mem_util * self.accel.hbm_bytes - self.shape.weight_bytes(self.dtype_bytes) / self.tp \
            - self.reserve_bytes
        return max(0, int(free // (self.page_bytes * self.kv_share)))
