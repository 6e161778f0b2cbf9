"""Shared fixtures: tiny context-sensitive models on the real vocabulary, and real gRPC services on 127.0.0.1.

Services run in-process on a background event loop (real servers, real
sockets, port 0); tests drive them from their own loop through real channels.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from pathlib import Path

import pytest
import torch

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(1)

TESTS = Path(__file__).resolve().parent
TIERS = ("unit", "stats", "services", "ray", "k8s")  # a folder under tests/ each; pyproject.toml describes them


def folder_tier(path: Path) -> str | None:
    """The tier whose folder under tests/ holds ``path``; None outside the five."""
    path = path.resolve()
    parts = path.relative_to(TESTS).parts if path.is_relative_to(TESTS) else ()
    return parts[0] if len(parts) > 1 and parts[0] in TIERS else None


def pytest_collection_modifyitems(config, items):
    """Every test carries exactly one tier marker (its module's pytestmark), the one its folder names, so
    `pytest tests/unit` and `pytest -m unit` select the same tests, and a test in the wrong place is refused."""
    wrong: dict[str, list] = {}  # module -> its wrong tests as (node id, tier markers, folder's tier)
    for item in items:
        marked = sorted({mark.name for mark in item.iter_markers()} & set(TIERS))
        folder = folder_tier(item.path)
        if marked != [folder]:
            wrong.setdefault(item.nodeid.split("::")[0], []).append((item.nodeid, marked, folder))
    if wrong:
        lines = [_misplaced(*tests[0], more=len(tests) - 1) for tests in wrong.values()]
        raise pytest.UsageError(
            f"a test lives in tests/TIER/ and carries that one tier marker (pytestmark), TIER one of {TIERS}:\n"
            + "\n".join(lines)
        )


def _misplaced(nodeid: str, marked: list[str], folder: str | None, more: int) -> str:
    where = f"in tests/{folder}/" if folder else "outside the tier folders"
    also = f" (and {more} more of its module)" if more else ""
    return f"  {nodeid}{also}: marked {', '.join(marked) or 'with no tier'}, {where}"


RAY_UNIT = "tests/ray"  # one unit: its modules share one local cluster (every `ray` test is in it, above)
# The longest units, longest first (their seconds alone: docs/testing.md#wall-time): they start before
# everything else, so that no long unit starts late and leaves the other worker idle at the end of the run.
LONGEST_UNITS = (
    RAY_UNIT,
    "tests/services/test_greedy_e2e.py",
    "tests/services/test_drafters_e2e.py",
    "tests/services/test_speed_e2e.py",
    "tests/services/test_penalties_e2e.py",
    "tests/services/test_faults.py",
    "tests/services/test_structured_outputs_openai.py",
    "tests/services/test_network_e2e.py",
    "tests/services/test_tensor_parallel.py",
    "tests/services/test_fuzz.py",
    "tests/services/test_sampling_e2e.py",
)


def pytest_xdist_make_scheduler(config, log):
    """`make test` runs `pytest -n N --dist loadscope`: each test module runs whole on one worker, so its
    module-scoped services start once, and the Ray modules (tests/ray/) run as one unit, so only
    one local Ray cluster exists at a time. Units start in LONGEST_UNITS' order, then xdist's (most tests
    first). (xdist's own loadgroup marks do not reach its scheduler under pytest 9, whose node ids are
    read-only.)"""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    stale = [unit for unit in LONGEST_UNITS if not (config.rootpath / unit).exists()]
    if stale:
        raise pytest.UsageError(f"LONGEST_UNITS in tests/conftest.py names paths that do not exist: {stale}")
    rank = {unit: i for i, unit in enumerate(LONGEST_UNITS)}

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return RAY_UNIT if module.startswith(RAY_UNIT + "/") else module

        def _assign_work_unit(self, node) -> None:
            longest = min(self.workqueue, key=lambda unit: rank.get(unit, len(rank)))  # first of equals: xdist's
            self.workqueue.move_to_end(longest, last=False)
            super()._assign_work_unit(node)

    return ModuleScheduling(config, log)


def wait_until(condition, timeout_s: float = 10.0) -> bool:
    """Poll ``condition`` until it holds (True) or ``timeout_s`` passes (False)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


VOCAB = 49152  # SmolLM2's vocabulary: tiny models share it, so any of them drafts for the real target


@pytest.fixture(scope="session")
def gguf_tokenizer():
    """The SmolLM2 tokenizer of the bundled GGUF (read from it once, then from its cached folder)."""
    from specsplit.lmkit.models import DEFAULT_MODEL, load_tokenizer

    return load_tokenizer(DEFAULT_MODEL)


FAMILY_SEED = 20261207  # the tiny models' shared embeddings and first layer: what makes a draft agree with a target


def save_tiny_llama(path: Path, tokenizer, seed: int, layers: int = 2, hidden: int = 64, context: int = 512) -> Path:
    """A tiny Llama on the SmolLM2 vocabulary whose greedy output depends on its context, saved like any checkpoint
    folder (``hidden`` a multiple of 16).

    Each layer holds a copy head: every attention head of the layer shares one query map ``A`` (random, large enough
    to make attention sharp) and its keys are ``A`` turned 90 degrees in each rotary plane, so a token's score for
    another is antisymmetric and position-dependent (rotary), and zero for itself; values are the normalised
    residual and the output projection writes the attended vector back scaled, so the residual stream becomes the
    embedding of the context token the head picked. The output head is the embedding matrix (untied, scaled), so
    the greedy token is the context token the heads point at: it moves with the prompt, the positions and every
    key and value in the cache, with logit margins far above float32 rounding (a random model's top two logits
    are near-ties). Fed one token with no context, the model repeats it. Greedy, it never writes a special
    token (their output rows are zero); a logit bias makes it. The embeddings and the first layer's head
    come from ``FAMILY_SEED``, later layers' heads and every MLP from ``seed``: a one-layer draft agrees with a
    two-layer target at most positions, not all."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    head_dim = 16
    kv_heads = hidden // head_dim
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=2 * kv_heads,  # grouped-query attention, two query heads a key head
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=context,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    family, own = torch.Generator().manual_seed(FAMILY_SEED), torch.Generator().manual_seed(seed)
    with torch.no_grad():
        embed = torch.randn(VOCAB, hidden, generator=family) * 0.02
        head = embed * 8.0
        # Special tokens (end of turn, end of text, ...) read as a plain token at the vocabulary's end and are never
        # pointed at: a chat template's <|im_end|> in the context would otherwise end every generation early.
        special = torch.tensor(sorted(tokenizer.added_tokens_decoder), dtype=torch.long)
        embed[special] = embed[VOCAB - 1 - special]
        head[special] = 0.0
        model.model.embed_tokens.weight.copy_(embed)
        model.lm_head.weight.copy_(head)
        for index, layer in enumerate(model.model.layers):
            attention = layer.self_attn
            query = torch.randn(head_dim, hidden, generator=family if index == 0 else own) * 0.4
            key = torch.cat([query[head_dim // 2 :], -query[: head_dim // 2]])  # rotate_half's planes, 90 degrees
            attention.q_proj.weight.copy_(query.repeat(2 * kv_heads, 1))
            attention.k_proj.weight.copy_(key.repeat(kv_heads, 1))
            attention.v_proj.weight.copy_(torch.eye(hidden))
            scale = 4.0 if index == 0 else 2.0
            out = torch.zeros(hidden, 2 * kv_heads * head_dim)
            for head in range(2 * kv_heads):  # each query head writes half its key head's slice
                rows, columns = head // 2 * head_dim, head * head_dim
                out[rows : rows + head_dim, columns : columns + head_dim] = torch.eye(head_dim) * scale / 2
            attention.o_proj.weight.copy_(out)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    GenerationConfig(eos_token_id=2, pad_token_id=2, bos_token_id=1).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory, gguf_tokenizer) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-target"), gguf_tokenizer, seed=1, layers=2)


@pytest.fixture(scope="session")
def tiny_draft_dir(tmp_path_factory, gguf_tokenizer) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-draft"), gguf_tokenizer, seed=2, layers=1)


TINY_PROMPTS = [
    "The quick brown fox",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "1, 2, 3, 4, 5, 6,",
    "Paris is the capital of",
    "import numpy as np\nimport torch\n",
    "a b a b a b a b",
    "Q: What is two plus two?\nA:",
]


def reference_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=2
        )
    return out[0, len(prompt_ids) :].tolist()


@pytest.fixture(scope="session")
def tiny_reference(tiny_target_dir, gguf_tokenizer):
    """The tiny target's own greedy continuations (24 tokens) of TINY_PROMPTS: what every equality test expects."""
    from specsplit.lmkit import models

    model = models.load_model(models.ModelSpec(str(tiny_target_dir)))
    prompts_ids = [gguf_tokenizer.encode(p) for p in TINY_PROMPTS]
    return prompts_ids, [reference_greedy(model, ids, 24) for ids in prompts_ids]


class BackgroundLoop:
    """An asyncio loop on its own thread, hosting servers for the length of a fixture."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 120.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="session")
def background_loop():
    loop = BackgroundLoop()
    yield loop
    loop.close()


class Services:
    """A target and a draft server on 127.0.0.1 with their engines (for session counts)."""

    def __init__(self, loop: BackgroundLoop, target_engine, draft_engine, max_batch: int = 32) -> None:
        from specsplit.draft_service.server import start_server as start_draft
        from specsplit.target_service.server import start_server as start_target

        self.loop = loop
        self.target_engine = target_engine
        self.draft_engine = draft_engine
        self.target_server, target_port = loop.run(start_target(target_engine, max_batch=max_batch))
        self.draft_server, draft_port = loop.run(start_draft(draft_engine))
        self.target_address = f"127.0.0.1:{target_port}"
        self.draft_address = f"127.0.0.1:{draft_port}"

    def stop(self) -> None:
        self.loop.run(self.target_server.stop(0))
        self.loop.run(self.draft_server.stop(0))


class ServiceProcesses:
    """The addresses of a real serve-target and serve-draft process (``service_processes``)."""

    def __init__(self, target_address: str, draft_address: str) -> None:
        self.target_address, self.draft_address = target_address, draft_address


@contextlib.contextmanager
def service_processes(workdir: Path, target_args: list[str], draft_args: list[str], timeout_s: float = 120):
    """Real serve-target and serve-draft processes with these flags, stopped on leaving."""
    from specsplit.lmkit.processes import start_service

    target = start_service("specsplit.target_service.server", "target", target_args, workdir, timeout_s)
    try:
        draft = start_service("specsplit.draft_service.server", "draft", draft_args, workdir, timeout_s)
    except BaseException:
        target.stop()
        raise
    try:
        yield ServiceProcesses(target.address, draft.address)
    finally:
        draft.stop()
        target.stop()


def make_engines(target_ref: str, draft_ref: str | None, max_block: int = 32, compile_mode: str = "off",
                 prefill_chunk: int | None = None):
    """Target and draft engines as the servers build them, with the servers' default prefill chunk unless told."""
    from specsplit.draft_service.engine import DraftEngine
    from specsplit.lmkit import models
    from specsplit.lmkit.sessions import DEFAULT_PREFILL_CHUNK, SessionLimits
    from specsplit.target_service.engine import TargetEngine

    prefill_chunk = DEFAULT_PREFILL_CHUNK if prefill_chunk is None else prefill_chunk

    target_model = models.load_model(models.ModelSpec(target_ref))
    fingerprint = models.vocab_fingerprint(models.load_tokenizer(target_ref))
    target = TargetEngine(
        target_model, model_id=target_ref, vocab_fingerprint=fingerprint, limits=SessionLimits(max_block=max_block),
        compile_mode=compile_mode, prefill_chunk=prefill_chunk,
    )
    draft_model = models.load_model(models.ModelSpec(draft_ref)) if draft_ref else None
    draft = DraftEngine(
        draft_model,
        model_id=draft_ref or "",
        vocab_fingerprint=models.vocab_fingerprint(models.load_tokenizer(draft_ref)) if draft_ref else "",
        limits=SessionLimits(max_block=max_block),
        prefill_chunk=prefill_chunk,
    )
    return target, draft


@pytest.fixture(scope="session")
def tiny_services(background_loop, tiny_target_dir, tiny_draft_dir):
    """Tiny random target + tiny random draft (model and n-gram drafters) behind real gRPC."""
    target, draft = make_engines(str(tiny_target_dir), str(tiny_draft_dir))
    services = Services(background_loop, target, draft)
    yield services
    services.stop()


@pytest.fixture(scope="module")
def public_api(tiny_services, tiny_target_dir, background_loop):
    """The public Generate API (an in-process orchestrator server) over ``tiny_services``."""
    from specsplit.orchestrator.api.config import OrchestratorConfig
    from specsplit.orchestrator.api.generation import Orchestrator
    from specsplit.orchestrator.api.server import start_server

    config = OrchestratorConfig(tiny_services.target_address, tiny_services.draft_address, str(tiny_target_dir))
    orch = background_loop.run(Orchestrator.connect(config))
    server, port = background_loop.run(start_server(orch))
    yield f"127.0.0.1:{port}"
    background_loop.run(server.stop(0))
    background_loop.run(orch.close())


@contextlib.contextmanager
def openai_http(loop: BackgroundLoop, services: Services, tokenizer_dir, model: str):
    """An orchestrator over ``services`` serving the OpenAI-compatible API on 127.0.0.1 as ``model``, in ``loop``,
    for the ``with`` block: yields its base URL (``.../v1``)."""
    from specsplit.orchestrator.api import openai_server
    from specsplit.orchestrator.api.config import OrchestratorConfig
    from specsplit.orchestrator.api.generation import Orchestrator

    config = OrchestratorConfig(services.target_address, services.draft_address, str(tokenizer_dir),
                                served_model_names=(model,))
    orch = loop.run(Orchestrator.connect(config))
    server = loop.run(openai_server.start_http_server(openai_server.build_app(orch), "127.0.0.1", 0))
    try:
        yield f"http://127.0.0.1:{server.port}/v1"
    finally:
        loop.run(server.stop())
        loop.run(orch.close())


def run_async(coro, timeout: float = 600.0):
    """Run a coroutine on a fresh loop in this thread (the test's client side)."""
    return asyncio.run(asyncio.wait_for(coro, timeout))
