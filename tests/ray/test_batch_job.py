"""`specsplit batch`: a JSONL file of prompts through orchestrator workers on Ray, resumable after a crash."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from specsplit import cli
from specsplit.ray_deploy import batch_files
from tests.conftest import run_async
from tests.ray.test_serve import generate

pytestmark = pytest.mark.ray

N_PROMPTS = 24


def prompt_lines() -> list[dict]:
    """Raw prompts (no chat template: a random tiny model answers varied text), per-prompt parameters."""
    lines = []
    for i in range(N_PROMPTS):
        line = {"prompt": f"Item {i}: the quick brown fox jumps over", "chat": False, "max_new_tokens": 24 + i % 3}
        if i % 4 != 3:
            line["id"] = f"p{i:02d}"  # every fourth line has no id: it becomes line-<n>
        if i % 6 == 5:
            line.update(temperature=0.8, top_p=0.9, seed=1000 + i)
        lines.append(line)
    return lines


def run_batch(args: list[str], **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "specsplit.cli", "batch", *args], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **popen)


def count_lines(path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def test_batch_killed_halfway_then_resumed_has_every_prompt_once(
    ray_cluster, tiny_services, tiny_target_dir, public_api, tmp_path
):
    prompts, output = tmp_path / "prompts.jsonl", tmp_path / "results.jsonl"
    prompts.write_text("".join(json.dumps(line) + "\n" for line in prompt_lines()))
    args = ["--input", str(prompts), "--output", str(output), "--ray-address", ray_cluster.address,
            "--workers", "2", "--concurrency", "1", "--worker-cpus", "0", "--k", "4",
            "--target", tiny_services.target_address, "--draft", tiny_services.draft_address,
            "--tokenizer", str(tiny_target_dir)]

    first = run_batch(args)
    deadline = time.monotonic() + 120
    while count_lines(output) < 6:
        assert first.poll() is None, first.communicate()[1]
        assert time.monotonic() < deadline, "no results within 120 s"
        time.sleep(0.02)
    first.send_signal(signal.SIGKILL)
    first.communicate()
    finished_before = count_lines(output)
    assert 6 <= finished_before < N_PROMPTS
    with output.open("a") as out:
        out.write('{"id": "p99", "text": "torn by a cra')  # a crash mid-write leaves half a line

    second = run_batch(args)
    stdout, stderr = second.communicate(timeout=300)
    assert second.returncode == 0, stderr
    assert "dropped a torn last line" in stderr
    assert f"{N_PROMPTS}/{N_PROMPTS} prompts done ({finished_before} before, {N_PROMPTS - finished_before} now" in stdout
    assert "tokens/s" in stdout and "acceptance" in stdout

    records = [json.loads(line) for line in output.read_text().splitlines()]
    ids = [record["id"] for record in records]
    specs = batch_files.parse_prompts(prompts.read_text())
    assert sorted(ids) == sorted(spec.id for spec in specs) and len(ids) == len(set(ids)) == N_PROMPTS
    by_id = {record["id"]: record for record in records}
    for spec in specs:
        record = by_id[spec.id]
        assert "error" not in record, record
        if spec.fields.get("temperature"):  # sampled: its own seed, at most max_new_tokens
            assert record["seed"] == spec.fields["seed"] and record["new_tokens"] <= spec.fields["max_new_tokens"]
            continue
        want, _, code = run_async(generate(public_api, batch_files.to_request(spec.fields)))
        assert code == "OK" and record["text"] == want, f"{spec.id} differs from the plain orchestrator"

    again = run_batch(args)  # everything is done: nothing runs, nothing is appended
    stdout, _ = again.communicate(timeout=120)
    assert again.returncode == 0 and f"({N_PROMPTS} before, 0 now" in stdout
    assert count_lines(output) == N_PROMPTS


def cli_error(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["batch", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def test_bad_input_is_a_cli_error_naming_the_line(tmp_path, capsys):
    out = str(tmp_path / "out.jsonl")
    assert "does not exist" in cli_error(["--input", str(tmp_path / "missing.jsonl"), "--output", out], capsys)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "fine"}\n\n{"prompt": "broken",\n')
    assert "line 3: not valid JSON" in cli_error(["--input", str(bad), "--output", out], capsys)
    bad.write_text('{"prompt": "a", "temprature": 0.5}\n')
    assert "line 1: unknown key(s) temprature" in cli_error(["--input", str(bad), "--output", out], capsys)
    assert not os.path.exists(out)


def test_prompt_lines_are_validated():
    assert batch_files.parse_prompts('{"prompt": "a"}\n\n{"id": "x", "prompt": "b"}\n')[0].id == "line-1"
    for text, message in [
        ('{"prompt": "a", "max_new_tokens": "5"}', "line 1: max_new_tokens must be an integer"),
        ('{"prompt": "a", "max_new_tokens": true}', "max_new_tokens must be an integer"),
        ('{"prompt": "a", "temperature": "hot"}', "temperature must be a number"),
        ('{"prompt": ""}', '"prompt" is missing or empty'),
        ('["a"]', "expected a JSON object"),
        ('{"prompt": "a", "drafter": "magic"}', "drafter must be one of"),
        ('{"id": "a", "prompt": "x"}\n{"id": "a", "prompt": "y"}', "line 2: id 'a' already used on line 1"),
    ]:
        with pytest.raises(ValueError, match=message.replace("(", r"\(")):
            batch_files.parse_prompts(text)
    request = batch_files.to_request({"prompt": "p", "temperature": 0.7, "seed": 3, "stop": "\n", "drafter": "ngram"})
    assert request.sampling.seed == 3 and list(request.stop) == ["\n"] and request.chat


def test_output_scan_drops_only_a_torn_last_line():
    good = b'{"id": "a", "text": "x"}\n{"id": "b", "text": "y"}\n'
    assert batch_files.scan_output(good) == ({"a", "b"}, len(good))
    assert batch_files.scan_output(good + b'{"id": "c", "te') == ({"a", "b"}, len(good))
    assert batch_files.scan_output(good + b'{"id": "c", "te\n') == ({"a", "b"}, len(good))
    with pytest.raises(ValueError, match="output line 1 is not a result line"):
        batch_files.scan_output(b"garbage\n" + good)
