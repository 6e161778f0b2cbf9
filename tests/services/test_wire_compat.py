"""A client built from the published contract (protos/baseline/) is served as today's client is.

The old client's stubs are generated at test time from the baseline .proto and run in a process of their
own (both builds register the same proto file name, so one process cannot hold both). Its generation must
equal a current client's: text, token ids, finish reason and the stats that do not depend on timing. The
negative control builds the same client from a baseline with two fields' numbers swapped (what a
renumbering does to a client in the field) and shows the comparison catches the misreading.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_tools import protoc

from specsplit.v1 import specsplit_pb2 as pb
from specsplit.v1 import specsplit_pb2_grpc as pb_grpc

pytestmark = pytest.mark.services

REPO = Path(__file__).resolve().parents[2]
BASELINE = REPO / "protos" / "baseline"
CONTRACT = "specsplit/v1/specsplit.proto"
STATS = ("prompt_tokens", "new_tokens", "rounds", "drafted_tokens", "accepted_tokens", "k", "drafter", "mode",
         "adaptive_k", "overlap")

# The client, as an internal client built from the baseline would send it: greedy, 8 tokens, k = 4.
OLD_CLIENT = """
import json, sys
sys.path.insert(0, sys.argv[1])
import grpc
from specsplit.v1 import specsplit_pb2 as pb, specsplit_pb2_grpc as pb_grpc
assert pb.__file__.startswith(sys.argv[1]), pb.__file__
request = pb.GenerateRequest(prompt=sys.argv[3], chat=False, max_new_tokens=8, k=4, adaptive_k=False,
                             drafter=pb.DRAFTER_KIND_NGRAM, sampling=pb.SamplingParams(temperature=0),
                             return_token_ids=True)
with grpc.insecure_channel(sys.argv[2]) as channel:
    replies = list(pb_grpc.GeneratorStub(channel).Generate(request, timeout=120))
final = replies[-1]
print(json.dumps({"text": "".join(r.text for r in replies), "ids": [t for r in replies for t in r.token_ids],
                  "finish_reason": pb.FinishReason.Name(final.finish_reason),
                  "stats": {name: getattr(final.stats, name) for name in sys.argv[4].split(",")}}))
"""
PROMPT = "a b a b a b a b"


def build_stubs(proto_root: Path, out: Path) -> Path:
    """Stubs of ``proto_root``'s contract under ``out`` (a package ``specsplit.v1`` of their own)."""
    out.mkdir(parents=True)
    args = ["grpc_tools.protoc", f"--proto_path={proto_root}", f"--python_out={out}", f"--grpc_python_out={out}",
            CONTRACT]
    assert protoc.main(args) == 0
    (out / "specsplit" / "__init__.py").touch()
    (out / "specsplit" / "v1" / "__init__.py").touch()
    return out


def old_client(stubs: Path, address: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run([sys.executable, "-c", OLD_CLIENT, str(stubs), address, PROMPT, ",".join(STATS)],
                         capture_output=True, text=True, timeout=180, env=env, cwd=stubs)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


def current_client(address: str) -> dict:
    request = pb.GenerateRequest(prompt=PROMPT, chat=False, max_new_tokens=8, k=4, adaptive_k=False,
                                 drafter=pb.DRAFTER_KIND_NGRAM, sampling=pb.SamplingParams(temperature=0),
                                 return_token_ids=True)
    with grpc.insecure_channel(address) as channel:
        replies = list(pb_grpc.GeneratorStub(channel).Generate(request, timeout=120))
    final = replies[-1]
    return {"text": "".join(r.text for r in replies), "ids": [t for r in replies for t in r.token_ids],
            "finish_reason": pb.FinishReason.Name(final.finish_reason),
            "stats": {name: getattr(final.stats, name) for name in STATS}}


def test_a_client_built_from_the_baseline_is_served_as_a_current_one(public_api, tmp_path):
    stubs = build_stubs(BASELINE, tmp_path / "baseline-stubs")
    old, new = old_client(stubs, public_api), current_client(public_api)
    assert new["finish_reason"] == "FINISH_REASON_LENGTH" and len(new["ids"]) == 8
    assert new["stats"]["k"] == 4 and new["stats"]["new_tokens"] == 8 and new["stats"]["rounds"] > 0
    assert old == new, (old, new)


def test_a_renumbered_client_is_caught_by_the_same_comparison(public_api, tmp_path):
    """Negative control: the baseline with max_new_tokens and k swapped, as a renumbering leaves a client."""
    text = (BASELINE / CONTRACT).read_text()
    swapped = text.replace("optional uint32 max_new_tokens = 3;", "optional uint32 max_new_tokens = 6;")
    swapped = swapped.replace("optional uint32 k = 6;", "optional uint32 k = 3;")
    assert swapped.count("= 6;") == text.count("= 6;") and swapped != text
    root = tmp_path / "renumbered"
    (root / CONTRACT).parent.mkdir(parents=True)
    (root / CONTRACT).write_text(swapped)
    old = old_client(build_stubs(root, tmp_path / "renumbered-stubs"), public_api)
    assert old != current_client(public_api)
    assert len(old["ids"]) == 4  # the server read k = 4 as max_new_tokens
