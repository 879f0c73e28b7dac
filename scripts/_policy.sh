#!/usr/bin/env bash
# Sourced, after _env.sh, by the scripts that take policies. A policy is a reference
# (fairness/registry.py): a name (fcfs, memfair, ... or an installed entry point),
# package.module:Class, or path/to/file.py:Class. These functions check a reference and its
# settings before anything starts (a typo is found at once, not after the runs before it), make
# a policy file's path absolute (nodes and later steps may run in another directory), and name a
# reference where results files and labels need a plain word.
#
#   policy_check CALLER REF [NODE FLAGS...]
#       prints REF, a policy file's path made absolute. Exits the script (status 2, one line
#       "CALLER: why" on stderr) if REF does not load or the flags' policy settings
#       (--policy-arg KEY=VALUE, the older settings flags) or other fairness flags are bad.
#   policy_label REF
#       prints REF's label: a name as it is; module:Class or file.py:Class as the class's own
#       `name` attribute where it sets a plain one, else the class's name.
#   policy_table CALLER LIST [[LABEL:]KEY=VALUE ...] [-- NODE FLAGS...]
#       LIST: policies split on spaces or commas, each REF or LABEL=REF (LABEL: letters, digits,
#       '_', '.', '-'; a reference's own label otherwise, as policy_label gives it; two policies
#       may not share one). KEY=VALUE is a setting of every policy, LABEL:KEY=VALUE of that one.
#       Each policy is checked with its settings and the node flags. Sets the arrays
#       POLICY_LABELS, POLICY_REFS (file paths absolute) and POLICY_ARGS (each policy's
#       settings, one string of tab-separated KEY=VALUE).
#   policy_flags INDEX
#       sets POLICY_FLAGS to policy INDEX's node flags: --policy REF, --policy-arg KEY=VALUE ...
#   policy_list
#       prints the table's policies as a LIST again ("fcfs mine=/abs/my_policy.py:Mine"): for a
#       script that hands its list on after changing directory.
#
# A policy file's path may not hold spaces or commas (lists are split on them).

_policy_py() {  # _policy_py check|label|table ARGS...: the checks, in Python
  python - "$@" <<'PY'
import argparse
import re
import sys

from fairness.registry import absolute_ref
from pdtb.common import CliError
from pdtb.nodes.fairness_args import add_fairness_args, fairness_config, policy_args

LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


def label_of(ref):
    """A name as it is; a reference as its class's own `name` when that is a plain label, else
    the class's name (one that does not load is labelled anyway: the check says why later)."""
    if ":" not in ref:
        return ref
    from fairness import PolicyLoadError, resolve

    try:
        own = resolve(absolute_ref(ref)).cls.__dict__.get("name")
    except PolicyLoadError:
        own = None
    return own if isinstance(own, str) and LABEL.fullmatch(own) else ref.rpartition(":")[2].rpartition(".")[2]


def check(caller, ref, flags):
    ap = argparse.ArgumentParser(prog=caller, usage=argparse.SUPPRESS, add_help=False, allow_abbrev=False)
    add_fairness_args(ap)
    a, _ = ap.parse_known_args(["--policy", absolute_ref(ref), *flags])  # other node flags are not ours
    policy_args(a)
    fairness_config(a)
    return absolute_ref(ref)


def split_item(item):
    label, sep, ref = item.partition("=")
    if sep and LABEL.fullmatch(label):
        return label, ref
    return label_of(item), item


def settings_for(caller, items, labels):
    """{label or None (every policy): [KEY=VALUE, ...]} from [LABEL:]KEY=VALUE items."""
    out = {}
    for item in items:
        head, eq, _ = item.partition("=")
        if not eq:
            raise CliError(f"--policy-arg expects [LABEL:]KEY=VALUE, got {item!r}")
        label, colon, _ = head.partition(":")
        if colon and label not in labels:
            raise CliError(f"--policy-arg {item!r}: no policy labelled {label!r} (labels: {', '.join(labels)})")
        if any(c in item for c in "\t\n"):
            raise CliError(f"--policy-arg {item!r}: no tabs or line breaks")
        out.setdefault(label if colon else None, []).append(item.partition(":")[2] if colon else item)
    return out


def table(caller, argv):
    cut = argv.index("--") if "--" in argv else len(argv)
    listed, items, flags = argv[0], argv[1:cut], argv[cut + 1:]
    pairs = [split_item(p) for p in listed.replace(",", " ").split()]
    if not pairs:
        raise CliError("no policy given")
    labels = [label for label, _ in pairs]
    for label, ref in pairs:
        if not LABEL.fullmatch(label):
            check(caller, ref, [])  # a reference that does not load says so before its label
            raise CliError(f"policy {ref!r} has no plain label; give it one: LABEL={ref}")
        if labels.count(label) > 1:
            raise CliError(f"two policies labelled {label!r}; give one another label: LABEL=REF")
    own = settings_for(caller, items, labels)
    for label, ref in pairs:
        args = own.get(None, []) + own.get(label, [])
        ref = check(caller, ref, [*flags, *(x for kv in args for x in ("--policy-arg", kv))])  # (errors name it)
        print("\t".join([label, ref, *args]))


def main(cmd, *rest):
    if cmd == "label":
        print(label_of(rest[0]))
        return
    caller, rest = rest[0], list(rest[1:])
    try:
        if cmd == "check":
            print(check(caller, rest[0], rest[1:]))
        else:
            table(caller, rest)
    except CliError as e:
        print(f"{caller}: {e}", file=sys.stderr)
        sys.exit(2)


main(*sys.argv[1:])
PY
}

policy_check() {  # policy_check CALLER REF [NODE FLAGS...]
  _policy_py check "$@" || exit 2
}

policy_label() {  # policy_label REF
  _policy_py label "$1"
}

policy_table() {  # policy_table CALLER LIST [[LABEL:]KEY=VALUE ...] [-- NODE FLAGS...]
  local out label ref rest
  out="$(_policy_py table "$@")" || exit 2
  POLICY_LABELS=() POLICY_REFS=() POLICY_ARGS=()
  while IFS=$'\t' read -r label ref rest; do
    POLICY_LABELS+=("$label"); POLICY_REFS+=("$ref"); POLICY_ARGS+=("${rest:-}")
  done <<< "$out"
}

policy_flags() {  # policy_flags INDEX: sets POLICY_FLAGS
  local kv args=()
  IFS=$'\t' read -r -a args <<< "${POLICY_ARGS[$1]}"
  POLICY_FLAGS=(--policy "${POLICY_REFS[$1]}")
  for kv in ${args[@]+"${args[@]}"}; do POLICY_FLAGS+=(--policy-arg "$kv"); done
}

policy_list() {  # policy_list: POLICY_LABELS and POLICY_REFS as a LIST (a label that is its reference stays one word)
  local i out=()
  for i in "${!POLICY_LABELS[@]}"; do
    if [ "${POLICY_LABELS[$i]}" = "${POLICY_REFS[$i]}" ]; then out+=("${POLICY_LABELS[$i]}")
    else out+=("${POLICY_LABELS[$i]}=${POLICY_REFS[$i]}"); fi
  done
  echo "${out[*]}"
}
