"""Every drafter through the real services: greedy equality, lossless sampling, bad input.

The draft service here runs the *target's own* checkpoint with both
self-drafters derived from it (LAYERSKIP over 1 of 2 layers, QUANTIZED int8),
as ``serve-draft --model TARGET --layerskip-layers 1 --quantize int8`` does.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys

import grpc
import pytest
import torch

from specsplit.draft_service import self_draft
from specsplit.draft_service.engine import DraftEngine
from specsplit.draft_service.registry import DRAFTERS
from specsplit.lmkit import models
from specsplit.lmkit.kinds import DrafterKind, VerificationMode
from specsplit.lmkit.sampling import SamplingParams
from specsplit.lmkit.sessions import SessionLimits
from specsplit.orchestrator.api.config import OrchestratorConfig
from specsplit.orchestrator.api.generation import GenerationRequest, Orchestrator
from specsplit.orchestrator.decode.links import LinkPolicy
from specsplit.v1 import specsplit_pb2 as pb
from tests.conftest import TINY_PROMPTS, Services, make_engines, run_async
from tests.services.test_bad_input import GREEDY, draft_exchange, expect_status
from tests.services.test_sampling_e2e import PROMPT, assert_distributed_as, exact_first_two

pytestmark = pytest.mark.services

ADAPTER_STD = 0.03  # the layer-skip draft then agrees on a few tokens: blocks are both accepted and rejected
CONCURRENT = 8  # sessions in flight at once, as under load; each has its own seeded generators
LS, Q, NG, CH = DrafterKind.LAYERSKIP, DrafterKind.QUANTIZED, DrafterKind.NGRAM, DrafterKind.CHAIN


@pytest.fixture(scope="module")
def self_draft_services(background_loop, tiny_target_dir):
    target, _ = make_engines(str(tiny_target_dir), None)
    model = models.load_model(models.ModelSpec(str(tiny_target_dir)))
    # A random exit adapter after the first layer: a layer-skip draft that is often wrong (rejections), run
    # through the adapter's path.
    torch.manual_seed(5)
    adapter = self_draft.ExitAdapter(model.config.hidden_size)
    torch.nn.init.normal_(adapter.proj.weight, std=ADAPTER_STD)
    derived = {
        LS: self_draft.layerskip_view(model, 1, adapter),
        Q: self_draft.quantized_view(model, self_draft.QuantizeMode.INT8),
    }
    fingerprint = models.vocab_fingerprint(models.load_tokenizer(str(tiny_target_dir)))
    draft = DraftEngine(
        model, model_id=str(tiny_target_dir), vocab_fingerprint=fingerprint, limits=SessionLimits(), derived=derived
    )
    services = Services(background_loop, target, draft)
    yield services
    services.stop()


async def run_greedy(services, tokenizer, prompts_ids, k, drafter, chain, adaptive=False, overlap=False,
                     max_new_tokens=24):
    config = OrchestratorConfig(services.target_address, services.draft_address, tokenizer=tokenizer)
    orch = await Orchestrator.connect(config)
    outputs, drafted, accepted = [], 0, 0
    try:
        for ids in prompts_ids:
            request = GenerationRequest(
                "", False, max_new_tokens, SamplingParams(), (), k, drafter, False, adaptive, chain, overlap
            )
            out: list[int] = []
            async for event in orch.generate(request, ids):
                out.extend(event.token_ids)
                if event.stats is not None:
                    drafted += event.stats.drafted_tokens
                    accepted += event.stats.accepted_tokens
            outputs.append(out)
    finally:
        await orch.close()
    return outputs, drafted, accepted


GREEDY_CASES = [
    pytest.param(LS, (), id="layerskip"),
    pytest.param(Q, (), id="quantized"),
    pytest.param(CH, (NG, LS), id="chain-ngram-layerskip"),
    pytest.param(CH, (), id="chain-default"),
]


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("drafter,chain", GREEDY_CASES)
def test_greedy_equals_generate(self_draft_services, tiny_target_dir, tiny_reference, drafter, chain, k):
    prompts_ids, expected = tiny_reference
    got, drafted, accepted = run_async(
        run_greedy(self_draft_services, str(tiny_target_dir), prompts_ids, k, drafter, chain)
    )
    for prompt, want, have in zip(TINY_PROMPTS, expected, got):
        assert have == want, f"k={k} {drafter.name} {chain} diverged on {prompt!r}"
    assert drafted > 0 and accepted > 0
    assert self_draft_services.draft_engine.sessions.stats()[0] == 0


@pytest.mark.parametrize("adaptive", [False, True])
def test_greedy_k8_is_exact_and_hits_both_paths(self_draft_services, tiny_target_dir, tiny_reference, adaptive):
    """Layer-skip over 1 of 2 random layers: some blocks are cut short, and output is still exact."""
    prompts_ids, expected = tiny_reference
    got, drafted, accepted = run_async(
        run_greedy(self_draft_services, str(tiny_target_dir), prompts_ids, 8, LS, (), adaptive=adaptive)
    )
    assert got == expected
    if not adaptive:
        assert 0 < accepted < drafted


def test_info_lists_every_drafter(self_draft_services):
    info = run_async(_info(self_draft_services.draft_address))
    # Built in: served with --model and both self-draft flags (EAGLE needs --eagle-head: test_eagle_e2e.py; MEDUSA
    # --medusa-head: test_medusa_e2e.py).
    heads = (DrafterKind.EAGLE, DrafterKind.MEDUSA)
    assert sorted(info.drafters) == sorted(k.value for k in DRAFTERS if k not in heads)


async def _info(address):
    from specsplit.v1 import specsplit_pb2_grpc as pb_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        return await pb_grpc.DraftServiceStub(channel).Info(pb.InfoRequest())


async def sample_many(services, target_dir, runs, k, drafter, chain, draft_probs, sampling, max_new, seed0=0,
                      sampling_mode=None):
    # A draft block is never late here: outside COUPLED a late block changes a seed's tokens (docs/protocol.md#seeds),
    # and the reproducibility tests compare seeds across runs whose timing differs.
    config = OrchestratorConfig(services.target_address, services.draft_address, tokenizer=str(target_dir),
                                link_policy=LinkPolicy(draft_deadline_s=LinkPolicy().draft_timeout_s))
    orch = await Orchestrator.connect(config)
    limit = asyncio.Semaphore(CONCURRENT)

    async def one(seed: int) -> tuple[int, ...]:
        params = SamplingParams(sampling.temperature, sampling.top_k, sampling.top_p, seed)
        request = GenerationRequest("", False, max_new, params, (), k, drafter, draft_probs, False, chain,
                                    sampling_mode=sampling_mode or (
                                        VerificationMode.DRAFT_PROBS if draft_probs else VerificationMode.TOKEN_ONLY))
        async with limit:
            return tuple([t async for event in orch.generate(request, PROMPT) for t in event.token_ids])

    try:
        return list(await asyncio.gather(*(one(seed0 + i) for i in range(runs))))
    finally:
        await orch.close()


# One case per verification mode runs by default (each χ² run is among the slow tests); the quantized
# drafter shares the layer-skip drafter's code path (ModelDrafter over a derived view) and runs as "slow".
SAMPLING_CASES = [
    pytest.param(LS, (), True, id="layerskip-draft-probs"),
    pytest.param(CH, (NG, LS), False, id="chain-token-only"),
    pytest.param(Q, (), True, id="quantized-draft-probs", marks=pytest.mark.slow),
    pytest.param(Q, (), False, id="quantized-token-only", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("drafter,chain,draft_probs", SAMPLING_CASES)
def test_output_distribution_is_the_targets(self_draft_services, tiny_target_dir, drafter, chain, draft_probs):
    sampling = SamplingParams(temperature=4.0, top_k=3)
    exact = exact_first_two(tiny_target_dir, sampling)
    runs = 500  # ~55 expected per cell on average over the 9 (t1, t2) pairs
    samples = run_async(
        sample_many(self_draft_services, tiny_target_dir, runs, 2, drafter, chain, draft_probs, sampling, 2)
    )
    assert_distributed_as(samples, exact)


@pytest.mark.parametrize("drafter,chain,draft_probs", SAMPLING_CASES)
def test_seeded_sampling_is_reproducible(self_draft_services, tiny_target_dir, drafter, chain, draft_probs):
    sampling = SamplingParams(temperature=1.5, top_k=50, top_p=0.95)
    args = (self_draft_services, tiny_target_dir, 3, 4, drafter, chain, draft_probs, sampling, 8)
    first, again = run_async(sample_many(*args)), run_async(sample_many(*args))
    other = run_async(sample_many(*args, seed0=100))
    assert first == again and first != other


def draft_open(drafter, chain=(), return_probs=False, sampling=GREEDY):
    return pb.DraftRequest(
        open=pb.DraftOpen(
            session_id="bad", tokens=[1, 2, 3], sampling=sampling, drafter=drafter, chain=list(chain),
            return_probs=return_probs,
        )
    )


T1 = pb.SamplingParams(temperature=1.0)
BAD_OPENS = {
    "chain without members": (draft_open(CH.value), grpc.StatusCode.INVALID_ARGUMENT, ["needs a chain"]),
    "chain inside a chain": (draft_open(CH.value, [NG.value, CH.value]), grpc.StatusCode.INVALID_ARGUMENT, ["cannot contain CHAIN"]),
    "repeated member": (draft_open(CH.value, [NG.value, NG.value]), grpc.StatusCode.INVALID_ARGUMENT, ["repeats"]),
    "unknown member": (draft_open(CH.value, [NG.value, 42]), grpc.StatusCode.INVALID_ARGUMENT, ["42 is not a drafter kind"]),
    "chain on a plain drafter": (draft_open(LS.value, [NG.value]), grpc.StatusCode.INVALID_ARGUMENT, ["only for the CHAIN"]),
    "probs from a chain": (
        draft_open(CH.value, [NG.value, LS.value], True, T1), grpc.StatusCode.INVALID_ARGUMENT, ["token-only"],
    ),
}


@pytest.mark.parametrize("case", list(BAD_OPENS))
def test_bad_chain_is_refused(self_draft_services, case):
    message, code, fragments = BAD_OPENS[case]
    expect_status(draft_exchange(self_draft_services.draft_address, [message]), code, *fragments)


def test_self_drafter_not_served_is_a_failed_precondition(tiny_services):
    """The plain tiny services run no self-drafter: asking for one (alone or in a chain) names the flag."""
    expect_status(
        draft_exchange(tiny_services.draft_address, [draft_open(LS.value)]),
        grpc.StatusCode.FAILED_PRECONDITION, "LAYERSKIP is not available", "--layerskip-layers",
    )
    expect_status(
        draft_exchange(tiny_services.draft_address, [draft_open(CH.value, [NG.value, Q.value])]),
        grpc.StatusCode.FAILED_PRECONDITION, "QUANTIZED is not available", "--quantize int8",
    )


def test_public_request_chain_is_validated(self_draft_services, tiny_target_dir):
    from specsplit.lmkit import errors
    from specsplit.orchestrator.api.requests import parse_request

    async def go():
        config = OrchestratorConfig(
            self_draft_services.target_address, self_draft_services.draft_address, str(tiny_target_dir)
        )
        orch = await Orchestrator.connect(config)
        try:
            async def parse(**fields):
                return await parse_request(pb.GenerateRequest(prompt="a b a b", max_new_tokens=8, k=4, **fields), orch)

            for fields, fragment in [
                (dict(drafter=NG.value, chain=[NG.value]), "only for the CHAIN"),
                (dict(drafter=CH.value, chain=[CH.value]), "distinct member"),
                (dict(drafter=CH.value, chain=[LS.value, LS.value]), "distinct member"),
                (dict(drafter=NG.value, draft_probs=True, sampling=T1), "draft_probs needs"),
            ]:
                with pytest.raises(errors.InvalidArgument, match=fragment):
                    await parse(**fields)
            request, ids = await parse(drafter=CH.value, chain=[NG.value, Q.value])
            assert request.chain == (NG, Q)
            assert (await parse(drafter=LS.value, draft_probs=True, sampling=T1))[0].draft_probs
            new = [t for event in [e async for e in orch.generate(request, ids)] for t in event.token_ids]
            assert len(new) == 8
        finally:
            await orch.close()

    run_async(go())


@pytest.mark.parametrize(
    "flags,fragment",
    [
        (["--layerskip-layers", "2"], "derive from --model"),
        (["--quantize", "int4"], "invalid choice"),
    ],
)
def test_serve_draft_refuses_bad_self_draft_flags(flags, fragment):
    result = subprocess.run(
        [sys.executable, "-m", "specsplit.cli", "serve-draft", "--port", "0", *flags],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2
    assert fragment in result.stderr and "Traceback" not in result.stderr
