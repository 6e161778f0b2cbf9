"""The import layers of pyproject's [tool.importlinter] hold on the installed layout, and a break is caught.

The contracts run through ``tests/layers.py`` (as ``make lint-imports`` runs them)
on a mirror of the installed packages. The negative controls add one module to
a mirror (never to the repository) that breaks one rule, and the same run must
report that contract broken.
"""

from __future__ import annotations

import pytest

from tests import layers

pytestmark = pytest.mark.unit
REPO = layers.REPO


def test_every_folder_with_an_init_is_a_listed_package():
    assert layers.unlisted_packages() == [], "add them to [tool.setuptools] packages in pyproject.toml"


def test_an_unlisted_package_is_found(tmp_path):
    (tmp_path / "pyproject.toml").write_text(
        '[tool.setuptools]\npackages = ["top", "top.kit"]\n[tool.setuptools.package-dir]\n"top.kit" = "kit"\n'
    )
    for folder in ("top", "kit", "kit/inner", "kit/data"):
        (tmp_path / folder).mkdir()
    for init in ("top", "kit", "kit/inner"):
        (tmp_path / init / "__init__.py").write_text("")
    assert layers.package_folders(tmp_path) == {"top": tmp_path / "top", "top.kit": tmp_path / "kit"}
    assert layers.unlisted_packages(tmp_path) == ["top.kit.inner"]
    with pytest.raises(ValueError, match="top.kit.inner"):
        layers.build_mirror(tmp_path / "mirror", tmp_path)


def test_the_mirror_holds_every_module_under_its_installed_name(tmp_path):
    mirror = layers.build_mirror(tmp_path)
    for package, folder in layers.package_folders().items():
        installed = mirror.joinpath(*package.split("."))
        assert sorted(p.name for p in installed.glob("*.py")) == sorted(p.name for p in folder.glob("*.py"))
    assert (mirror / "specsplit" / "lmkit" / "kinds.py").resolve() == REPO / "lmkit" / "kinds.py"
    assert (mirror / "specsplit" / "orchestrator" / "decode" / "policy" / "__init__.py").is_file()


def test_every_contract_is_kept():
    result = layers.lint_imports()
    assert result.returncode == 0, result.stdout + result.stderr
    report = " ".join(result.stdout.split())  # lint-imports wraps long names at 80 columns
    names = layers.contract_names()
    assert len(names) == 9
    for name in names:
        assert f"{name} KEPT" in report, result.stdout
    assert f"Contracts: {len(names)} kept, 0 broken." in report


# Where a module is added to the mirror, what it imports, and what lint-imports must then report.
BREAKS = {
    "lmkit imports upward": ("lmkit/zz_up.py", "from specsplit.orchestrator.api import config\n",
                             "lmkit imports no other specsplit subpackage (the stubs aside) BROKEN"),
    "the orchestrator imports ray_deploy": ("orchestrator/zz_ray.py", "from specsplit.ray_deploy import options\n",
                                            "specsplit.orchestrator is not allowed to import specsplit.ray_deploy"),
    "the decode engine imports the API front": ("orchestrator/decode/zz_up.py",
                                                "from specsplit.orchestrator.api import detok\n",
                                                "specsplit.orchestrator.decode is not allowed to import "
                                                "specsplit.orchestrator.api"),
    "the draft imports the target": ("draft_service/zz_target.py", "from specsplit.target_service import rejection\n",
                                     "The draft and target services are independent BROKEN"),
    "the target imports the orchestrator": ("target_service/zz_up.py", "import specsplit.orchestrator.decode.loop\n",
                                            "specsplit.target_service is not allowed to import specsplit.orchestrator"),
    "the light client imports torch": ("client.py", "import torch\n", "specsplit.client is not allowed to import torch"),
    "a cycle in a package": ("lmkit/zz_one.py", "from specsplit.lmkit import zz_two\n",
                             "No cycles are allowed in specsplit.lmkit."),
    "a function-level import closes it": ("lmkit/zz_two.py", "def later():\n    from specsplit.lmkit import zz_one\n",
                                          "No cycles are allowed in specsplit.lmkit."),
}


def test_each_break_is_reported_by_its_contract(tmp_path):
    mirror = layers.build_mirror(tmp_path / "mirror")
    for module, source, _ in BREAKS.values():
        path = mirror / "specsplit" / module
        text = path.read_text() if path.is_symlink() else ""  # an existing module: a copy with one import more
        path.unlink(missing_ok=True)
        path.write_text(source + text)
    result = layers.run_lint(mirror)
    assert result.returncode == 1, result.stdout + result.stderr
    report = " ".join(result.stdout.split())
    for case, (_, _, expected) in BREAKS.items():
        assert expected in report, f"{case}: {result.stdout}"
