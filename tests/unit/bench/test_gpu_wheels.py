"""The carried-wheels recipe for GPU images (bench/gpu_wheels.sh, bench/gpu-wheels.lock): right pins, right
interpreter, and everything a device run carries fits the device tool's 64 MiB."""

from __future__ import annotations

import hashlib
import subprocess
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import parse_wheel_filename

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]
LOCK = ROOT / "bench" / "gpu-wheels.lock"
WHEELS = ROOT / ".gpu-wheels"
TRAVEL_LIMIT = 64 * 2**20  # the device tool: working tree plus carried paths, per call


def locked() -> list[tuple[Requirement, str, int, str]]:
    rows = []
    for line in LOCK.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            req, file, size, sha = line.split()
            rows.append((Requirement(req), file, int(size), sha))
    return rows


def test_the_lock_pins_what_pyproject_pins():
    project = {Requirement(r).name: Requirement(r) for r in tomllib.loads((ROOT / "pyproject.toml").read_text())
               ["project"]["dependencies"]}
    rows = locked()
    assert {r.name for r, *_ in rows} == {"grpcio", "grpcio-health-checking", "grpcio-reflection", "protobuf"}
    for req, file, _, _ in rows:
        (version,) = [s.version for s in req.specifier]
        assert project[req.name].specifier.contains(version), f"{req} is outside pyproject's {project[req.name]}"
        name, wheel_version, _, tags = parse_wheel_filename(file)
        assert name == req.name and str(wheel_version) == version


def test_the_wheels_install_on_the_gpu_images_cpython_3_12_x86_64():
    for _, file, _, _ in locked():
        tags = parse_wheel_filename(file)[3]
        assert any(t.interpreter in ("cp312", "cp310", "py3") and t.abi in ("cp312", "abi3", "none") for t in tags), file
        assert all(t.platform == "any" or t.platform.endswith("x86_64") for t in tags), file


def test_the_tree_and_the_wheels_fit_one_device_call():
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            check=True, capture_output=True).stdout.decode().split("\0")
    tree = sum((ROOT / f).stat().st_size for f in listed if f and (ROOT / f).is_file())
    wheels = sum(size for _, _, size, _ in locked())
    assert tree + wheels < TRAVEL_LIMIT, f"tree {tree} + wheels {wheels} bytes is over {TRAVEL_LIMIT}"
    assert wheels < 16 * 2**20  # what the wheels may take of it


@pytest.mark.skipif(not WHEELS.is_dir(), reason="no .gpu-wheels here (bash bench/gpu_wheels.sh fetches them)")
def test_fetched_wheels_are_the_locked_ones():
    rows = locked()
    assert sorted(p.name for p in WHEELS.glob("*.whl")) == sorted(file for _, file, _, _ in rows)
    for _, file, size, sha in rows:
        data = (WHEELS / file).read_bytes()
        assert len(data) == size and hashlib.sha256(data).hexdigest() == sha, file
