"""import-linter over ``specsplit`` as it installs: the layers contracts of pyproject.toml, run on a mirror.

pyproject maps each top-level folder to a subpackage (setuptools ``package-dir``:
``lmkit/`` installs as ``specsplit.lmkit``). import-linter's graph builder, grimp,
finds the root package ``specsplit`` by name and walks its folder, and
``specsplit/`` on disk holds only the CLI, the light client and the stubs. So
the contracts run on a mirror: a temporary tree laid out as the packages
install, each module a symlink to its source file, built from the lists
setuptools installs from (``packages`` and ``package-dir``). A folder with an
``__init__.py`` that ``packages`` does not list would neither install nor be
checked, so the mirror refuses to build while one exists.

    python tests/layers.py    # `make lint-imports`: exit 0 when every contract is kept
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _setuptools(repo: Path) -> dict:
    return tomllib.loads((repo / "pyproject.toml").read_text())["tool"]["setuptools"]


def package_folders(repo: Path = REPO) -> dict[str, Path]:
    """Each package pyproject lists, and the folder its modules install from (setuptools' package-dir rule)."""
    config = _setuptools(repo)
    mapping: dict[str, str] = config.get("package-dir", {})
    folders = {}
    for package in config["packages"]:
        parts = package.split(".")
        for cut in range(len(parts), -1, -1):  # the longest mapped prefix; "" (the repository root) by default
            prefix = ".".join(parts[:cut])
            if prefix in mapping or cut == 0:
                folders[package] = repo / mapping.get(prefix, "") / Path(*parts[cut:])
                break
    return folders


def unlisted_packages(repo: Path = REPO) -> list[str]:
    """Folders with an ``__init__.py`` under the installed folders that pyproject's ``packages`` leaves out."""
    folders = package_folders(repo)
    unlisted = []
    for package, folder in folders.items():
        for init in sorted(folder.rglob("__init__.py")):
            name = ".".join([package, *init.parent.relative_to(folder).parts])
            if name not in folders and name not in unlisted:
                unlisted.append(name)
    return unlisted


def build_mirror(dest: Path, repo: Path = REPO) -> Path:
    """The installed layout under ``dest``: a folder per package, a symlink per module; returns ``dest``."""
    unlisted = unlisted_packages(repo)
    if unlisted:
        raise ValueError(f"packages with an __init__.py that pyproject's packages list leaves out: {unlisted}")
    for package, folder in package_folders(repo).items():
        target = dest.joinpath(*package.split("."))
        target.mkdir(parents=True, exist_ok=True)
        for module in sorted(folder.glob("*.py")):
            (target / module.name).symlink_to(module)
    return dest


def contract_names(repo: Path = REPO) -> list[str]:
    """The names of pyproject's import-linter contracts, in order."""
    config = tomllib.loads((repo / "pyproject.toml").read_text())["tool"]["importlinter"]
    return [contract["name"] for contract in config["contracts"]]


def run_lint(mirror: Path, repo: Path = REPO) -> subprocess.CompletedProcess:
    """``lint-imports`` with pyproject's contracts on a built mirror; its exit code and report."""
    lint = Path(sys.executable).with_name("lint-imports")
    # lint-imports puts its working directory first on sys.path: there ``specsplit`` is the mirror's.
    return subprocess.run(
        [str(lint), "--config", str(repo / "pyproject.toml"), "--no-cache"],
        cwd=mirror, capture_output=True, text=True, timeout=300,
    )


def lint_imports(repo: Path = REPO) -> subprocess.CompletedProcess:
    """``run_lint`` on a fresh mirror of ``repo``, removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="specsplit-layers-") as tmp:
        return run_lint(build_mirror(Path(tmp), repo), repo)


def main() -> int:
    try:
        result = lint_imports()
    except ValueError as exc:
        print(f"lint-imports: {exc}", file=sys.stderr)
        return 2
    print(result.stdout, end="")
    print(result.stderr, end="", file=sys.stderr)
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
