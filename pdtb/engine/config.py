"""Frozen configuration of one engine instance."""
from __future__ import annotations

from dataclasses import dataclass

from pdtb.engine.kv_spec import DTYPES
from pdtb.engine.page_pool import CHARGES
from pdtb.engine.scheduler import SchedulerConfig

DECODE_ATTENTION = ("auto", "torch")


@dataclass(frozen=True)
class EngineConfig:
    model_dir: str  # local HF checkpoint directory
    page_size: int = 16  # tokens per KV page
    num_pages: int = 2048  # pages in the device tier
    device: str = "cpu"  # "cpu" or "cuda[:N]"
    dtype: str = "float32"  # float32 | float16 | bfloat16
    max_num_seqs: int = 256  # running requests at most
    max_num_batched_tokens: int = 2048  # tokens per step (chunked prefill budget)
    max_model_len: int | None = None  # None: the model's own context length
    torch_threads: int | None = None  # torch intra-op threads (None: torch default)
    host_kv_pages: int = 0  # pages in the host tier (pinned host memory on a GPU); 0: none
    # "auto": decode rows read their pages in place: on a GPU through the Triton kernel
    # (triton_decode.py, where torch ships Triton), on a float32 CPU pool through the C kernel
    # (pdtb/engine/csrc, built at first use where a C compiler is found); "torch": pages
    # gathered for torch attention (the read cache and batched matmuls on the CPU), the path
    # too for other CPU dtypes and where no kernel can be had
    decode_attention: str = "auto"
    # on a GPU with the Triton kernel: decode steps replayed from CUDA graphs at bucketed batch
    # sizes (cuda_graphs.py)
    cuda_graphs: bool = True
    # on a GPU with Triton: the model's RMSNorm modules run as one fused kernel each
    # (fused_norm.py) instead of transformers' seven or eight elementwise kernels
    fused_norm: bool = True
    # on the CPU: Llama-family decoder layers run as one plain function over their weights
    # (lean_forward.py), the same arithmetic without transformers' per-layer wrappers
    lean_forward: bool = True
    # prefix cache: full pages shared by requests whose prompts start the same way
    # (page_pool.py); `charge`: how a shared page counts against quotas (page_pool.CHARGES)
    prefix_cache: bool = True
    charge: str = "split"
    # pools a KV sender on this host writes into one-sided (kv_transport/shm_backend.py): the
    # device tier (shared memory on the CPU, a CUDA IPC handle on a GPU) and, on a CPU
    # engine, the host tier (a GPU engine's pinned host tier takes chunks)
    shared_kv: bool = False

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ValueError("page_size must be >= 1")
        if self.decode_attention not in DECODE_ATTENTION:
            raise ValueError(f"decode_attention must be one of {DECODE_ATTENTION}")
        if self.charge not in CHARGES:
            raise ValueError(f"charge must be one of {', '.join(CHARGES)}")
        if self.host_kv_pages < 0:
            raise ValueError("host_kv_pages must be >= 0")
        if self.num_pages < 1:
            raise ValueError("num_pages must be >= 1")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.device.startswith("cuda"):
            import torch

            if not torch.cuda.is_available():
                raise ValueError(f"device {self.device!r}: this torch build has no usable CUDA device "
                                 f"(torch {torch.__version__})")

    def scheduler_config(self, model_max_len: int) -> SchedulerConfig:
        max_len = min(self.max_model_len or model_max_len, model_max_len)
        return SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens, max_len)
