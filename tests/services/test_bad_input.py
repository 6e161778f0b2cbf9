"""Bad input gets a clear gRPC status with an actionable message, and the servers keep serving."""

from __future__ import annotations

import subprocess
import sys

import grpc
import pytest

from specsplit.lmkit.wire_version import metadata as wire_metadata
from specsplit.orchestrator.api.config import OrchestratorConfig
from specsplit.orchestrator.api.generation import Orchestrator
from specsplit.v1 import specsplit_pb2 as pb
from specsplit.v1 import specsplit_pb2_grpc as pb_grpc
from tests.conftest import VOCAB, run_async

pytestmark = pytest.mark.services
VERSION = wire_metadata()  # what an orchestrator of this build states on every call

GREEDY = pb.SamplingParams(temperature=0.0)


async def target_exchange(address: str, messages: list[pb.TargetRequest]) -> list[pb.TargetResponse]:
    async with grpc.aio.insecure_channel(address) as channel:
        call = pb_grpc.TargetServiceStub(channel).Session(iter(messages), metadata=VERSION)
        return [r async for r in call]


async def draft_exchange(address: str, messages: list[pb.DraftRequest]) -> list[pb.DraftResponse]:
    async with grpc.aio.insecure_channel(address) as channel:
        call = pb_grpc.DraftServiceStub(channel).Session(iter(messages), metadata=VERSION)
        return [r async for r in call]


def target_open(tokens=(1, 2, 3), sampling=GREEDY, mode=pb.VERIFICATION_MODE_GREEDY, sid="s1"):
    return pb.TargetRequest(open=pb.TargetOpen(session_id=sid, tokens=list(tokens), sampling=sampling, mode=mode))


def verify(position, tokens=()):
    return pb.TargetRequest(verify=pb.VerifyRequest(position=position, draft_tokens=list(tokens)))


def expect_status(coro, code: grpc.StatusCode, *fragments: str):
    with pytest.raises(grpc.aio.AioRpcError) as info:
        run_async(coro)
    assert info.value.code() == code, info.value.details()
    for fragment in fragments:
        assert fragment in info.value.details(), info.value.details()
    return info.value.details()


def assert_still_serves(services):
    responses = run_async(target_exchange(services.target_address, [target_open(sid="healthy"), verify(3, [5, 6])]))
    assert responses[1].result.position == 3
    assert 0 <= responses[1].result.next_token < VOCAB


TARGET_CASES = {
    "token outside vocabulary": ([target_open(tokens=[1, VOCAB + 7])], grpc.StatusCode.INVALID_ARGUMENT, ["outside the vocabulary"]),
    "draft token outside vocabulary": ([target_open(), verify(3, [4, VOCAB])], grpc.StatusCode.INVALID_ARGUMENT, ["draft_tokens[1]"]),
    "block at wrong position": ([target_open(), verify(7, [4])], grpc.StatusCode.FAILED_PRECONDITION, ["position 3"]),
    "replayed block": ([target_open(), verify(3, [4]), verify(3, [4])], grpc.StatusCode.FAILED_PRECONDITION, ["committed"]),
    "block too large": ([target_open(), verify(3, list(range(40)))], grpc.StatusCode.INVALID_ARGUMENT, ["at most 32"]),
    "empty prompt": ([target_open(tokens=[])], grpc.StatusCode.INVALID_ARGUMENT, ["empty"]),
    "prompt longer than context": ([target_open(tokens=[5] * 600)], grpc.StatusCode.INVALID_ARGUMENT, ["context is 512"]),
    "temperature below zero": (
        [target_open(sampling=pb.SamplingParams(temperature=-1.0), mode=pb.VERIFICATION_MODE_TOKEN_ONLY)],
        grpc.StatusCode.INVALID_ARGUMENT, ["temperature"],
    ),
    "top_p above one": (
        [target_open(sampling=pb.SamplingParams(temperature=1.0, top_p=1.5), mode=pb.VERIFICATION_MODE_TOKEN_ONLY)],
        grpc.StatusCode.INVALID_ARGUMENT, ["top_p"],
    ),
    "top_p zero": (
        [target_open(sampling=pb.SamplingParams(temperature=1.0, top_p=0.0), mode=pb.VERIFICATION_MODE_TOKEN_ONLY)],
        grpc.StatusCode.INVALID_ARGUMENT, ["top_p"],
    ),
    "greedy mode with temperature": (
        [target_open(sampling=pb.SamplingParams(temperature=0.7))], grpc.StatusCode.INVALID_ARGUMENT, ["temperature 0"],
    ),
    "unknown mode": ([target_open(mode=9)], grpc.StatusCode.INVALID_ARGUMENT, ["verification mode"]),
    "logit_bias id outside vocabulary": (
        [target_open(sampling=pb.SamplingParams(logit_bias={VOCAB: 1.0}))], grpc.StatusCode.INVALID_ARGUMENT,
        ["logit_bias", "outside the vocabulary"],
    ),
    "verify before open": ([verify(0, [1])], grpc.StatusCode.FAILED_PRECONDITION, ["first message"]),
    "probs in token-only mode": (
        [
            target_open(sampling=pb.SamplingParams(temperature=1.0, seed=1), mode=pb.VERIFICATION_MODE_TOKEN_ONLY),
            pb.TargetRequest(verify=pb.VerifyRequest(position=3, draft_tokens=[4], draft_probs=pb.DraftProbs(rows=1, vocab_size=VOCAB))),
        ],
        grpc.StatusCode.INVALID_ARGUMENT, ["draft_probs"],
    ),
    "corrupt draft probs": (
        [
            target_open(sampling=pb.SamplingParams(temperature=1.0, seed=1), mode=pb.VERIFICATION_MODE_DRAFT_PROBS),
            pb.TargetRequest(verify=pb.VerifyRequest(
                position=3, draft_tokens=[4], draft_probs=pb.DraftProbs(rows=1, vocab_size=VOCAB, values=b"\x00\x01"))),
        ],
        grpc.StatusCode.INVALID_ARGUMENT, ["draft_probs"],
    ),
}


@pytest.mark.parametrize("case", list(TARGET_CASES))
def test_target_refuses(tiny_services, case):
    messages, code, fragments = TARGET_CASES[case]
    expect_status(target_exchange(tiny_services.target_address, messages), code, *fragments)
    assert_still_serves(tiny_services)


def draft_open(drafter=pb.DRAFTER_KIND_NGRAM, tokens=(1, 2, 3), sid="d1", **kw):
    return pb.DraftRequest(open=pb.DraftOpen(session_id=sid, tokens=list(tokens), sampling=GREEDY, drafter=drafter, **kw))


def propose(position, tokens=(), k=4, free_k=0):
    return pb.DraftRequest(propose=pb.ProposeRequest(position=position, tokens=list(tokens), k=k, free_k=free_k))


DRAFT_CASES = {
    "k too large": ([draft_open(), propose(3, [], 33)], grpc.StatusCode.INVALID_ARGUMENT, ["max block 32"]),
    "free_k too large": ([draft_open(), propose(3, [], 4, 33)], grpc.StatusCode.INVALID_ARGUMENT, ["free_k", "32"]),
    "position past context": ([draft_open(), propose(9, [1])], grpc.StatusCode.FAILED_PRECONDITION, ["holds 3 tokens"]),
    "token outside vocabulary": ([draft_open(drafter=pb.DRAFTER_KIND_MODEL, tokens=[VOCAB])], grpc.StatusCode.INVALID_ARGUMENT, ["outside"]),
    "unknown drafter": ([draft_open(drafter=42)], grpc.StatusCode.INVALID_ARGUMENT, ["drafter kind"]),
    "bad n-gram range": ([draft_open(ngram_min=5, ngram_max=2)], grpc.StatusCode.INVALID_ARGUMENT, ["max_n"]),
    "probs from the n-gram drafter": ([draft_open(return_probs=True)], grpc.StatusCode.INVALID_ARGUMENT, ["token-only"]),
    "empty prompt": ([draft_open(tokens=[])], grpc.StatusCode.INVALID_ARGUMENT, ["empty"]),
}


@pytest.mark.parametrize("case", list(DRAFT_CASES))
def test_draft_refuses(tiny_services, case):
    messages, code, fragments = DRAFT_CASES[case]
    expect_status(draft_exchange(tiny_services.draft_address, messages), code, *fragments)
    ok = run_async(draft_exchange(tiny_services.draft_address, [draft_open(sid="ok"), propose(3, [1, 2], 4)]))
    assert ok[1].block.position == 5


@pytest.mark.parametrize("stub_name", ["TargetServiceStub", "DraftServiceStub"])
def test_unknown_session_is_not_found(tiny_services, stub_name):
    address = tiny_services.target_address if stub_name.startswith("Target") else tiny_services.draft_address

    async def go():
        async with grpc.aio.insecure_channel(address) as channel:
            await getattr(pb_grpc, stub_name)(channel).GetSession(pb.GetSessionRequest(session_id="nope"))

    expect_status(go(), grpc.StatusCode.NOT_FOUND, "nope")


async def generate(address, request: pb.GenerateRequest) -> list[pb.GenerateResponse]:
    async with grpc.aio.insecure_channel(address) as channel:
        return [r async for r in pb_grpc.GeneratorStub(channel).Generate(request)]


PUBLIC_CASES = {
    "empty prompt": (pb.GenerateRequest(prompt=""), ["prompt is empty"]),
    "temperature below zero": (pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(temperature=-0.5)), ["temperature"]),
    "top_p outside (0, 1]": (pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(temperature=1, top_p=2)), ["top_p"]),
    "k too large": (pb.GenerateRequest(prompt="hi", k=1000), ["max block"]),
    "zero max_new_tokens": (pb.GenerateRequest(prompt="hi", max_new_tokens=0), ["max_new_tokens"]),
    "prompt longer than context": (pb.GenerateRequest(prompt="word " * 700), ["context is 512"]),
    "empty stop string": (pb.GenerateRequest(prompt="hi", stop=[""]), ["stop"]),
    "probs without a model drafter": (
        pb.GenerateRequest(prompt="hi", draft_probs=True, drafter=pb.DRAFTER_KIND_NGRAM), ["draft_probs needs"]),
    "a sampling mode with temperature 0": (
        pb.GenerateRequest(prompt="hi", mode=pb.VERIFICATION_MODE_COUPLED), ["temperature 0 is greedy"]),
    "draft_probs with another mode": (
        pb.GenerateRequest(prompt="hi", draft_probs=True, mode=pb.VERIFICATION_MODE_COUPLED,
                           sampling=pb.SamplingParams(temperature=1)), ["draft_probs asks for DRAFT_PROBS"]),
    "presence_penalty outside [-2, 2]": (
        pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(presence_penalty=3)), ["presence_penalty", "[-2, 2]"]),
    "repetition_penalty zero": (
        pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(repetition_penalty=0)), ["repetition_penalty", "> 0"]),
    "logit_bias above 100": (
        pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(logit_bias={5: 200})), ["logit_bias[5]", "[-100, 100]"]),
    "logit_bias id outside the vocabulary": (
        pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(logit_bias={10**6: 1})), ["logit_bias", "vocabulary"]),
    "an unknown mode": (
        pb.GenerateRequest(prompt="hi", mode=99, sampling=pb.SamplingParams(temperature=1)), ["not a verification mode"]),
}


@pytest.mark.parametrize("case", list(PUBLIC_CASES))
def test_public_api_refuses(public_api, case):
    request, fragments = PUBLIC_CASES[case]
    expect_status(generate(public_api, request), grpc.StatusCode.INVALID_ARGUMENT, *fragments)
    ok = run_async(generate(public_api, pb.GenerateRequest(prompt="Hello", max_new_tokens=4, return_token_ids=True)))
    assert sum(len(r.token_ids) for r in ok) >= 1
    assert ok[-1].finish_reason in (pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_EOS)


def other_vocabulary_model(path):
    """A tiny Llama whose tokenizer (3 words) is not SmolLM2's."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    raw = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]").save_pretrained(path)
    config = LlamaConfig(vocab_size=3, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def test_tokenizer_target_mismatch_is_refused_naming_both(tiny_services, tmp_path):
    other = other_vocabulary_model(tmp_path)
    config = OrchestratorConfig(tiny_services.target_address, "", tokenizer=str(other))
    with pytest.raises(ValueError) as info:
        run_async(Orchestrator.connect(config))
    message = str(info.value)
    assert "vocabulary mismatch" in message and str(tmp_path) in message and "tiny-target" in message


def test_draft_target_mismatch_is_refused_naming_both(tiny_services, tiny_target_dir, tmp_path, background_loop):
    from specsplit.draft_service.server import start_server
    from tests.conftest import make_engines

    other = other_vocabulary_model(tmp_path / "other")
    _, draft = make_engines(str(tiny_target_dir), str(other))
    server, port = background_loop.run(start_server(draft))
    try:
        config = OrchestratorConfig(tiny_services.target_address, f"127.0.0.1:{port}", tokenizer=str(tiny_target_dir))
        with pytest.raises(ValueError) as info:
            run_async(Orchestrator.connect(config))
    finally:
        background_loop.run(server.stop(0))
    message = str(info.value)
    assert "vocabulary mismatch" in message and "other" in message and "tiny-target" in message


def test_cli_rejects_negative_k_without_traceback():
    result = subprocess.run(
        [sys.executable, "-m", "specsplit.cli", "generate", "hi", "--k", "-1"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode != 0
    assert "--k" in result.stderr and "Traceback" not in result.stderr
