"""The checked-in gRPC stubs must be what protos/generate.py makes from protos/."""

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]


def test_stubs_match_protos():
    result = subprocess.run(
        [sys.executable, "protos/generate.py", "--check"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr


def test_check_detects_a_stale_stub(tmp_path):
    """The check must fail when a stub differs (so the test above can fail)."""
    sys.path.insert(0, str(ROOT / "protos"))
    try:
        import generate
    finally:
        sys.path.pop(0)
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    generate.generate(fresh)
    stale = tmp_path / "stale"
    subprocess.run(["cp", "-r", str(fresh), str(stale)], check=True)
    target = next(stale.rglob("specsplit_pb2.py"))
    target.write_text(target.read_text() + "\n# edited by hand\n")
    assert generate.stale_files(fresh, stale) == [str(target.relative_to(stale))]
    assert generate.stale_files(fresh, fresh) == []
