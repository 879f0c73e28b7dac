"""Finding a policy by reference, checking it, and building it with its settings.

A reference (`--policy REF`) is one of:

    fcfs                       a built-in policy, or one an installed package registers under
                               the entry-point group `pd_testbed.policies` (name = module:Class)
    package.module:Class       a class importable from the Python path
    path/to/file.py:Class      a class in a file (loaded as its own module, once per process)

A loaded class must have every method of `fairness.interface.Policy`; one that lacks any is
refused with the method's name. It is built as `Class(config, settings)`: the shared
`FairnessConfig` and its own settings, its `Settings` dataclass (fairness/settings.py),
built from `--policy-arg key=value` pairs.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import importlib.util
import os
import sys
from dataclasses import dataclass

from fairness.interface import REQUIRED_ATTRIBUTES, REQUIRED_METHODS
from fairness.settings import NoSettings, PolicySettings, SettingsError, as_dict, build

ENTRY_POINT_GROUP = "pd_testbed.policies"
BUILT_IN_SOURCE = "built in"


class PolicyLoadError(ValueError):
    """A policy reference that names nothing loadable, or a class that is not a policy."""


@dataclass(frozen=True)
class PolicyEntry:
    """A policy found by reference."""

    ref: str  # as given (a name, or module:Class, or file.py:Class)
    cls: type
    source: str  # "built in", "entry point <dist>: module:Class", or "module:Class" / "file.py:Class"

    @property
    def name(self) -> str:
        """The name shown: the class's own `name` if it sets one, else the reference."""
        own = self.cls.__dict__.get("name")
        return own if isinstance(own, str) and own else self.ref

    @property
    def settings_cls(self) -> type:
        return getattr(self.cls, "Settings", None) or NoSettings

    @property
    def summary(self) -> str:
        """The first line of the class's docstring, else of its module's."""
        doc = self.cls.__doc__ or getattr(sys.modules.get(self.cls.__module__), "__doc__", None) or ""
        return doc.strip().split("\n")[0]


@dataclass(frozen=True)
class PolicyInfo:
    """The policy a node runs, as its stats, metrics and results files name it."""

    name: str
    source: str
    settings: dict

    def to_json(self) -> dict:
        return {"name": self.name, "source": self.source, "settings": self.settings}


def built_ins() -> dict[str, type]:
    from fairness.dlpm import DlpmPolicy
    from fairness.drr import DrrPolicy
    from fairness.fcfs import FcfsPolicy
    from fairness.mcsf import McsfPolicy
    from fairness.memtime import MemTimePolicy
    from fairness.memfair import MemFairPolicy
    from fairness.priority import PriorityPolicy
    from fairness.vtc import VtcPolicy

    return {p.name: p for p in (FcfsPolicy, MemFairPolicy, VtcPolicy, McsfPolicy, PriorityPolicy, MemTimePolicy,
                                DrrPolicy, DlpmPolicy)}


def entry_points() -> dict[str, tuple[str, str]]:
    """Policies installed packages register: name -> (module:Class, distribution)."""
    out = {}
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = getattr(ep, "dist", None)
        out.setdefault(ep.name, (ep.value, dist.name if dist is not None else "?"))
    return out


def check_class(cls, ref: str) -> None:
    """Refuse `cls` unless it has every method and attribute of the declared interface."""
    if not isinstance(cls, type):
        raise PolicyLoadError(f"policy {ref!r} is not a class ({type(cls).__name__})")
    for m in REQUIRED_METHODS:
        if not callable(getattr(cls, m, None)):
            raise PolicyLoadError(f"policy {ref!r} lacks the required method {m} (fairness/interface.py; "
                                  f"subclass fairness.BasePolicy for first-come first-served defaults)")
    for a in REQUIRED_ATTRIBUTES:
        if not hasattr(cls, a):
            raise PolicyLoadError(f"policy {ref!r} lacks the required attribute {a}")
    settings = getattr(cls, "Settings", None)
    if settings is not None and not (isinstance(settings, type) and issubclass(settings, PolicySettings)):
        raise PolicyLoadError(f"policy {ref!r}: Settings must subclass fairness.PolicySettings (a dataclass)")


def _load_file(path: str):
    full = os.path.realpath(path)
    if not os.path.isfile(full):
        raise PolicyLoadError(f"no policy file {path!r}")
    mod_name = "pdtb_policy_" + hashlib.sha1(full.encode()).hexdigest()[:12]
    mod = sys.modules.get(mod_name)
    if mod is None:
        spec = importlib.util.spec_from_file_location(mod_name, full)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = mod  # dataclasses and pickling look the module up by name
        try:
            spec.loader.exec_module(mod)
        except Exception as e:
            del sys.modules[mod_name]
            raise PolicyLoadError(f"policy file {path!r} failed to load: {type(e).__name__}: {e}") from e
    return mod


def _is_file(where: str) -> bool:
    """`where:Class` names a file (not a module) when `where` ends in .py or holds a path separator."""
    return where.endswith(".py") or os.sep in where


def absolute_ref(ref: str) -> str:
    """`ref` with a policy file's path made absolute, for processes started in another directory."""
    where, sep, attr = ref.rpartition(":")
    return f"{os.path.abspath(where)}:{attr}" if sep and _is_file(where) else ref


def _load_qualified(target: str, ref: str):
    where, _, attr = target.rpartition(":")
    if not where or not attr:
        raise PolicyLoadError(f"policy {ref!r}: expected module:Class or file.py:Class")
    if _is_file(where):
        mod = _load_file(where)
    else:
        try:
            mod = importlib.import_module(where)
        except ImportError as e:
            raise PolicyLoadError(f"policy {ref!r}: cannot import {where!r} ({e}); is it on PYTHONPATH?") from e
        except Exception as e:
            raise PolicyLoadError(f"policy {ref!r}: importing {where!r} raised {type(e).__name__}: {e}") from e
    cls = mod
    for part in attr.split("."):
        cls = getattr(cls, part, None)
        if cls is None:
            raise PolicyLoadError(f"policy {ref!r}: {where!r} has no {attr!r}")
    return cls


def resolve(ref: str) -> PolicyEntry:
    """The policy `ref` names, checked against the interface."""
    ref = (ref or "").strip()
    if not ref:
        raise PolicyLoadError("empty policy reference")
    if ":" in ref:
        cls, source = _load_qualified(ref, ref), ref
    else:
        known = built_ins()
        if ref in known:
            cls, source = known[ref], BUILT_IN_SOURCE
        else:
            eps = entry_points()
            if ref not in eps:
                names = sorted(set(known) | set(eps))
                raise PolicyLoadError(f"unknown policy {ref!r}; known: {', '.join(names)} "
                                      f"(or module:Class, or path/to/file.py:Class)")
            target, dist = eps[ref]
            cls, source = _load_qualified(target, ref), f"entry point {dist}: {target}"
    check_class(cls, ref)
    return PolicyEntry(ref, cls, source)


def available() -> list[PolicyEntry | tuple[str, str, str]]:
    """Every policy known by name: built-ins, then entry points. An entry point that fails to
    load is listed as (name, source, error)."""
    out: list = [PolicyEntry(n, c, BUILT_IN_SOURCE) for n, c in built_ins().items()]
    for name, (target, dist) in sorted(entry_points().items()):
        if name in built_ins():
            continue
        try:
            out.append(resolve(name))
        except PolicyLoadError as e:
            out.append((name, f"entry point {dist}: {target}", str(e)))
    return out


def make_settings(entry: PolicyEntry, args=()) -> PolicySettings:
    """The entry's settings from `key=value` pairs (checked; SettingsError names the problem)."""
    try:
        return build(entry.settings_cls, args)
    except SettingsError as e:
        raise SettingsError(f"policy {entry.ref}: {e}") from None


def make_policy(ref: str, config=None, args=()):
    """Build the policy `ref` names with the shared `config` and its own settings `args`."""
    entry = resolve(ref)
    return instantiate(entry, config, make_settings(entry, args))


def instantiate(entry: PolicyEntry, config, settings):
    """`entry.cls(config, settings)`; a class whose constructor does not take them is refused."""
    import inspect

    try:
        inspect.signature(entry.cls).bind(config, settings)
    except TypeError:
        raise PolicyLoadError(f"policy {entry.ref!r}: its constructor must take (config, settings), "
                              f"as fairness.BasePolicy's does") from None
    except ValueError:
        pass  # no signature to read (a builtin): let the call say
    return entry.cls(config, settings)


def policy_info(ref: str, args=()) -> PolicyInfo:
    entry = resolve(ref)
    return PolicyInfo(entry.name, entry.source, as_dict(make_settings(entry, args)))
