"""A policy's own settings: a frozen dataclass whose fields become `--policy-arg key=value`.

    @dataclass(frozen=True)
    class MySettings(PolicySettings):
        horizon_s: float = setting(2.0, "seconds a charge is remembered", lo=0, lo_open=True)

    class MyPolicy(BasePolicy):
        Settings = MySettings        # self.settings is an instance, defaults unless told

Field types are int, float, bool, str, or one of them or None. Each field's range and choices
(from `setting`) are checked when the dataclass is built, from the command line or from code.
"""
from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def setting(default, help: str, *, lo=None, hi=None, lo_open: bool = False, hi_open: bool = False,
            choices: tuple | None = None):
    """A settings field: its default, one line of help, and its range ([lo, hi]; `lo_open` /
    `hi_open` exclude the end) or its choices."""
    meta = {"help": help, "lo": lo, "hi": hi, "lo_open": lo_open, "hi_open": hi_open, "choices": choices}
    if isinstance(default, (dict, list, set)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


class SettingsError(ValueError):
    """A setting that does not exist, does not parse, or is out of its range."""


@dataclass(frozen=True)
class PolicySettings:
    """Base of every policy's settings: type, choice and range checks of every field."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            check_value(type(self), f, getattr(self, f.name))


@dataclass(frozen=True)
class NoSettings(PolicySettings):
    """A policy without settings of its own."""


def range_text(f: dataclasses.Field) -> str:
    """The field's range or choices in words ("" when any value of its type goes)."""
    m = f.metadata
    if m.get("choices"):
        return "one of " + ", ".join(map(str, m["choices"]))
    lo, hi = m.get("lo"), m.get("hi")
    if lo is None and hi is None:
        return ""
    left = "" if lo is None else f"{'>' if m.get('lo_open') else '>='} {lo}"
    right = "" if hi is None else f"{'<' if m.get('hi_open') else '<='} {hi}"
    return " and ".join(x for x in (left, right) if x)


def _of_type(v, kind) -> bool:
    if kind is float:
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    if kind is int:
        return isinstance(v, int) and not isinstance(v, bool)
    return not isinstance(kind, type) or isinstance(v, kind)


def check_value(cls, f: dataclasses.Field, v) -> None:
    """Refuse `v` for field `f` of `cls` unless it is of the field's type, among its choices
    and within its range."""
    m = f.metadata
    kind, optional = field_type(cls, f)
    if v is None:
        if not optional:
            raise SettingsError(f"{f.name} takes {type_name(cls, f)}, got None")
        return
    if not _of_type(v, kind):
        raise SettingsError(f"{f.name} takes {type_name(cls, f)}, got {v!r}")
    if m.get("choices") and v not in m["choices"]:
        raise SettingsError(f"{f.name} must be {range_text(f)}, got {v!r}")
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return
    if not math.isfinite(v):
        raise SettingsError(f"{f.name} must be a finite number, got {v!r}")
    lo, hi = m.get("lo"), m.get("hi")
    low_bad = lo is not None and (v <= lo if m.get("lo_open") else v < lo)
    high_bad = hi is not None and (v >= hi if m.get("hi_open") else v > hi)
    if low_bad or high_bad:
        raise SettingsError(f"{f.name} must be {range_text(f)}, got {v!r}")


def field_type(cls, f: dataclasses.Field) -> tuple[type, bool]:
    """(the field's value type, whether None is allowed)."""
    hint = typing.get_type_hints(cls).get(f.name, str)
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return (rest[0] if len(rest) == 1 else str), True
    return hint, False


def parse_value(cls, f: dataclasses.Field, text: str):
    kind, optional = field_type(cls, f)
    if optional and text.strip().lower() in ("none", ""):
        return None
    try:
        if kind is bool:
            low = text.strip().lower()
            if low not in _TRUE + _FALSE:
                raise ValueError
            return low in _TRUE
        if kind is int:
            return int(text)
        if kind is float:
            return float(text)
    except ValueError:
        raise SettingsError(f"{f.name} takes {type_name(cls, f)}, got {text!r}") from None
    if kind is str:
        return text
    raise SettingsError(f"{f.name} is of type {kind}, which --policy-arg cannot set")


def type_name(cls, f: dataclasses.Field) -> str:
    kind, optional = field_type(cls, f)
    name = getattr(kind, "__name__", str(kind))
    return f"{name} or none" if optional else name


def build(cls, pairs: dict[str, str] | list[tuple[str, str]] | tuple = ()) -> PolicySettings:
    """`cls` built from `key=value` strings (the rest at their defaults), every value checked."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values = {}
    for key, text in (pairs.items() if isinstance(pairs, dict) else pairs):
        f = fields.get(key)
        if f is None:
            known = ", ".join(fields) or "none"
            raise SettingsError(f"no setting {key!r} (its settings: {known})")
        values[key] = parse_value(cls, f, str(text))
    try:
        return cls(**values)
    except SettingsError:
        raise
    except (TypeError, ValueError) as e:
        raise SettingsError(str(e)) from None


def parse_pairs(items: list[str] | tuple) -> list[tuple[str, str]]:
    """`["key=value", ...]` as pairs; a malformed item raises SettingsError."""
    out = []
    for it in items:
        key, sep, value = it.partition("=")
        if not sep or not key.strip():
            raise SettingsError(f"--policy-arg expects KEY=VALUE, got {it!r}")
        out.append((key.strip().replace("-", "_"), value.strip()))
    return out


def as_dict(settings) -> dict:
    """The settings as plain values (for stats and results files)."""
    return {f.name: getattr(settings, f.name) for f in dataclasses.fields(settings)}


def describe(cls) -> list[dict]:
    """One entry per field: name, type, default, range, help (`pdtb policies show`)."""
    out = []
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        out.append({"name": f.name, "type": type_name(cls, f), "default": default,
                    "range": range_text(f), "help": f.metadata.get("help", "")})
    return out
