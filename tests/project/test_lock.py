"""requirements.lock pins every dependency the README's commands install, inside the ranges
pyproject.toml declares, and the venv scripts/_env.sh built holds exactly those versions."""
from __future__ import annotations

import importlib.metadata as md
import re
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]


def _lock() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "requirements.lock").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version and " " not in version, f"not an exact pin: {line!r}"
            pins[canonicalize_name(name)] = version
    return pins


def _declared() -> list[Requirement]:
    text = (ROOT / "pyproject.toml").read_text()
    deps = re.search(r"^dependencies = \[(.*?)^\]", text, re.S | re.M).group(1)
    test = re.search(r"^test = \[(.*?)\]", text, re.M).group(1)
    return [Requirement(r) for r in re.findall(r'"([^"]+)"', deps + test)]


def test_lock_pins_every_declared_dependency_inside_its_range():
    pins = _lock()
    for req in _declared():
        name = canonicalize_name(req.name)
        assert name in pins, f"{req.name} is not in requirements.lock"
        assert req.specifier.contains(Version(pins[name]), prereleases=True), \
            f"locked {req.name}=={pins[name]} is outside pyproject.toml's {req.specifier}"


def test_lower_bounds_only_no_caps_without_a_known_break():
    for req in _declared():
        assert all(s.operator == ">=" for s in req.specifier), f"{req}: lower bounds only"


@pytest.mark.skipif((Path(sys.prefix) / ".pdtb-installed").read_text().strip() == "unmanaged"
                    if (Path(sys.prefix) / ".pdtb-installed").exists() else True,
                    reason="not a venv scripts/_env.sh installed from the lock")
def test_installed_versions_are_the_locked_ones():
    wrong = []
    for name, version in _lock().items():
        try:
            have = md.version(name)
        except md.PackageNotFoundError:
            wrong.append(f"{name} missing")
            continue
        if Version(have.split("+")[0]) != Version(version):
            wrong.append(f"{name} {have} != {version}")
    assert not wrong, wrong
