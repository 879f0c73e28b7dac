"""The policy seam: loading by reference (name, module:Class, file.py:Class, entry point),
settings as checked `--policy-arg`s, the older flags' mapping, and that the nodes and the
simulator use nothing of a policy beyond the declared interface."""
from __future__ import annotations

import argparse
import ast
import pathlib
import sys
import textwrap

import pytest

import fairness
from fairness import FairnessConfig, Placement, PolicyLoadError, SettingsError, make_policy, resolve
from fairness.interface import OPTIONAL_ATTRIBUTES, OPTIONAL_METHODS, REQUIRED_ATTRIBUTES, REQUIRED_METHODS, Policy
from fairness.registry import ENTRY_POINT_GROUP, available, policy_info
from pdtb.common import CliError
from pdtb.nodes.fairness_args import add_fairness_args, fairness_config, policy_args

ROOT = pathlib.Path(__file__).resolve().parents[2]

POLICY = textwrap.dedent('''
    """Least page-seconds first."""
    from dataclasses import dataclass
    from fairness import BasePolicy, PolicySettings, setting


    @dataclass(frozen=True)
    class Knobs(PolicySettings):
        horizon_s: float = setting(2.0, "seconds a charge is remembered", lo=0.0, lo_open=True)
        mode: str = setting("a", "a mode", choices=("a", "b"))
        turns: int = setting(3, "turns", lo=1, hi=9)
        loud: bool = setting(False, "say more")


    class Lps(BasePolicy):
        name = "lps"
        Settings = Knobs
''')


@pytest.fixture()
def policy_file(tmp_path):
    path = tmp_path / "lps_policy.py"
    path.write_text(POLICY)
    return path


def test_a_file_reference_loads_with_its_settings(policy_file):
    pol = make_policy(f"{policy_file}:Lps", FairnessConfig(), (("horizon_s", "0.5"), ("mode", "b"), ("loud", "yes")))
    assert pol.name == "lps" and pol.settings.horizon_s == 0.5 and pol.settings.mode == "b" and pol.settings.loud
    assert isinstance(pol, Policy)
    info = policy_info(f"{policy_file}:Lps", (("turns", "9"),))
    assert info.name == "lps" and info.source == f"{policy_file}:Lps" and info.settings["turns"] == 9
    # the same file twice is one module: one class, so isinstance and dataclass identities hold
    assert resolve(f"{policy_file}:Lps").cls is resolve(f"{policy_file}:Lps").cls


@pytest.mark.parametrize("pairs, words", [
    ((("horizon_s", "0"),), "horizon_s must be > 0.0"),
    ((("turns", "10"),), "turns must be >= 1 and <= 9"),
    ((("turns", "2.5"),), "turns takes int"),
    ((("mode", "c"),), "mode must be one of a, b"),
    ((("loud", "maybe"),), "loud takes bool"),
    ((("nosuch", "1"),), "no setting 'nosuch' (its settings: horizon_s, mode, turns, loud)"),
    ((("horizon_s", "nan"),), "horizon_s must be a finite number"),
])
def test_bad_settings_are_refused_naming_the_setting(policy_file, pairs, words):
    with pytest.raises(SettingsError, match=words.replace("(", r"\(").replace(")", r"\)")):
        make_policy(f"{policy_file}:Lps", None, pairs)


def test_a_module_reference_loads_from_the_path(policy_file, monkeypatch):
    monkeypatch.syspath_prepend(str(policy_file.parent))
    entry = resolve("lps_policy:Lps")
    assert entry.source == "lps_policy:Lps" and entry.name == "lps"
    with pytest.raises(PolicyLoadError, match="cannot import 'no_such_module'"):
        resolve("no_such_module:X")
    with pytest.raises(PolicyLoadError, match="has no 'Nope'"):
        resolve("lps_policy:Nope")
    with pytest.raises(PolicyLoadError, match="unknown policy 'nope'; known: dlpm, drr, fcfs, mcsf, memfair"):
        resolve("nope")


def test_an_entry_point_registers_a_policy_by_name(policy_file, tmp_path, monkeypatch):
    dist = tmp_path / "lps_pkg-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: lps-pkg\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\nlps = lps_policy:Lps\nbad = lps_policy:Gone\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    entry = resolve("lps")
    assert entry.cls.__name__ == "Lps" and entry.source == "entry point lps-pkg: lps_policy:Lps"
    listed = {e.ref if not isinstance(e, tuple) else e[0]: e for e in available()}
    assert "lps" in listed and isinstance(listed["bad"], tuple) and "has no 'Gone'" in listed["bad"][2]


def test_a_class_lacking_any_required_method_is_refused_naming_it(tmp_path):
    for missing in REQUIRED_METHODS:
        body = "\n".join(f"    def {m}(self, *a): pass" for m in REQUIRED_METHODS if m != missing)
        path = tmp_path / f"p_{missing}.py"
        path.write_text(f"class P:\n    name = 'p'\n    strict_order = True\n{body}\n")
        with pytest.raises(PolicyLoadError, match=f"lacks the required method {missing} "):
            resolve(f"{path}:P")
    path = tmp_path / "p_attr.py"
    path.write_text("class P:\n" + "\n".join(f"    def {m}(self, *a): pass" for m in REQUIRED_METHODS) + "\n")
    with pytest.raises(PolicyLoadError, match=f"lacks the required attribute {REQUIRED_ATTRIBUTES[0]}"):
        resolve(f"{path}:P")


def parse(*argv):
    ap = argparse.ArgumentParser()
    add_fairness_args(ap)
    return ap.parse_args(list(argv))


def test_older_flags_become_the_policys_settings_or_name_the_new_spelling():
    a = parse("--policy", "memfair", "--starve-after", "3", "--quota-shares", "static",
              "--policy-arg", "static_window_s=4")
    pol = make_policy(a.policy, fairness_config(a), policy_args(a))
    s = pol.settings
    assert (s.starve_after_s, s.quota_shares, s.static_window_s) == (3.0, "static", 4.0)
    assert make_policy("priority", None, policy_args(parse("--policy", "priority", "--aging", "5"))).settings.aging_s == 5
    with pytest.raises(CliError, match="--starve-after is a setting policy vtc does not have; it stands for "
                                       "--policy-arg starve_after_s=VALUE"):
        policy_args(parse("--policy", "vtc", "--starve-after", "3"))
    with pytest.raises(CliError, match="--policy-arg expects KEY=VALUE"):
        policy_args(parse("--policy", "vtc", "--policy-arg", "output_weight"))
    with pytest.raises(CliError, match="unknown policy"):
        policy_args(parse("--policy", "vtcc"))


def test_answers_are_enums():
    from pdtb.engine.sched_policy import SchedState
    from fairness.interface import Arrival

    st = SchedState(0.0, 0, 4, 64, 16, 16, 8, 8, {}, {})
    for name in fairness.POLICIES:
        pol = make_policy(name)
        assert pol.place_arrival(Arrival("r", "t", 0, 2, 0.0, 0.0, 8, 4), 0, st) is Placement.DEVICE
        assert pol.place_arrival(Arrival("r2", "t", 0, 40, 0.0, 0.0, 160, 4), 3, st) is Placement.DEFER


# ---- the nodes and the simulator use the declared interface alone ------------------------------------
CALLERS = ["decode_node", "prefill_node", "pdtb/nodes", "pdtb/sim", "pdtb/colocated", "pdtb/engine"]
ALLOWED_MODULES = {"fairness", "fairness.interface", "fairness.config", "fairness.registry", "fairness.settings",
                   # services beside the policies, not policies: SLO attribution, KV metering, quota owners,
                   # the view of the other nodes
                   "fairness.attribution", "fairness.metering", "fairness.owners", "fairness.cluster"}
ALLOWED_NAMES = {"make_policy", "policy_info", "resolve", "PolicyInfo", "PolicyLoadError", "SettingsError",
                 "FairnessConfig", "Placement", "Arrival", "QuotaView", "PolicySettings"}
INTERFACE = set(REQUIRED_METHODS) | set(OPTIONAL_METHODS) | set(REQUIRED_ATTRIBUTES) | set(OPTIONAL_ATTRIBUTES)


def caller_files():
    for d in CALLERS:
        yield from sorted((ROOT / d).glob("*.py"))


def test_nodes_and_simulator_import_only_the_interface_from_fairness():
    bad = []
    for path in caller_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "fairness":
                if node.module not in ALLOWED_MODULES:
                    bad.append(f"{path.relative_to(ROOT)}: from {node.module} import ...")
                elif node.module == "fairness":
                    bad += [f"{path.relative_to(ROOT)}: from fairness import {a.name}" for a in node.names
                            if a.name not in ALLOWED_NAMES]
            elif isinstance(node, ast.Import):
                bad += [f"{path.relative_to(ROOT)}: import {a.name}" for a in node.names
                        if a.name.split(".")[0] == "fairness" and a.name not in ALLOWED_MODULES]
    assert not bad, bad


def test_nodes_and_simulator_call_only_declared_methods_on_a_policy():
    """Every `policy.X` / `self.policy.X` / `scheduler.policy.X` in the callers is an interface name
    (PrefillOrder, the prefill side's wrapper, reaches its inner policy through `inner`)."""
    bad = []
    for path in caller_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Attribute):
                continue
            v = node.value
            holder = v.id if isinstance(v, ast.Name) else v.attr if isinstance(v, ast.Attribute) else None
            watched = ("policy", "inner") if path.parent.name == "prefill_node" else ("policy",)
            if holder in watched and node.attr not in INTERFACE:
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: {holder}.{node.attr}")
    assert not bad, bad
