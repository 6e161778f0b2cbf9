"""The tensor-parallel fast forward: over gloo on two real ranks (``torchrun``), the decoder step on each rank's shard
(column-parallel projections, one all-reduce per row-parallel one, the vocabulary split in the embedding and the LM
head) gives the unsharded step's logits and hidden features to float32 rounding, with the same argmax, through
prefills, packed blocks of two sessions and rolled-back rejections: Llama 3, Qwen2.5 (biased q/k/v) and Qwen3 (q/k
norms)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from specsplit.bench.families import save_family

pytestmark = pytest.mark.services

ROOT = Path(__file__).resolve().parents[2]
FAMILIES = ("llama3", "qwen2.5", "qwen3")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_the_sharded_decoder_step_equals_the_whole_one(tmp_path, gguf_tokenizer):
    folders = [str(save_family(tmp_path / name, name, gguf_tokenizer)) for name in FAMILIES]
    out = tmp_path / "tp.json"
    torchrun = Path(sys.executable).with_name("torchrun")
    done = subprocess.run(
        [str(torchrun), "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
         str(ROOT / "tests" / "tp_step.py"), str(out), *folders],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    for folder, figures in report.items():
        assert figures["forward"].startswith("the decoder step, eager on this rank's shard"), (folder, figures)
        assert figures["argmax_equal"], (folder, figures)
        assert figures["max_logit_difference"] < 1e-4 and figures["max_feature_difference"] < 1e-4, (folder, figures)
