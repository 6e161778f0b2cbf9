"""Regenerate the Python gRPC stubs in ``specsplit/v1/`` from ``protos/``.

    python protos/generate.py           # write the stubs
    python protos/generate.py --check   # exit 1 if the committed stubs are stale

The generated modules are imported as ``specsplit.v1.specsplit_pb2``;
they are never edited by hand.
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
STUBS = Path("specsplit") / "v1"  # where protoc puts the stubs of package specsplit.v1, under the repository root


BASELINE_ROOT = PROTO_ROOT / "baseline"  # the published contract protos/breaking.py compares against: no stubs


def proto_files() -> list[Path]:
    return sorted(p for p in PROTO_ROOT.rglob("*.proto") if BASELINE_ROOT not in p.parents)


def generate(out_root: Path) -> None:
    """Write the stubs under ``out_root / STUBS``."""
    files = [str(p.relative_to(PROTO_ROOT)) for p in proto_files()]
    args = [
        "grpc_tools.protoc",
        f"--proto_path={PROTO_ROOT}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *files,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed; see the message above")
    (out_root / STUBS / "__init__.py").touch()


def stale_files(expected_root: Path, actual_root: Path) -> list[str]:
    expected = {p.relative_to(expected_root) for p in expected_root.rglob("*") if p.is_file()}
    actual = {
        p.relative_to(actual_root)
        for p in actual_root.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }
    stale = sorted(str(p) for p in expected ^ actual)
    stale += sorted(
        str(p) for p in expected & actual if not filecmp.cmp(expected_root / p, actual_root / p, shallow=False)
    )
    return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args(argv)
    if not args.check:
        generate(ROOT)
        print(f"wrote stubs for {len(proto_files())} proto file(s) to {STUBS}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        stale = stale_files(Path(tmp) / STUBS, ROOT / STUBS)
    if stale:
        print("stale gRPC stubs (run `python protos/generate.py`): " + ", ".join(stale), file=sys.stderr)
        return 1
    print("gRPC stubs are in sync with protos/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
