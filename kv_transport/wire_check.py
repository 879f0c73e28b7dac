"""Errors, limits and field validators used by `wire.decode`.

Every check raises a `WireError` subclass whose `field` names the offending field and whose
`transfer_id` is set once the message's transfer id has been read (so a receiver can fail
that one transfer instead of dropping the message silently).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import msgpack

from pdtb.engine.kv_spec import KVSpec


class WireError(ValueError):
    """A message that must not be trusted. `field` names the first bad field."""

    def __init__(self, field: str, detail: str, transfer_id: str | None = None) -> None:
        super().__init__(f"{field}: {detail}")
        self.field = field
        self.transfer_id = transfer_id
        self.batch_ids: tuple[str, ...] = ()  # a bad batch: the transfers it carried (each is NACKed)


class WireVersionError(WireError):
    """The peer speaks another wire version."""


class WireFieldError(WireError):
    """A field is missing, of the wrong type, out of range, or disagrees with our KVSpec."""


class WireSizeError(WireError):
    """A frame or message is larger than the limits, or a payload has the wrong length."""


class WireChecksumError(WireError):
    """The payload bytes do not match the checksum the sender computed."""


@dataclass(frozen=True)
class WireLimits:
    """What a receiver accepts. Built from its KVSpec and TransportConfig."""

    spec: KVSpec  # the receiver's page geometry; headers must match it exactly
    max_pages: int  # pages in one transfer
    max_message_bytes: int  # payload bytes in one message (and in one frame)
    max_header_bytes: int = 1 << 20  # msgpack frame 0
    max_tokens: int = 1 << 20  # entries in a token id list
    max_batch: int = 64  # transfers in one batch message
    max_id_len: int = 256  # characters in an id, tenant, code

    @functools.cached_property
    def bytes_per_page(self) -> int:
        return self.spec.bytes_per_page

    @functools.cached_property
    def row_bytes(self) -> int:
        """Bytes of one (layer, k_or_v, page) slab: chunk boundaries fall on these."""
        return self.bytes_per_page // (2 * self.spec.num_layers)

    @functools.cached_property
    def chunk_align(self) -> int:
        """Chunk sizes are multiples of this: whole slabs and whole uint64 words."""
        return math.lcm(self.row_bytes, 8)

    @functools.cached_property
    def max_transfer_bytes(self) -> int:
        return self.max_pages * self.bytes_per_page

    @classmethod
    def from_config(cls, config, spec: KVSpec) -> "WireLimits":
        return cls(spec=spec, max_pages=config.max_pages_per_transfer,
                   max_message_bytes=config.max_message_bytes,
                   max_header_bytes=config.max_header_bytes, max_tokens=config.max_tokens,
                   max_batch=config.max_batch)


def frame_view(frame) -> memoryview:
    """Zero-copy byte view of a frame: zmq.Frame, bytes, bytearray or memoryview."""
    buf = getattr(frame, "buffer", None)  # zmq.Frame
    try:
        view = memoryview(buf if buf is not None else frame)
    except TypeError:
        raise WireFieldError("frames", f"frame of type {type(frame).__name__}") from None
    if view.ndim != 1 or view.itemsize != 1:
        view = view.cast("B")
    return view


_SAFE_SCALARS = (type(None), bool, int, float, str, bytes)
_MISSING = object()


def _reject_ext(code: int, data: bytes):
    raise WireFieldError("frame0", f"msgpack extension type {code} is not allowed")


def _transfer_id_of(view: memoryview, limits: WireLimits) -> str | None:
    """The frame's transfer_id, if it is a map with a valid one (no limits but the frame's size)."""
    try:
        d = msgpack.unpackb(view, raw=False, strict_map_key=True, ext_hook=_reject_ext)
    except Exception:  # noqa: BLE001 - untrusted bytes: no id then
        return None
    return Fields(d, limits).id_or_none("transfer_id") if isinstance(d, dict) else None


class Fields:
    """Typed accessors over one decoded msgpack map."""

    def __init__(self, d: dict, limits: WireLimits) -> None:
        self.d = d  # the raw map; read a key only after typed()/int()/str() checked it
        self._limits = limits
        self.transfer_id: str | None = None  # set once known, attached to later errors

    @classmethod
    def unpack(cls, view: memoryview, limits: WireLimits) -> "Fields":
        try:
            d = msgpack.unpackb(view, raw=False, strict_map_key=True, ext_hook=_reject_ext,
                                max_array_len=limits.max_tokens + 1)
        except WireError:
            raise
        except ValueError as e:
            if "exceeds max_array_len" not in str(e):
                raise WireFieldError("frame0", f"not msgpack: {type(e).__name__}: {e}") from None
            # an array past the limit (a prompt longer than this side takes): named under its
            # transfer id where it has one, so that its sender hears of it now (the frame is at
            # most max_header_bytes: reading it whole once more is bounded)
            raise WireSizeError("frame0", f"an array longer than {limits.max_tokens} items", _transfer_id_of(view, limits)) from None
        except Exception as e:  # untrusted bytes: any parser failure is a wire error
            raise WireFieldError("frame0", f"not msgpack: {type(e).__name__}: {e}") from None
        if not isinstance(d, dict):
            raise WireFieldError("frame0", f"expected a map, got {type(d).__name__}")
        return cls(d, limits)

    def _err(self, name: str, detail: str) -> WireFieldError:
        return WireFieldError(name, detail, self.transfer_id)

    def _get(self, name: str):
        try:
            return self.d[name]
        except KeyError:
            raise self._err(name, "missing") from None

    def only(self, allowed: frozenset) -> None:
        """Reject any key outside `allowed`: a field this version does not know."""
        unknown = self.d.keys() - allowed
        if unknown:
            raise self._err(str(sorted(map(str, unknown))[0]), "unknown field")

    def typed(self, names: tuple[str, ...], typ: type) -> None:
        """Every field in `names` is present and exactly of type `typ` (bool is not int)."""
        d = self.d
        for name in names:
            v = d.get(name, _MISSING)
            if type(v) is not typ:
                raise self._err(name, "missing" if v is _MISSING else
                                f"expected {typ.__name__}, got {type(v).__name__}")

    def within(self, name: str, lo: int, hi: int) -> int:
        """A field already known to be an int, checked against [lo, hi]."""
        v = self.d[name]
        if not lo <= v <= hi:
            raise self._err(name, f"{v} not in [{lo}, {hi}]")
        return v

    def int(self, name: str, lo: int, hi: int) -> int:
        v = self._get(name)
        if type(v) is not int:
            raise self._err(name, f"expected int, got {type(v).__name__}")
        if not lo <= v <= hi:
            raise self._err(name, f"{v} not in [{lo}, {hi}]")
        return v

    def opt_int(self, name: str, lo: int, hi: int) -> int | None:
        if self._get(name) is None:
            return None
        return self.int(name, lo, hi)

    def str(self, name: str, max_len: int) -> str:
        v = self._get(name)
        if type(v) is not str:
            raise self._err(name, f"expected str, got {type(v).__name__}")
        if len(v) > max_len:
            raise self._err(name, f"longer than {max_len}")
        return v

    def id(self, name: str) -> str:
        v = self.str(name, self._limits.max_id_len)
        if not v:
            raise self._err(name, "empty")
        return v

    def id_or_none(self, name: str) -> str | None:
        """`id(name)`, or None where it is missing or not a valid id."""
        try:
            return self.id(name)
        except WireError:
            return None

    def choice(self, name: str, allowed: tuple[str, ...]) -> str:
        v = self.str(name, 64)
        if v not in allowed:
            raise self._err(name, f"{v!r} not one of {allowed}")
        return v

    def equal(self, name: str, got, want) -> None:
        if got != want:
            raise self._err(name, f"{got!r} != receiver's {want!r}")

    def tokens(self, name: str) -> list[int]:
        v = self._get(name)
        if type(v) is not list:
            raise self._err(name, f"expected list, got {type(v).__name__}")
        if len(v) > self._limits.max_tokens:
            raise self._err(name, f"{len(v)} tokens > {self._limits.max_tokens}")
        for x in v:
            if type(x) is not int or not 0 <= x < (1 << 31):
                raise self._err(name, f"token id {x!r} is not an int in [0, 2**31)")
        return v

    def id_list(self, name: str, max_len: int) -> list[str]:
        v = self._get(name)
        if type(v) is not list or not 0 < len(v) <= max_len:
            raise self._err(name, f"expected a list of 1..{max_len} ids")
        for x in v:
            if type(x) is not str or not 0 < len(x) <= self._limits.max_id_len:
                raise self._err(name, f"bad id {x!r}")
        return v

    def extra(self, name: str) -> dict:
        v = self._get(name)
        if type(v) is not dict:
            raise self._err(name, f"expected map, got {type(v).__name__}")
        self._check_safe(name, v, 0)
        return v

    def _check_safe(self, name: str, v, depth: int) -> None:
        if depth > 16:
            raise self._err(name, "nested deeper than 16")
        if isinstance(v, dict):
            for k, x in v.items():
                if type(k) is not str:
                    raise self._err(name, f"key {k!r} is not a str")
                self._check_safe(name, x, depth + 1)
        elif isinstance(v, list):
            for x in v:
                self._check_safe(name, x, depth + 1)
        elif type(v) not in _SAFE_SCALARS:
            raise self._err(name, f"value of type {type(v).__name__} is not msgpack-safe")

    def sublist(self, name: str, max_len: int) -> list["Fields"]:
        v = self._get(name)
        if type(v) is not list or not 0 < len(v) <= max_len:
            raise self._err(name, f"expected a list of 1..{max_len} maps")
        out = []
        for x in v:
            if type(x) is not dict:
                raise self._err(name, f"expected map entries, got {type(x).__name__}")
            out.append(Fields(x, self._limits))
        return out
