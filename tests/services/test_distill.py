"""``specsplit distill`` on a tiny target: trains, checkpoints, resumes, reports, and serve-draft loads the result."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest
import torch

from specsplit.draft_service import distill, eagle_distill, eagle_head, medusa, medusa_distill, self_draft
from specsplit.draft_service.server import build_parser as draft_parser
from specsplit.draft_service.server import check_self_draft_flags, derive_drafts
from specsplit.lmkit import models
from specsplit.lmkit.kinds import DrafterKind

pytestmark = pytest.mark.services


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from pydoc_data.topics import topics

    path = tmp_path_factory.mktemp("corpus") / "text.txt"
    path.write_text("\n\n".join(topics[k] for k in sorted(topics)[:40]))
    return path


@pytest.fixture(scope="module")
def deep_target_dir(tiny_target_dir, tmp_path_factory):
    """The tiny target with its second layer amplified, so skipping it changes the output (KL ~0.9, not ~0.003)."""
    model = models.load_model(models.ModelSpec(str(tiny_target_dir)))
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.mul_(30.0)
        model.model.layers[1].self_attn.o_proj.weight.mul_(30.0)
    out = tmp_path_factory.mktemp("deep-target")
    model.save_pretrained(out)
    models.load_tokenizer(str(tiny_target_dir)).save_pretrained(out)
    return out


def args_for(target, out, corpus, steps, **extra):
    argv = ["--target", str(target), "--layers", "1", "--out", str(out), "--corpus", str(corpus),
            "--steps", str(steps), "--batch", "2", "--seq-len", "32", "--lr", "0.003", "--save-every", "3",
            "--eval-windows", "4", "--max-corpus-tokens", "20000", "--threads", "1"]
    for key, value in extra.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    return distill.build_parser(argparse.ArgumentParser()).parse_args(argv)


def test_distill_trains_checkpoints_resumes_and_reports(deep_target_dir, corpus, tmp_path):
    tiny_target_dir = deep_target_dir
    out = tmp_path / "adapter"
    first = distill.distill(distill.config_from_args(args_for(tiny_target_dir, out, corpus, 3)), log=lambda _: None)
    assert first["resumed_at"] == 0
    assert torch.load(out / distill.CHECKPOINT, weights_only=True)["step"] == 3
    # Same settings, more steps: the run picks up at the checkpoint instead of starting over.
    messages = []
    report = distill.distill(distill.config_from_args(args_for(tiny_target_dir, out, corpus, 12)), log=messages.append)
    assert report["resumed_at"] == 3 and any("resuming" in m for m in messages)
    assert torch.load(out / distill.CHECKPOINT, weights_only=True)["step"] == 12
    saved = json.loads((out / distill.REPORT).read_text())
    assert saved == report
    # Training moved the draft towards the target on held-out text.
    assert report["held_out_after"]["kl"] < report["held_out_before"]["kl"]
    assert 0.0 <= report["held_out_after"]["greedy_agreement"] <= 1.0
    assert any("held-out greedy agreement" in m for m in messages)

    # serve-draft loads the folder: LAYERSKIP over 1 layer with the trained adapter.
    adapter, meta = self_draft.load_adapter(out)
    assert meta.layers == 1 and adapter.proj.weight.abs().sum() > 0
    flags = draft_parser().parse_args(["--model", str(tiny_target_dir), "--layerskip-adapter", str(out)])
    check_self_draft_flags(flags)
    model = models.load_model(models.ModelSpec(str(tiny_target_dir)))
    fingerprint = models.vocab_fingerprint(models.load_tokenizer(str(tiny_target_dir)))
    view = derive_drafts(flags, model, fingerprint)[DrafterKind.LAYERSKIP]
    ids = torch.tensor([[5, 100, 2000, 7, 9]])
    with torch.inference_mode():
        expected, _ = distill.draft_and_target_logits(model, adapter, 1, ids)
        assert torch.allclose(view(ids).logits, expected, atol=1e-5)
        assert not torch.allclose(view(ids).logits, self_draft.layerskip_view(model, 1)(ids).logits)


def test_training_logits_are_the_layerskip_drafts(tiny_target_dir):
    """The cheap training path (hidden_states[L] of one target pass) computes what the served view computes."""
    model = models.load_model(models.ModelSpec(str(tiny_target_dir)))
    adapter = self_draft.ExitAdapter(model.config.hidden_size)
    torch.nn.init.normal_(adapter.proj.weight, std=0.05)
    ids = torch.tensor([[5, 100, 2000, 7, 9, 31, 8]])
    with torch.no_grad():
        draft, target = distill.draft_and_target_logits(model, adapter, 1, ids)
        assert torch.allclose(draft, self_draft.layerskip_view(model, 1, adapter)(ids).logits, atol=1e-5)
        assert torch.allclose(target, model(ids).logits)


def test_resume_with_other_settings_is_refused(deep_target_dir, corpus, tmp_path):
    out = tmp_path / "adapter"
    distill.distill(distill.config_from_args(args_for(deep_target_dir, out, corpus, 3)), log=lambda _: None)
    with pytest.raises(ValueError, match="other settings"):
        distill.distill(distill.config_from_args(args_for(deep_target_dir, out, corpus, 6, lr=0.02)), log=lambda _: None)


def test_adapter_for_another_target_is_refused(tiny_target_dir, tiny_draft_dir, tmp_path):
    out = tmp_path / "foreign"
    meta = self_draft.AdapterMeta(1, 64, "other", "0" * 64)  # a fingerprint no tokenizer has
    self_draft.save_adapter(out, self_draft.ExitAdapter(64), meta)
    flags = draft_parser().parse_args(["--model", str(tiny_target_dir), "--layerskip-adapter", str(out)])
    model = models.load_model(models.ModelSpec(str(tiny_target_dir)))
    with pytest.raises(ValueError, match="was trained for other"):
        derive_drafts(flags, model, "f" * 64)


@pytest.mark.parametrize(
    "argv,fragment",
    [
        (["--steps", "0"], "--steps must be >= 1"),
        (["--corpus", "/nonexistent/texts"], "does not exist"),
    ],
)
def test_distill_cli_bad_input_is_a_clear_error(tmp_path, argv, fragment):
    result = subprocess.run(
        [sys.executable, "-m", "specsplit.cli", "distill", "--out", str(tmp_path / "o"), "--target",
         str(tmp_path / "missing-model"), *argv],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert fragment in result.stderr and "Traceback" not in result.stderr


def eagle_args_for(target, out, corpus, steps, **extra):
    argv = ["--eagle", "--target", str(target), "--out", str(out), "--corpus", str(corpus), "--steps", str(steps),
            "--corpus-tokens", "256", "--prompts", "4", "--held-out-prompts", "2", "--answer-tokens", "12",
            "--draft-vocab", "64", "--batch", "2", "--seq-len", "32", "--save-every", "2", "--gen-batch", "4"]
    for key, value in extra.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    return eagle_distill.config_from_args(distill.build_parser(argparse.ArgumentParser()).parse_args(argv))


def test_eagle_distill_stops_on_time_resumes_and_writes_a_servable_head(tiny_target_dir, corpus, tmp_path):
    out = tmp_path / "head"
    # --max-minutes: the first step already runs past a microsecond, so training stops there, checkpointed.
    stopped = eagle_distill.distill_eagle(eagle_args_for(tiny_target_dir, out, corpus, 4, max_minutes=1e-8))
    assert stopped == {"stopped_at": 1}
    assert torch.load(out / eagle_distill.CHECKPOINT, weights_only=True)["step"] == 1
    assert not (out / eagle_distill.REPORT).exists()
    data_files = sorted(p.name for p in (out / "data").glob("*.pt"))
    # The rerun reuses the data and the checkpoint and finishes.
    report = eagle_distill.distill_eagle(eagle_args_for(tiny_target_dir, out, corpus, 4))
    assert report["resumed_at"] == 1 and sorted(p.name for p in (out / "data").glob("*.pt")) == data_files
    assert json.loads((out / eagle_distill.REPORT).read_text()) == json.loads(json.dumps(report))
    held = report["held_out_answers"]
    assert held["rows"] > 0 and 0.0 <= held["top1_agreement"] <= 1.0
    assert sorted(int(k) for k in held["alpha_at_k"]) == [1, 2, 3, 4]
    assert report["feature_layers"] == [2, 1, 0] and report["training_positions"] > report["corpus_positions"] > 0
    # serve-draft's loader takes the folder for this target (the tiny target's own embedding).
    model = models.load_model(models.ModelSpec(str(tiny_target_dir)))
    head = eagle_head.load_head(str(out), model)
    assert head.config.draft_vocab_size == 64 and head.config.feature_layers == (2, 1, 0)
    # Other settings on the same folder are refused rather than mixed in.
    with pytest.raises(ValueError, match="other settings"):
        eagle_distill.distill_eagle(eagle_args_for(tiny_target_dir, out, corpus, 4, draft_vocab=32))


class _RunsCode:
    """Unpickling it would call ``print``: what a tampered checkpoint could do with any callable."""

    def __reduce__(self):
        return (print, ("a tampered checkpoint ran code",))


def test_a_checkpoint_that_would_run_code_is_refused(tmp_path, capsys):
    path = tmp_path / distill.CHECKPOINT
    torch.save({"config": {}, "step": 1, "payload": _RunsCode()}, path)
    with pytest.raises(ValueError, match="refusing to unpickle"):
        distill._load_checkpoint(path, None, None, None)
    with pytest.raises(ValueError, match="refusing to unpickle"):
        eagle_distill._resume(path, None, None, None)
    assert "ran code" not in capsys.readouterr().out


def medusa_args_for(target, out, corpus, steps, **extra):
    argv = ["--medusa", "--target", str(target), "--out", str(out), "--corpus", str(corpus), "--steps", str(steps),
            "--medusa-corpus-tokens", "256", "--medusa-prompts", "4", "--medusa-held-out-prompts", "2",
            "--medusa-answer-tokens", "12", "--batch", "8", "--seq-len", "32", "--save-every", "2", "--gen-batch", "4"]
    for key, value in extra.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    return medusa_distill.config_from_args(distill.build_parser(argparse.ArgumentParser()).parse_args(argv))


def test_medusa_distill_stops_on_time_resumes_and_writes_servable_heads(tiny_target_dir, corpus, tmp_path):
    out = tmp_path / "medusa"
    stopped = medusa_distill.distill_medusa(medusa_args_for(tiny_target_dir, out, corpus, 4, max_minutes=1e-8))
    assert stopped == {"stopped_at": 1}
    assert torch.load(out / medusa_distill.CHECKPOINT, weights_only=True)["step"] == 1
    data_files = sorted(p.name for p in (out / "data").glob("*.pt"))
    report = medusa_distill.distill_medusa(medusa_args_for(tiny_target_dir, out, corpus, 4))
    assert report["resumed_at"] == 1 and sorted(p.name for p in (out / "data").glob("*.pt")) == data_files
    assert json.loads((out / medusa_distill.REPORT).read_text()) == json.loads(json.dumps(report))
    held = report["held_out"]
    assert held["positions"] > 0 and len(held["top1_per_head"]) == 3
    assert 0.0 <= held["mean_accepted_length"] <= 3.0
    model = models.load_model(models.ModelSpec(str(tiny_target_dir)))
    heads = medusa.load_heads(out, model)  # what serve-draft --medusa-head OUT loads
    assert heads.config.num_heads == 3 and heads.lm_heads is None  # they share the target's LM head
    ranked = medusa.read_draft_vocab(out, 1 << 20)  # the target's training choices, most frequent first
    assert report["draft_vocab"]["ranked"] == len(ranked) == len(set(ranked.tolist())) > 0
    assert torch.equal(heads.draft_ids, ranked[: medusa.DEFAULT_DRAFT_VOCAB])
    coverage = list(report["draft_vocab"]["held_out_coverage"].values())
    assert coverage == sorted(coverage) and 0.0 < coverage[-1] <= 1.0
    with pytest.raises(ValueError, match="other settings"):
        medusa_distill.distill_medusa(medusa_args_for(tiny_target_dir, out, corpus, 4, medusa_heads=2))


@pytest.mark.parametrize("device,fragment", [("tpu", "cpu or cuda"), ("cuda:x", "cpu or cuda")])
def test_a_bad_medusa_device_is_refused(tmp_path, device, fragment):
    with pytest.raises(ValueError, match=fragment):
        medusa_args_for("smollm2-135m", tmp_path / "m", tmp_path, 1, medusa_device=device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message where no GPU is")
def test_medusa_on_cuda_without_a_gpu_says_so_before_loading(tmp_path):
    config = medusa_args_for("smollm2-135m", tmp_path / "m", tmp_path, 1, medusa_device="cuda")
    with pytest.raises(ValueError, match="no CUDA device here"):
        medusa_distill.distill_medusa(config)


def test_medusa_agreement_counts_a_chains_accepted_length():
    """Two heads, held-out answers of one sequence: the report's figures from hand-made guesses."""
    from specsplit.draft_service.eagle_data import Segments

    class Fixed(torch.nn.Module):  # head i guesses token (position's argmax label + i), by construction
        config = medusa.MedusaConfig(2, 1)

        def logits(self, hidden, first=0, count=None):
            ids = hidden[:, 0].long()  # [rows]: the row's own label, written into its hidden state below
            out = torch.full((2, len(ids), 50), -1e9)
            out[0, torch.arange(len(ids)), ids] = 0.0  # head 0 is right
            out[1, torch.arange(len(ids)), (ids + 1) % 50] = 0.0  # head 1 is right only where labels repeat + 1
            return out

        def best(self, hidden, first, count, top):  # as MedusaHeads.best over the whole vocabulary
            probs, ids = self.logits(hidden).softmax(-1).topk(top, dim=-1)
            return ids, probs

        def parameter_like(self):  # the heads' device and dtype
            return torch.zeros(())

    argmax = torch.tensor([3, 4, 5, 9, 7, 8, 9, 1])
    final = torch.zeros(8, 4)
    final[:-1, 0] = argmax[1:].float()  # position j's hidden carries the label of head 0: argmax[j + 1]
    held = Segments(torch.zeros(8, dtype=torch.long), final[:, :0].half(), final.half(), argmax,
                    torch.tensor([0, 8]), torch.tensor([2]))
    got = medusa_distill.agreement(Fixed(), held)
    # rows 2..5 (answer from 2; j + 2 < 8): head 0 always right; head 1 right where argmax[j+2] == argmax[j+1] + 1
    assert got["positions"] == 4 and got["top1_per_head"] == [1.0, 0.5]
    assert got["mean_accepted_length"] == 1.5
