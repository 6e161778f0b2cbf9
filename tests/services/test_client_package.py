"""specsplit-client (clients/python) builds, installs into a fresh venv without torch, and talks to a real server.

The wheel is built from the repository's sources; the fresh venv gets it with
pip (no index) and finds its two dependencies, grpcio and protobuf, through a
.pth file pointing at a folder that holds those packages alone (no network
here), so torch, ray, transformers and numpy cannot be imported there.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import grpc
import pytest

pytestmark = pytest.mark.services

REPO = Path(__file__).resolve().parents[2]
# The packages grpcio and protobuf need at run time (typing_extensions: grpcio's own dependency).
RUNTIME = ("grpc", "google/protobuf", "google/_upb", "typing_extensions.py")


def site_packages(python: Path) -> Path:
    out = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True)
    return Path(out.stdout.strip())


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet", "-w", str(out),
         str(REPO / "clients" / "python")], capture_output=True, text=True, timeout=300,
    )
    assert build.returncode == 0, build.stderr
    (path,) = out.glob("specsplit_client-*.whl")
    return path


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory, wheel) -> Path:
    """A new venv with the wheel installed by pip and grpcio + protobuf reachable, nothing else."""
    root = tmp_path_factory.mktemp("client-venv")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-index", "--no-deps", "--quiet",
         str(wheel)], capture_output=True, text=True, timeout=300,
    )
    assert install.returncode == 0, install.stderr
    deps = root / "deps"
    ours = site_packages(Path(sys.executable))
    for name in RUNTIME:
        (deps / name).parent.mkdir(parents=True, exist_ok=True)
        (deps / name).symlink_to(ours / name)
    (site_packages(python) / "client-deps.pth").write_text(f"{deps}\n")
    return venv


def test_the_wheel_holds_the_light_client_and_pins_what_the_full_package_pins(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    modules = {n for n in names if n.endswith(".py")}
    assert modules == {
        "specsplit/__init__.py", "specsplit/cli.py", "specsplit/client.py", "specsplit/generate.py",
        "specsplit/lmkit/__init__.py", "specsplit/lmkit/entry.py", "specsplit/lmkit/errors.py",
        "specsplit/lmkit/auth.py", "specsplit/lmkit/kinds.py", "specsplit/lmkit/logs.py", "specsplit/lmkit/security.py",
        "specsplit/v1/__init__.py", "specsplit/v1/specsplit_pb2.py", "specsplit/v1/specsplit_pb2_grpc.py",
    }
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("/METADATA"))).decode()
    requires = sorted(re.findall(r"^Requires-Dist: (\S+)", metadata, re.M))
    full = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    client = tomllib.loads((REPO / "clients" / "python" / "pyproject.toml").read_text())["project"]
    assert [d.split("=")[0].split("<")[0].split(">")[0] for d in requires] == ["grpcio", "protobuf"]
    for dep in client["dependencies"]:
        assert dep in full["dependencies"], f"{dep}: pin it as the full package does"
    assert client["version"] == full["version"]


def test_the_client_installed_alone_generates_against_a_running_server(fresh_venv, public_api):
    program = f"""
import importlib.util, sys
from specsplit.client import Client
heavy = [m for m in ("torch", "ray", "transformers", "numpy") if importlib.util.find_spec(m)]
assert not heavy, heavy
with Client("{public_api}") as client:
    plain = client.complete("The quick brown fox", chat=False, max_new_tokens=6, return_token_ids=True)
    chat = client.complete(messages=[("system", "Be brief."), ("user", "Hi")], max_new_tokens=5, logprobs=True,
                           top_logprobs=2)
print(plain.finish_reason, len(plain.token_ids), chat.stats.new_tokens, len(chat.logprobs),
      len(chat.logprobs[0].top), repr(chat.logprobs[0].token))
"""
    python = fresh_venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    run = subprocess.run([str(python), "-c", program], capture_output=True, text=True, timeout=120, env=env,
                         cwd=fresh_venv)
    assert run.returncode == 0, run.stderr
    finish, ids, new, logprobs, top, token = run.stdout.split(maxsplit=5)
    assert (finish, ids, new, logprobs, top) == ("FINISH_REASON_LENGTH", "6", "5", "5", "2") and token.strip("'")
    cli = subprocess.run([str(fresh_venv / "bin" / "specsplit"), "generate", "Hello", "--server", public_api,
                          "--max-new-tokens", "4"], capture_output=True, text=True, timeout=120, env=env,
                         cwd=fresh_venv)
    assert cli.returncode == 0 and "tok/s" in cli.stderr, cli.stderr
    serve = subprocess.run([str(fresh_venv / "bin" / "specsplit"), "serve", "--port", "0"],
                           capture_output=True, text=True, timeout=120, env=env, cwd=fresh_venv)
    assert serve.returncode == 1 and "needs the full specsplit package" in serve.stderr
    assert "Traceback" not in serve.stderr


def test_a_client_that_knows_only_some_fields_is_served(public_api):
    """A client whose schema holds a few of GenerateRequest's fields (built here, under the contract's numbers,
    without messages, sampling or logprobs) is served: what it does not send takes the server's defaults."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    from specsplit.v1 import specsplit_pb2 as pb

    field = descriptor_pb2.FieldDescriptorProto
    subset = descriptor_pb2.FileDescriptorProto(name="subset_specsplit.proto", package="specsplit.v1", syntax="proto3")
    for message, names in ((pb.GenerateRequest, ("prompt", "chat", "max_new_tokens", "k", "return_token_ids")),
                           (pb.GenerateResponse, ("text", "token_ids"))):
        known = subset.message_type.add(name=message.DESCRIPTOR.name)
        for name in names:
            ours = message.DESCRIPTOR.fields_by_name[name]
            label = field.LABEL_REPEATED if ours.is_repeated else field.LABEL_OPTIONAL
            known.field.add(name=name, number=ours.number, type=ours.type, label=label)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(subset)
    SubsetRequest = message_factory.GetMessageClass(pool.FindMessageTypeByName("specsplit.v1.GenerateRequest"))
    SubsetResponse = message_factory.GetMessageClass(pool.FindMessageTypeByName("specsplit.v1.GenerateResponse"))

    with grpc.insecure_channel(public_api) as channel:
        call = channel.unary_stream("/specsplit.v1.Generator/Generate",
                                    request_serializer=SubsetRequest.SerializeToString,
                                    response_deserializer=SubsetResponse.FromString)
        replies = list(call(SubsetRequest(prompt="a b a b a b", chat=False, max_new_tokens=8, k=4,
                                          return_token_ids=True), timeout=120))
    assert sum(len(r.token_ids) for r in replies) == 8 and "".join(r.text for r in replies)
