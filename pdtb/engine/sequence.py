"""A request as the engine sees it: token ids, sampling parameters, progress and status."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from pdtb.engine.timeline import Timeline


class SeqStatus(enum.IntEnum):
    """Ordered: everything above FINISHED_BOUNDARY is terminal."""

    WAITING = 0  # queued for (re)prefill
    WAITING_FOR_KV = 1  # decode side: pages are being transferred
    PARKED = 2  # decode side: pages live in the host tier
    RUNNING = 3  # scheduled for prefill chunks or decode steps
    FINISHED_BOUNDARY = 10
    FINISHED_STOPPED = 11  # EOS or a stop token
    FINISHED_LENGTH = 12  # max_tokens or the model's context reached
    FINISHED_ABORTED = 13  # cancelled by the client or failed with a reason

    @property
    def finished(self) -> bool:
        return self > SeqStatus.FINISHED_BOUNDARY


GREEDY_BELOW = 1e-5  # a temperature below this samples greedily


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16  # generated tokens to produce at most
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0  # nucleus mass kept when sampling
    seed: int | None = None  # per-request seed: same seed, same tokens, on any node
    ignore_eos: bool = False  # keep generating past EOS up to max_tokens
    stop_token_ids: tuple[int, ...] = ()  # extra ids that end the request
    first_index: int = 0  # output index of its first token (a seeded sample is drawn by output index)

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not (0.0 <= self.temperature <= 100.0):
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")

    @property
    def greedy(self) -> bool:
        # Below this, logits / temperature overflows float32 (1e-38 gave inf, then NaN
        # probabilities, and the sampler raised inside the node's step); vLLM uses the same bound.
        return self.temperature < GREEDY_BELOW


@dataclass(eq=False)
class Sequence:
    request_id: str
    token_ids: list[int]  # prompt followed by generated tokens
    num_prompt_tokens: int
    params: SamplingParams
    tenant: str = "default"
    priority: int = 0  # lower runs first
    slo_tier: str = ""  # SLO tier (request field or the router's tenant default; "": none)
    num_computed_tokens: int = 0  # tokens whose K/V are in this node's pages
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None  # "stop", "length" or "abort: <why>"
    arrival_time: float = field(default_factory=time.monotonic)
    num_preemptions: int = 0  # times its pages were dropped for recompute
    last_step: int = 0  # scheduler step that last served it (LRU eviction)
    timeline: Timeline = field(default_factory=Timeline)  # wall-clock stamps and waits (timeline.py)
    # prefix cache (scheduler.py): hashes of its full pages so far, how many of its page
    # table's leading pages are registered, and prompt tokens its first prefill took from the cache
    page_hashes: list[int] = field(default_factory=list)
    num_registered: int = 0
    num_cached_tokens: int = -1  # -1: not looked up yet

    @classmethod
    def from_prompt(cls, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    **kw) -> "Sequence":
        if not prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        return cls(request_id, list(prompt_token_ids), len(prompt_token_ids), params, **kw)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def in_prefill(self) -> bool:
        """True while more than the last sampled token still lacks K/V."""
        return self.num_uncomputed_tokens > 1 or self.num_output_tokens == 0
