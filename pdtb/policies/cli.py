"""`pdtb policies`: the policies available by name, where each comes from, and one's settings.

    pdtb policies [--names]        built-in policies, then those installed packages register
    pdtb policies show REF         a policy's source, summary and settings (--policy-arg keys)
"""
from __future__ import annotations

import argparse

from pdtb.common import CliError


def list_policies(names_only: bool) -> int:
    from fairness.registry import available

    rows = []
    for e in available():
        if isinstance(e, tuple):  # an entry point that did not load
            name, source, err = e
            rows.append((name, source, f"(does not load: {err})"))
        else:
            rows.append((e.ref, e.source, e.summary))
    if names_only:
        print(" ".join(r[0] for r in rows if not r[2].startswith("(does not load")))
        return 0
    width = max(len(r[0]) for r in rows)
    for name, source, summary in rows:
        print(f"{name:<{width}}  {source:<10}  {summary}")
    print("\nany other: --policy package.module:Class or --policy path/to/file.py:Class; "
          "`pdtb policies show NAME` for a policy's settings")
    return 0


def show(ref: str) -> int:
    from fairness import PolicyLoadError, resolve
    from fairness.settings import describe

    try:
        e = resolve(ref)
    except PolicyLoadError as err:
        raise CliError(str(err)) from None
    print(f"{e.name}: {e.summary}")
    print(f"source: {e.source} ({e.cls.__module__}.{e.cls.__qualname__})")
    fields = describe(e.settings_cls)
    if not fields:
        print("settings: none")
        return 0
    print("settings (--policy-arg KEY=VALUE):")
    for f in fields:
        rng = f"; {f['range']}" if f["range"] else ""
        print(f"  {f['name']} ({f['type']}, default {f['default']!r}{rng})\n      {f['help']}")
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["show"]:
        ap = argparse.ArgumentParser(prog="pdtb policies show")
        ap.add_argument("policy", metavar="NAME|module:Class|file.py:Class")
        return show(ap.parse_args(argv[1:]).policy)
    ap = argparse.ArgumentParser(prog="pdtb policies", description=__doc__.split("\n")[0])
    ap.add_argument("--names", action="store_true", help="the names alone, on one line")
    return list_policies(ap.parse_args(argv).names)
