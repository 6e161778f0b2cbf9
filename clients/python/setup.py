"""Build specsplit-client from the repository's sources: the light client and what it imports, nothing else.

The modules are the ones ``specsplit/client.py`` and ``specsplit generate`` load (tests/services/test_cli.py checks
that they pull in neither torch nor ray); the generated stubs come whole.
"""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

BUILD = Path(__file__).resolve().parent / "build"

PACKAGES = ["specsplit", "specsplit.v1", "specsplit.lmkit"]
MODULES = {
    "specsplit": {"__init__", "cli", "client", "generate"},
    "specsplit.lmkit": {"__init__", "auth", "entry", "errors", "kinds", "logs", "security"},
}


class LightModules(build_py):
    """Only the listed modules of ``specsplit`` and ``specsplit.lmkit`` (their other modules need the model stack)."""

    def find_package_modules(self, package, package_dir):
        modules = super().find_package_modules(package, package_dir)
        keep = MODULES.get(package)
        return modules if keep is None else [m for m in modules if m[1] in keep]


shutil.rmtree(BUILD / "lib", ignore_errors=True)  # no module of an earlier selection lingers in the wheel
BUILD.mkdir(exist_ok=True)
setup(
    packages=PACKAGES,
    package_dir={"": "../..", "specsplit.lmkit": "../../lmkit"},  # the full distribution's mapping
    options={"egg_info": {"egg_base": "build"}},  # not into the repository root (package-dir)
    package_data={"specsplit.v1": ["*.pyi"]},
    cmdclass={"build_py": LightModules},
)
