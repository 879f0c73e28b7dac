"""Accelerators the roofline cost model knows, by name, with the vendor's published figures.

Every figure is the datasheet's peak (dense, no sparsity); memory sizes are the datasheet's
decimal GB. The host link is the effective rate of a bulk copy, below the PCIe raw rate
(128b/130b coding and transaction overhead take about 15%).

    name        bf16 dense   HBM        HBM size   host link       GPU-GPU (NVLink, one way)
    h100-sxm    989 TFLOP/s  3.35 TB/s  80 GB      PCIe5 ~55 GB/s  450 GB/s
    h200        989 TFLOP/s  4.8 TB/s   141 GB     PCIe5 ~55 GB/s  450 GB/s
    a100-80gb   312 TFLOP/s  2.039 TB/s 80 GB      PCIe4 ~25 GB/s  300 GB/s

The KV hand-off between a prefill and a decode node crosses the network, not NVLink: the
default is one 400 Gb/s InfiniBand NDR port per GPU (as in a DGX H100: eight ConnectX-7 ports
for eight GPUs), overridable from the command line.
"""
from __future__ import annotations

from dataclasses import dataclass

GB = 1e9


@dataclass(frozen=True)
class LinkModel:
    """A link as bandwidth plus a fixed latency; what transfers and tier moves cost."""

    bytes_per_s: float
    latency_s: float = 0.0

    def __post_init__(self) -> None:
        if self.bytes_per_s <= 0 or self.latency_s < 0:
            raise ValueError("a link needs a positive bandwidth and a non-negative latency")

    def seconds(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.bytes_per_s


@dataclass(frozen=True)
class Accelerator:
    """One GPU's peak figures: what a step's compute, memory traffic and copies run against."""

    name: str
    flops: float  # peak dense bf16/fp16 tensor FLOP/s
    hbm_bytes_per_s: float  # device memory bandwidth, bytes/s
    hbm_bytes: float  # device memory, bytes
    host_link: LinkModel  # device <-> host copies (tier moves), per GPU
    peer_bytes_per_s: float  # GPU-GPU bandwidth in one direction (tensor-parallel all-reduce)
    peer_latency_s: float  # fixed cost of one small all-reduce among a node's GPUs

    def __post_init__(self) -> None:
        if min(self.flops, self.hbm_bytes_per_s, self.hbm_bytes, self.peer_bytes_per_s) <= 0:
            raise ValueError(f"accelerator {self.name!r}: rates and sizes must be positive")
        if self.peer_latency_s < 0:
            raise ValueError(f"accelerator {self.name!r}: latency must be non-negative")


# PCIe Gen5 x16: 64 GB/s per direction raw (PCI-SIG Gen5 spec); ~55 GB/s is what a pinned
# cudaMemcpy reaches. A copy's fixed cost (launch, DMA set-up) is ~10 us.
_PCIE5 = LinkModel(55 * GB, 10e-6)
# PCIe Gen4 x16: 32 GB/s per direction raw (PCI-SIG Gen4 spec); ~25 GB/s effective.
_PCIE4 = LinkModel(25 * GB, 10e-6)
# NCCL all-reduce of a small message inside one NVLink node: a few microseconds.
_ALLREDUCE_LATENCY_S = 5e-6

ACCELERATORS: dict[str, Accelerator] = {
    "h100-sxm": Accelerator(
        "h100-sxm",
        flops=989e12,  # NVIDIA H100 Tensor Core GPU datasheet: BF16 1,979 TFLOPS with sparsity, half dense
        hbm_bytes_per_s=3.35e12,  # same datasheet, H100 SXM: 3.35 TB/s
        hbm_bytes=80 * GB,  # same datasheet, H100 SXM: 80 GB
        host_link=_PCIE5,  # same datasheet: PCIe Gen5 128 GB/s (both directions together)
        peer_bytes_per_s=450 * GB,  # same datasheet: NVLink 900 GB/s (both directions together)
        peer_latency_s=_ALLREDUCE_LATENCY_S),
    "h200": Accelerator(
        "h200",
        flops=989e12,  # NVIDIA H200 Tensor Core GPU datasheet (SXM): BF16 1,979 TFLOPS with sparsity
        hbm_bytes_per_s=4.8e12,  # same datasheet: 4.8 TB/s HBM3e
        hbm_bytes=141 * GB,  # same datasheet: 141 GB
        host_link=_PCIE5,  # same datasheet: PCIe Gen5 128 GB/s
        peer_bytes_per_s=450 * GB,  # same datasheet: NVLink 900 GB/s
        peer_latency_s=_ALLREDUCE_LATENCY_S),
    "a100-80gb": Accelerator(
        "a100-80gb",
        flops=312e12,  # NVIDIA A100 Tensor Core GPU datasheet: BF16 Tensor Core 312 TFLOPS (624 sparse)
        hbm_bytes_per_s=2.039e12,  # same datasheet, A100 80GB SXM: 2,039 GB/s HBM2e
        hbm_bytes=80 * GB,  # same datasheet: 80 GB
        host_link=_PCIE4,  # same datasheet: PCIe Gen4 64 GB/s (both directions together)
        peer_bytes_per_s=300 * GB,  # same datasheet: NVLink 600 GB/s (both directions together)
        peer_latency_s=_ALLREDUCE_LATENCY_S),
}

# The prefill -> decode KV link, per GPU: InfiniBand NDR 400 Gb/s = 50 GB/s (NVIDIA ConnectX-7
# datasheet), ~10 us for a small RDMA write to complete across a switch.
KV_LINK_GBPS = 400.0
KV_LINK_LATENCY_S = 10e-6


def kv_link(gbit_per_s: float = KV_LINK_GBPS, latency_s: float = KV_LINK_LATENCY_S) -> LinkModel:
    """The network link a KV hand-off crosses, from its rate in Gbit/s (as NICs are sold)."""
    return LinkModel(gbit_per_s * 1e9 / 8, latency_s)


def accelerator(name: str) -> Accelerator:
    """The catalog entry `name`; ValueError naming the known ones otherwise."""
    if name not in ACCELERATORS:
        raise ValueError(f"unknown accelerator {name!r}; choose one of {', '.join(ACCELERATORS)}")
    return ACCELERATORS[name]
