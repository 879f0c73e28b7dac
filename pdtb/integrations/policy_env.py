"""What a scheduler inside another engine is told from outside: the policy named by
PDTB_POLICY with its settings from PDTB_POLICY_ARGS (checked as a node's `--policy` and
`--policy-arg` are), the tenant and SLO tier a request carries, and the engine version check."""
from __future__ import annotations

import argparse
from dataclasses import dataclass

POLICY_ENV = "PDTB_POLICY"  # a built-in name, package.module:Class or path/to/file.py:Class
ARGS_ENV = "PDTB_POLICY_ARGS"  # key=value,key=value: the policy's own settings
DEFAULT_POLICY = "fcfs"
DEFAULT_TENANT = "default"  # as the router's: a request that names no tenant
MAX_LABEL_CHARS = 256  # as the router's cap on `user`: tenant names are metric labels


class PolicyEnvError(ValueError):
    """PDTB_POLICY or PDTB_POLICY_ARGS names no policy, or settings it does not take."""


class EngineVersionError(RuntimeError):
    """The engine is a version the integration's internals were not checked on."""


@dataclass(frozen=True)
class PolicySpec:
    """The policy a scheduler runs, as the environment names it, checked."""

    ref: str  # the reference (a policy file's path made absolute)
    args: tuple[tuple[str, str], ...]  # its own settings as (key, value) pairs, checked
    name: str  # the name shown in logs
    source: str  # where it was found ("built in", "module:Class", "file.py:Class")


def split_args(text: str) -> list[str]:
    """`key=value,key=value` as `--policy-arg` items (blank items between commas ignored)."""
    return [item.strip() for item in (text or "").split(",") if item.strip()]


def policy_spec(environ) -> PolicySpec:
    """The policy `environ` names, loaded and with its settings checked, exactly as the nodes
    check `--policy` and `--policy-arg` (pdtb/nodes/fairness_args.py); a bad name, key or value
    is a PolicyEnvError naming the variable."""
    from fairness.registry import absolute_ref, resolve
    from pdtb.common import CliError
    from pdtb.nodes.fairness_args import policy_args

    ref = (environ.get(POLICY_ENV) or DEFAULT_POLICY).strip()
    items = split_args(environ.get(ARGS_ENV, ""))
    try:
        pairs = policy_args(argparse.Namespace(policy=ref, policy_arg=items))
    except CliError as e:
        raise PolicyEnvError(f"{POLICY_ENV}={ref!r} {ARGS_ENV}={environ.get(ARGS_ENV, '')!r}: {e}") from None
    entry = resolve(ref)
    return PolicySpec(absolute_ref(ref), pairs, entry.name, entry.source)


def build_policy(spec: PolicySpec):
    """The policy of `spec`, with the shared fairness config's defaults and its own settings."""
    from fairness.config import FairnessConfig
    from fairness.registry import make_policy

    return make_policy(spec.ref, FairnessConfig(), spec.args)


def _label(value) -> str | None:
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        return None
    text = str(value).strip()
    return text[:MAX_LABEL_CHARS] if text else None


def request_labels(extra_args) -> tuple[str, str]:
    """(tenant, SLO tier) of a request from its engine-specific extra arguments (vLLM's
    `vllm_xargs`: {"tenant": ..., "slo_tier": ...}); absent or not a string or an integer:
    the default tenant, no tier."""
    extra = extra_args if isinstance(extra_args, dict) else {}
    return _label(extra.get("tenant")) or DEFAULT_TENANT, _label(extra.get("slo_tier")) or ""


def check_version(found: str, checked: tuple[str, ...], engine: str = "vLLM") -> None:
    """Refuse an engine version outside `checked` (the versions the internals were read on)."""
    if found not in checked:
        raise EngineVersionError(
            f"pdtb.integrations.vllm.FairScheduler was checked on {engine} {', '.join(checked)}, and this "
            f"is {engine} {found}: the scheduler internals it touches (pdtb/integrations/vllm_internals.py) "
            f"may differ here. Check them against {found} and add it to CHECKED_VERSIONS there, or run "
            f"{engine} {checked[-1]}.")
