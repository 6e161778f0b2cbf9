"""The hashed locks `make install` and the images install from are not stale against pyproject.toml.

Every requirement of the project (its dependencies and the extras `make` installs) must be pinned in
requirements.lock at a release it admits, and every pin must carry its hashes (pip's hash-checking mode
refuses a file without one). When pyproject changes a requirement, `make lock` re-resolves.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
EXTRAS = ("test", "bench")  # what `make install` and the bench targets install
# The locks are resolved for CPython 3.11 on x86_64 Linux (the Makefile's LOCK_FLAGS).
PLATFORM = {**default_environment(), "python_version": "3.11", "python_full_version": "3.11.7",
            "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
            "implementation_name": "cpython", "platform_python_implementation": "CPython"}

_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)\s*(?:;\s*([^\\]+?))?\s*\\?$")
_HASH = re.compile(r"^\s+--hash=sha256:([0-9a-f]{64})\s*\\?$")


def read_lock(text: str) -> dict[str, tuple[Version, int]]:
    """Each package pinned for the lock's platform: its release and how many hashes it carries."""
    pins: dict[str, tuple[Version, int]] = {}
    name = None
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        pin = _PIN.match(line)
        if pin:
            marker = pin.group(3)
            applies = marker is None or Requirement(f"x; {marker}").marker.evaluate(PLATFORM)
            name = canonicalize_name(pin.group(1)) if applies else None
            if name is not None:
                assert name not in pins, f"{name} is pinned twice"
                pins[name] = (Version(pin.group(2)), 0)
            continue
        if _HASH.match(line):
            if name is not None:
                version, hashes = pins[name]
                pins[name] = (version, hashes + 1)
            continue
        raise AssertionError(f"a line the lock's format does not have: {line!r}")
    return pins


def project_requirements(extras: tuple[str, ...] = EXTRAS) -> list[Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    texts = list(project["dependencies"])
    for extra in extras:
        texts += project["optional-dependencies"][extra]
    return [Requirement(text) for text in texts]


def unmet(requirements: list[Requirement], pins: dict[str, tuple[Version, int]]) -> list[str]:
    """What the lock does not meet: a requirement unpinned, or pinned at a release it does not admit."""
    problems = []
    for requirement in requirements:
        if requirement.marker is not None and not requirement.marker.evaluate(PLATFORM):
            continue
        pinned = pins.get(canonicalize_name(requirement.name))
        if pinned is None:
            problems.append(f"{requirement} is not in the lock")
        elif not requirement.specifier.contains(pinned[0], prereleases=True):
            problems.append(f"{requirement} is locked at {pinned[0]}")
    return problems


def test_the_lock_meets_every_requirement_of_pyproject():
    pins = read_lock((REPO / "requirements.lock").read_text())
    assert unmet(project_requirements(), pins) == [], "the lock is stale: run `make lock`"


def test_the_linters_lock_meets_their_list():
    listed = [Requirement(line) for line in (REPO / "k8s" / "requirements-tools.txt").read_text().splitlines()
              if line.strip() and not line.startswith("#")]
    assert listed
    assert unmet(listed, read_lock((REPO / "k8s" / "requirements-tools.lock").read_text())) == []


@pytest.mark.parametrize("lock", ["requirements.lock", "requirements-model.lock", "requirements-gemma.lock",
                                  "k8s/requirements-tools.lock"])
def test_every_pin_carries_its_hashes(lock):
    pins = read_lock((REPO / lock).read_text())
    assert pins
    assert [name for name, (_, hashes) in pins.items() if hashes == 0] == []


@pytest.mark.parametrize("lock", ["docker/requirements-cpu.lock", "docker/requirements-gpu.lock"])
def test_each_image_lock_meets_the_dependencies_with_hashes(lock):
    pins = read_lock((REPO / lock).read_text())
    assert unmet(project_requirements(extras=()), pins) == [], "the lock is stale: run `make lock`"
    assert [name for name, (_, hashes) in pins.items() if hashes == 0] == []


@pytest.mark.parametrize("lock, build", [("requirements.lock", "cpu"), ("docker/requirements-cpu.lock", "cpu"),
                                         ("docker/requirements-gpu.lock", None)])
def test_torch_is_the_build_each_lock_is_for(lock, build):
    pins = read_lock((REPO / lock).read_text())
    version, _ = pins["torch"]
    assert (version.public, version.local) == ("2.13.0", build)
    assert ("nvidia-nccl-cu13" in pins) == (build is None)  # PyPI's Linux build brings its CUDA libraries


def test_a_requirement_the_lock_does_not_meet_is_reported():
    pins = read_lock("grpcio==1.85.1 \\\n    --hash=sha256:" + "0" * 64 + "\n")
    assert unmet([Requirement("grpcio==1.85.1")], pins) == []
    assert unmet([Requirement("grpcio==1.86.0")], pins) == ["grpcio==1.86.0 is locked at 1.85.1"]
    assert unmet([Requirement("protobuf>=7.35,<8")], pins) == ["protobuf<8,>=7.35 is not in the lock"]
    assert unmet([Requirement("pywin32==311; sys_platform == 'win32'")], pins) == []  # not for this platform

