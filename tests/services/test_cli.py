"""The user's path: serve-target, serve-draft and serve as processes, `specsplit generate` as a client."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

from specsplit.lmkit import models
from specsplit.lmkit.processes import start_service

pytestmark = pytest.mark.services


@pytest.fixture(scope="module")
def services(tmp_path_factory, tiny_target_dir, tiny_draft_dir):
    """The three processes, started as a user starts them; the orchestrator last."""
    work = tmp_path_factory.mktemp("cli")
    started = []
    try:
        target = start_service("specsplit.target_service.server", "target", ["--model", str(tiny_target_dir)], work, 300)
        started.append(target)
        draft = start_service("specsplit.draft_service.server", "draft", ["--model", str(tiny_draft_dir)], work, 300)
        started.append(draft)
        orch = start_service(
            "specsplit.orchestrator.api.server", "orchestrator",
            ["--target", target.address, "--draft", draft.address, "--tokenizer", str(tiny_target_dir)], work, 300,
        )
        started.append(orch)
        yield started
    finally:
        for service in reversed(started):
            assert service.stop() == 0, service.log_tail()  # SIGTERM drains and exits cleanly


@pytest.fixture(scope="module")
def stack(services) -> str:
    return services[-1].address


def test_each_process_freezes_its_startup_heap_before_serving(services):
    """What start-up leaves alive (imports, model, tokenizer) is frozen out of garbage collection, so no
    collection while serving walks it (lmkit.heap)."""
    for service in services:
        log = service.log_path.read_text()
        frozen = re.search(r": (\d+) start-up objects frozen out of garbage collection", log)
        assert frozen and int(frozen.group(1)) > 10_000, service.log_tail()
        assert log.index("frozen out of garbage collection") < log.index("serving on"), service.log_tail()


def specsplit(*args, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specsplit.cli", *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("drafter", ["model", "ngram"])
def test_generate_streams_the_targets_greedy_text(stack, tiny_target_dir, drafter):
    result = specsplit("generate", "Tell me a story.", "--server", stack, "--max-new-tokens", "16", "--k", "4",
                       "--drafter", drafter)
    assert result.returncode == 0, result.stderr
    tokenizer = models.load_tokenizer(str(tiny_target_dir))
    model = models.load_model(models.ModelSpec(str(tiny_target_dir)))
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Tell me a story."}], add_generation_prompt=True)
    ids = list(ids["input_ids"])
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, pad_token_id=2)
    expected = tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)
    assert result.stdout == expected
    assert "acceptance" in result.stderr and "tok/s" in result.stderr


def test_generate_constrains_samples_and_sends_tools_from_its_flags(stack, tmp_path):
    import json

    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["a"], "additionalProperties": False}
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    (tmp_path / "tools.json").write_text(json.dumps([{"type": "function", "function": {"name": "add", "parameters": schema}}]))
    common = ("--server", stack, "--max-new-tokens", "24", "--k", "4")
    shaped = specsplit("generate", "Give me JSON.", *common, "--json-schema", str(tmp_path / "schema.json"))
    assert shaped.returncode == 0, shaped.stderr
    assert set(json.loads(shaped.stdout)) == {"a"} and 0 <= json.loads(shaped.stdout)["a"] <= 9
    matched = specsplit("generate", "Answer.", *common, "--regex", r"(yes|no), [a-z]{2,6}\.")
    assert re.fullmatch(r"(yes|no), [a-z]{2,6}\.", matched.stdout), matched.stdout
    picked = specsplit("generate", "Pick.", *common, "--choice", "alpha", "--choice", "beta gamma",
                       "--temperature", "1", "--seed", "3", "--n", "3")
    assert picked.returncode == 0, picked.stderr
    assert picked.stdout.splitlines() and all(line in ("alpha", "beta gamma") for line in picked.stdout.splitlines())
    assert len(picked.stdout.splitlines()) == 3 and picked.stderr.count("--- sample") == 3
    tools = specsplit("generate", "Add.", *common, "--tools", str(tmp_path / "tools.json"))
    assert tools.returncode == 0, tools.stderr  # written into the conversation: SmolLM2's template renders none
    (tmp_path / "bad.json").write_text("{not json")
    bad = specsplit("generate", "x", *common, "--json-schema", str(tmp_path / "bad.json"))
    assert bad.returncode == 2 and "is not JSON" in bad.stderr and "Traceback" not in bad.stderr
    both = specsplit("generate", "x", *common, "--regex", "a", "--choice", "b")
    assert both.returncode == 2 and "not allowed with" in both.stderr


def test_generate_reports_bad_input_without_traceback(stack):
    result = specsplit("generate", "hi", "--server", stack, "--temperature", "-1")
    assert result.returncode == 1
    assert "INVALID_ARGUMENT" in result.stderr and "temperature" in result.stderr
    assert "Traceback" not in result.stderr


def test_bad_service_flag_is_a_cli_error():
    result = specsplit("serve-target", "--max-block", "-3", "--port", "0")
    assert result.returncode == 2
    assert "--max-block" in result.stderr and "Traceback" not in result.stderr


def test_missing_model_is_a_cli_error(tmp_path):
    result = specsplit("serve-draft", "--model", str(tmp_path / "nothing.gguf"), "--port", "0")
    assert result.returncode == 2
    assert "does not exist" in result.stderr and "Traceback" not in result.stderr


def test_generate_and_the_light_client_import_neither_torch_nor_ray(stack):
    """`specsplit generate` (its real entry point, against a real orchestrator) and specsplit.client stay light."""
    program = (
        "import sys\n"
        "from specsplit.cli import main\n"
        "try:\n"
        f"    main(['generate', 'Hello', '--server', '{stack}', '--max-new-tokens', '4'])\n"
        "except SystemExit as exc:\n"
        "    assert exc.code == 0, exc.code\n"
        "import specsplit.client\n"
        "print('HEAVY', sorted(m for m in ('torch', 'ray', 'transformers', 'numpy') if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "tok/s" in result.stderr  # it really generated
    assert "HEAVY []" in result.stdout
