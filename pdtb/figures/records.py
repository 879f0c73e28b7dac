"""`RequestSpec` (what to send), `RequestRecord` (what happened).

The two dataclasses at the client's seams: what to send (RequestSpec) and what happened
(RequestRecord). Times are seconds since the run's start."""
from __future__ import annotations

from dataclasses import dataclass, field

OK, FAILED = "ok", "failed"
CUT_OFF = "cut off: still running when the run's drain timeout ended"  # a failed request's error


@dataclass(frozen=True)
class RequestSpec:
    """One request of a workload, before it is sent."""

    send_time: float  # scheduled send time, s since the run's start
    tenant: str  # sent as the OpenAI `user`
    klass: str  # workload class ("whale", "minnow", a tenant's class, "trace")
    prompt_len: int  # prompt tokens
    output_len: int  # output tokens (exact: ignore_eos)
    priority: int | None = None  # sent when not None; lower runs first
    slo_tier: str | None = None  # sent as `slo_tier` when not None (memfair --quota-by slo-tier)
    blocks: tuple[int, ...] = ()  # ids of the shared blocks the prompt opens with (pdtb/client/prefix.py)
    block_len: int = 0  # tokens per block (with blocks: at least 1)

    def __post_init__(self) -> None:
        if self.blocks and self.block_len < 1:
            raise ValueError(f"a request with blocks needs block_len >= 1, got {self.block_len}")


def _copy(x):
    """A copy of a JSON value (copy.deepcopy's memo is most of its time on these small trees)."""
    if type(x) is dict:
        return {k: _copy(v) for k, v in x.items()}
    if type(x) is list:
        return [_copy(v) for v in x]
    return x


_JSON_ORDER = ("tenant", "class", "prompt_tokens", "output_tokens", "send_time", "first_token_time",
               "token_times", "end_time", "status", "error", "server_timing",
               "requested_output_tokens", "scheduled_time", "priority", "parse_s", "cached_tokens")


@dataclass
class RequestRecord:
    """One request as the client measured it. JSON key `class` holds `klass`."""

    tenant: str
    klass: str
    prompt_tokens: int  # prompt tokens sent
    requested_output_tokens: int  # max_tokens sent
    output_tokens: int = 0  # tokens received: the server's usage.completion_tokens if it sent one,
    # else the tokens counted in the stream (token_ids, or one per chunk with text)
    scheduled_time: float = 0.0  # when the workload wanted it sent
    send_time: float = 0.0  # just before the HTTP request went out
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # arrival of every token counted in the stream
    end_time: float | None = None  # [DONE], error or timeout
    status: str = FAILED  # "ok" or "failed"
    error: str | None = None
    server_timing: dict = field(default_factory=dict)  # the router's `pdtb_timing`
    priority: int | None = None
    parse_s: float = 0.0  # client time spent parsing this request's stream
    # prompt tokens the server served from its prefix cache (usage.prompt_tokens_details.cached_tokens);
    # None: the server did not say
    cached_tokens: int | None = None

    def to_json(self) -> dict:
        """The results file's request object: the stable keys first, then the extras."""
        # (not dataclasses.asdict: it deep-copies every token time, most of a large run's writing)
        d = {f: getattr(self, f) for f in self.__dataclass_fields__}
        d["class"] = d.pop("klass")
        d["token_times"] = list(self.token_times)
        d["server_timing"] = _copy(self.server_timing)
        return {k: d[k] for k in _JSON_ORDER}

    @classmethod
    def from_json(cls, d: dict) -> "RequestRecord":
        d = dict(d)
        d["klass"] = d.pop("class")
        d.setdefault("requested_output_tokens", d.get("output_tokens", 0))
        known = cls.__dataclass_fields__
        return cls(**{k: v for k, v in d.items() if k in known})
