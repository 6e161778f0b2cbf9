"""Where models come from: the hub (a pinned revision downloads with HF_TOKEN and a progress bar, then
loads offline; without the hub, the error says what to do), and GGUF files converted in the dtype asked for.

The hub is a small HTTP server on 127.0.0.1 speaking the part of the hub's
API that huggingface_hub's ``snapshot_download`` uses (repo info, file tree,
file resolve), serving the tiny test model; everything from ``models.resolve``
down (huggingface_hub's real download, cache layout, refs, progress bars) runs
as it would against huggingface.co. Downloads run in subprocesses because
huggingface_hub reads HF_HUB_OFFLINE and HF_ENDPOINT once, at import.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest

from specsplit.lmkit import models
from specsplit.target_service.ranks import free_port

pytestmark = pytest.mark.services

REPO_ID = "acme/tiny-llama"
REVISION = "v1"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
TOKEN = "hf_test_token_123"


class FakeHub(http.server.ThreadingHTTPServer):
    """Serves one repository (files of ``folder``) at one revision to requests carrying the token."""

    def __init__(self, folder: Path) -> None:
        super().__init__(("127.0.0.1", 0), _HubHandler)
        self.files = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}
        self.requests: list[tuple[str, str, str]] = []  # (method, path, authorization)
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def stop(self) -> None:
        self.shutdown()
        self.server_close()


class _HubHandler(http.server.BaseHTTPRequestHandler):
    server: FakeHub

    def log_message(self, *args) -> None:  # quiet
        pass

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def do_GET(self) -> None:
        self._answer(body=True)

    def _answer(self, body: bool) -> None:
        path = unquote(urlparse(self.path).path)
        self.server.requests.append((self.command, path, self.headers.get("authorization", "")))
        if self.headers.get("authorization") != f"Bearer {TOKEN}":
            return self._send(401, b'{"error": "Invalid credentials"}', {"X-Error-Code": "RepoNotFound"}, body)
        api = f"/api/models/{REPO_ID}"
        if path == f"{api}/revision/{REVISION}":
            siblings = [{"rfilename": name} for name in self.server.files]
            return self._json({"id": REPO_ID, "sha": COMMIT, "siblings": siblings}, body)
        if path.startswith(f"{api}/revision/"):
            return self._send(404, b'{"error": "Invalid rev id"}', {"X-Error-Code": "RevisionNotFound"}, body)
        if path == f"{api}/tree/{COMMIT}":
            tree = [{"type": "file", "path": name, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
                    for name, data in self.server.files.items()]
            return self._json(tree, body)
        prefix = f"/{REPO_ID}/resolve/{COMMIT}/"
        if path.startswith(prefix) and path[len(prefix):] in self.server.files:
            data = self.server.files[path[len(prefix):]]
            headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{hashlib.sha1(data).hexdigest()}"',
                       "Content-Type": "application/octet-stream"}
            return self._send(200, data, headers, body)
        self._send(404, b'{"error": "Entry not found"}', {"X-Error-Code": "EntryNotFound"}, body)

    def _json(self, obj, body: bool) -> None:
        self._send(200, json.dumps(obj).encode(), {"Content-Type": "application/json"}, body)

    def _send(self, status: int, data: bytes, headers: dict, body: bool) -> None:
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if body:
            self.wfile.write(data)


@pytest.fixture()
def hub(tiny_target_dir):
    server = FakeHub(tiny_target_dir)
    yield server
    server.stop()


def python(code: str, env: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_OFFLINE"))}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                          env={**clean, **env})


def test_a_pinned_hub_model_downloads_with_the_token_then_loads_offline(hub, tmp_path, tiny_target_dir):
    env = {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf"), "HF_TOKEN": TOKEN}
    fetched = python(
        "from lmkit import models\n"
        f"try:\n    models.resolve('{REPO_ID}@v9')\nexcept FileNotFoundError as exc:\n    print(exc)\n"
        f"print(models.resolve('{REPO_ID}@{REVISION}'))\n", env)
    assert fetched.returncode == 0, fetched.stderr
    refused, path = fetched.stdout.strip().splitlines()
    assert refused == f"{REPO_ID} has no revision 'v9'"
    snapshot = Path(path)
    assert snapshot == tmp_path / "hf" / "hub" / "models--acme--tiny-llama" / "snapshots" / COMMIT
    for name, data in hub.files.items():
        assert (snapshot / name).read_bytes() == data, name
    assert "Fetching" in fetched.stderr and "100%" in fetched.stderr  # the progress bars
    for_the_repo = [r for r in hub.requests if REPO_ID in r[1]]
    assert for_the_repo and {auth for _, _, auth in for_the_repo} == {f"Bearer {TOKEN}"}  # HF_TOKEN on each
    assert ("GET", f"/api/models/{REPO_ID}/revision/{REVISION}", f"Bearer {TOKEN}") in hub.requests

    hub.stop()  # from now on the hub is gone: the cached, pinned snapshot is enough
    offline = python(
        "import torch\nfrom lmkit import models\n"
        f"hub = models.load_model(models.ModelSpec('{REPO_ID}@{REVISION}'))\n"
        f"local = models.load_model(models.ModelSpec('{tiny_target_dir}'))\n"
        "ids = torch.tensor([[1, 5, 9, 200]])\n"
        "print(torch.equal(hub(ids).logits, local(ids).logits), hub.dtype)\n",
        {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"},
    )
    assert offline.returncode == 0, offline.stderr
    assert offline.stdout.split() == ["True", "torch.float32"]  # --dtype auto on CPU


def test_a_wrong_token_is_a_cli_error_that_says_why(hub, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_ENDPOINT=hub.url, HF_HOME=str(tmp_path / "hf"), HF_TOKEN="wrong")
    run = subprocess.run([sys.executable, "-m", "specsplit.cli", "serve-target", "--port", "0", "--model",
                          f"{REPO_ID}@{REVISION}"], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 2 and "HF_TOKEN" in run.stderr and "Traceback" not in run.stderr, run.stderr


def test_without_the_hub_the_error_says_what_to_do(tmp_path):
    # Offline mode (this test process runs with HF_HUB_OFFLINE=1, see conftest).
    with pytest.raises(FileNotFoundError) as info:
        models.resolve("acme/not-cached@r7")
    message = str(info.value)
    assert "HF_HUB_OFFLINE" in message and "hf download acme/not-cached --revision r7 --local-dir DIR" in message
    assert "HF_HOME" in message
    # Online, but nothing answers where the hub should be.
    unreachable = python(
        "from lmkit import models\ntry:\n    models.resolve('acme/not-cached')\n"
        "except FileNotFoundError as exc:\n    print(exc)\n",
        {"HF_ENDPOINT": f"http://127.0.0.1:{free_port()}", "HF_HOME": str(tmp_path / "hf")},
    )
    assert "the hub did not answer" in unreachable.stdout and "hf download acme/not-cached" in unreachable.stdout, (
        unreachable.stdout + unreachable.stderr)


def test_dtype_auto_is_bfloat16_on_cuda_and_float32_on_cpu():
    assert models.ModelSpec("x").dtype_name == "float32"
    assert models.ModelSpec("x", device="cuda:1").torch_dtype is models.torch.bfloat16
    assert models.ModelSpec("x", device="cuda", dtype="float16").dtype_name == "float16"
    with pytest.raises(ValueError, match="auto, float32, bfloat16, float16"):
        models.ModelSpec("x", dtype="int4")



def write_tiny_gguf(path: Path) -> Path:
    """A GGUF file of a random one-layer Llama with a byte-level BPE vocabulary of 260 tokens (F32 tensors)."""
    import numpy as np
    import torch
    from gguf import GGUFWriter
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *bytes_to_unicode().values(), "Ġt"]
    hidden, heads = 32, 2
    writer = GGUFWriter(str(path), "llama")
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_block_count(1)
    writer.add_feed_forward_length(2 * hidden)
    writer.add_head_count(heads)
    writer.add_head_count_kv(1)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))  # control tokens, then normal ones
    writer.add_token_merges(["Ġ t"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokens), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1,
                         num_attention_heads=heads, num_key_value_heads=1, tie_word_embeddings=True)
    weights = LlamaForCausalLM(config).state_dict()
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    for ours, theirs in (("self_attn.q_proj", "attn_q"), ("self_attn.k_proj", "attn_k"), ("self_attn.v_proj", "attn_v"),
                         ("self_attn.o_proj", "attn_output"), ("mlp.gate_proj", "ffn_gate"), ("mlp.up_proj", "ffn_up"),
                         ("mlp.down_proj", "ffn_down"), ("input_layernorm", "attn_norm"),
                         ("post_attention_layernorm", "ffn_norm")):
        names[f"model.layers.0.{ours}.weight"] = f"blk.0.{theirs}.weight"
    for ours, theirs in names.items():
        writer.add_tensor(theirs, weights[ours].numpy().astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_conversion_honours_the_dtype(tmp_path, monkeypatch):
    """--dtype bfloat16 converts a GGUF into its own folder of bf16 weights (float32 keeps the plain name)."""
    from safetensors import safe_open

    monkeypatch.setenv("SPECSPLIT_CACHE", str(tmp_path / "cache"))
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    bf16 = models.load_model(models.ModelSpec(str(gguf), dtype="bfloat16"))
    fp32 = models.load_model(models.ModelSpec(str(gguf)))
    folders = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert len(folders) == 2 and folders[0].startswith("tiny-") and folders[1] == folders[0] + "-bfloat16"
    with safe_open(str(tmp_path / "cache" / folders[1] / "model.safetensors"), "pt") as weights:
        assert {weights.get_slice(name).get_dtype() for name in weights.keys()} == {"BF16"}
    assert bf16.dtype == models.torch.bfloat16 and fp32.dtype == models.torch.float32
    assert models.torch.equal(bf16.model.embed_tokens.weight, fp32.model.embed_tokens.weight.bfloat16())
    assert models.load_tokenizer(str(gguf))("hi there").input_ids[:2] == [74, 75]  # byte-level "h", "i"


def test_a_ggufs_tokenizer_loads_without_converting_its_weights(tmp_path, monkeypatch):
    """An orchestrator needs only the tokenizer: it is read from the GGUF once into a folder of its own (no
    weights), and from the converted model's folder once the model is converted."""
    from transformers import AutoTokenizer

    monkeypatch.setenv("SPECSPLIT_CACHE", str(tmp_path / "cache"))
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    folder = models.tokenizer_folder(str(gguf))
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [folder.name] and folder.name.endswith("-tokenizer")
    assert not list(folder.glob("*.safetensors"))
    direct = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    assert models.load_tokenizer(str(gguf))("hi there").input_ids == direct("hi there").input_ids
    models.load_model(models.ModelSpec(str(gguf)))
    assert (models.tokenizer_folder(str(gguf)) / "model.safetensors").is_file()
