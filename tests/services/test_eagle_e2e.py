"""The EAGLE drafter through the real services: greedy equality, lossless sampling, features on the wire, bad heads.

The draft service runs the tiny target's own checkpoint with an EAGLE-3 head written in the released layout
(``tests/eagle_heads.py``). The head reads the target's layer-0 features (the embedding of each position) and
copies them forward: row j predicts t_{j+2} = t_j, right where the tiny target's text cycles with period two
(it points at context tokens, and often settles into such a cycle), wrong elsewhere. Its draft vocabulary is
the tokens the target writes on the test prompts and the even ids.
"""

from __future__ import annotations

import subprocess
import sys

import grpc
import pytest
import torch

from specsplit.draft_service import eagle_head
from specsplit.draft_service.engine import DraftEngine
from specsplit.draft_service.ngram import NgramConfig
from specsplit.lmkit import errors, models
from specsplit.lmkit.kinds import DrafterKind, VerificationMode
from specsplit.lmkit.sampling import SamplingParams
from specsplit.lmkit.sessions import SessionLimits
from specsplit.orchestrator.api.config import OrchestratorConfig
from specsplit.orchestrator.api.generation import GenerationRequest, Orchestrator
from specsplit.v1 import specsplit_pb2 as pb
from tests.conftest import TINY_PROMPTS, Services, make_engines, run_async, save_tiny_llama
from tests.eagle_heads import write_eagle3_head
from tests.services.test_bad_input import GREEDY, draft_exchange, expect_status, target_exchange
from tests.services.test_drafters_e2e import run_greedy, sample_many
from tests.services.test_sampling_e2e import assert_distributed_as, exact_first_two

pytestmark = pytest.mark.services

EA, NG, CH = DrafterKind.EAGLE, DrafterKind.NGRAM, DrafterKind.CHAIN
EVEN_IDS = torch.arange(0, 49152, 2)


def copy_previous_token(state: dict) -> None:
    """fc passes the layer-0 features (the token embedding, the third feature block) through; the layer adds
    almost nothing; the LM head is the target's own embedding rows: the head predicts the token it was fed."""
    hidden = state["norm.weight"].numel()
    state["fc.weight"].zero_()
    state["fc.weight"][:, 2 * hidden :] = torch.eye(hidden)
    state["midlayer.self_attn.o_proj.weight"].mul_(0.01)
    state["midlayer.mlp.down_proj.weight"].mul_(0.01)


@pytest.fixture(scope="module")
def eagle_dir(tiny_target_dir, tiny_reference, tmp_path_factory):
    """The head's vocabulary is the tokens the target writes on the test prompts and the even ids (an EAGLE-3 head's
    is its target's most frequent output tokens): it drafts where the target's text cycles with period two."""
    model = models.load_model(models.ModelSpec(str(tiny_target_dir)))
    embedding = model.get_input_embeddings().weight.detach()
    written = torch.tensor(sorted({token for output in tiny_reference[1] for token in output}))
    draft_ids = torch.unique(torch.cat([EVEN_IDS, written]))

    def edit(state):
        copy_previous_token(state)
        state["lm_head.weight"] = embedding[draft_ids].clone()

    return write_eagle3_head(tmp_path_factory.mktemp("eagle-head"), model.config, draft_ids, seed=7, state_edit=edit)


def eagle_engine(model_dir, head_dir) -> DraftEngine:
    model = models.load_model(models.ModelSpec(str(model_dir)))
    head = eagle_head.load_head(str(head_dir), model)
    fingerprint = models.vocab_fingerprint(models.load_tokenizer(str(model_dir)))
    return DraftEngine(model, model_id=str(model_dir), vocab_fingerprint=fingerprint, limits=SessionLimits(),
                       derived={EA: head})


@pytest.fixture(scope="module")
def eagle_services(background_loop, tiny_target_dir, eagle_dir):
    target, _ = make_engines(str(tiny_target_dir), None)
    services = Services(background_loop, target, eagle_engine(tiny_target_dir, eagle_dir))
    yield services
    services.stop()


GREEDY_CASES = [
    pytest.param(EA, (), 1, False, False, id="eagle-k1"),
    pytest.param(EA, (), 4, False, False, id="eagle-k4"),
    pytest.param(EA, (), 4, True, True, id="eagle-adaptive-overlap"),
    pytest.param(CH, (NG, EA), 4, True, True, id="chain-ngram-eagle-overlap"),
]


@pytest.mark.parametrize("drafter,chain,k,adaptive,overlap", GREEDY_CASES)
def test_greedy_equals_the_targets_own(eagle_services, tiny_target_dir, tiny_reference, drafter, chain, k, adaptive,
                                       overlap):
    prompts_ids, expected = tiny_reference
    got, drafted, accepted = run_async(
        run_greedy(eagle_services, str(tiny_target_dir), prompts_ids, k, drafter, chain, adaptive, overlap)
    )
    for prompt, want, have in zip(TINY_PROMPTS, expected, got):
        assert have == want, f"{drafter.name} {chain} k={k} diverged on {prompt!r}"
    assert accepted > 0
    if not adaptive:
        assert accepted < drafted  # where the target's text does not cycle with period two, the head misses
    assert eagle_services.draft_engine.sessions.stats()[0] == 0


def test_features_travel_with_each_result_and_are_counted(eagle_services, tiny_target_dir, tiny_reference):
    async def go():
        config = OrchestratorConfig(eagle_services.target_address, eagle_services.draft_address, str(tiny_target_dir))
        orch = await Orchestrator.connect(config)
        try:
            ids = tiny_reference[0][0]
            request = GenerationRequest("", False, 16, SamplingParams(), (), 4, EA, False)
            return [e async for e in orch.generate(request, ids)][-1].stats, len(ids)
        finally:
            await orch.close()

    stats, prompt_len = run_async(go())
    width = 3 * 64  # three layers of the tiny target's hidden size
    # Every committed position but the last has had its features computed and sent once, in fp16.
    assert stats.feature_bytes == 2 * width * (prompt_len + stats.new_tokens - 1)
    assert stats.feature_bytes_per_round == pytest.approx(stats.feature_bytes / stats.rounds)
    assert stats.drafted_tokens > 0


def test_info_names_the_layers_and_width_the_head_reads(eagle_services):
    async def info():
        from specsplit.v1 import specsplit_pb2_grpc as pb_grpc

        async with grpc.aio.insecure_channel(eagle_services.draft_address) as channel:
            draft = await pb_grpc.DraftServiceStub(channel).Info(pb.InfoRequest())
        async with grpc.aio.insecure_channel(eagle_services.target_address) as channel:
            target = await pb_grpc.TargetServiceStub(channel).Info(pb.InfoRequest())
        return draft, target

    draft, target = run_async(info())
    eagle = {d.name: d for d in draft.drafter_info}["EAGLE"]
    assert eagle.kind == pb.DRAFTER_KIND_EAGLE == 6 and eagle.has_probs and eagle.needs_features
    assert list(eagle.feature_layers) == [2, 1, 0] and eagle.feature_width == 192
    assert (target.hidden_size, target.num_layers) == (64, 2)


SAMPLING_CASES = [
    pytest.param(EA, (), VerificationMode.DRAFT_PROBS, id="eagle-draft-probs"),
    pytest.param(EA, (), VerificationMode.TOKEN_ONLY, id="eagle-token-only"),
]


@pytest.mark.parametrize("drafter,chain,mode", SAMPLING_CASES)
def test_output_distribution_is_the_targets(eagle_services, tiny_target_dir, drafter, chain, mode):
    sampling = SamplingParams(temperature=4.0, top_k=3)
    exact = exact_first_two(tiny_target_dir, sampling)
    samples = run_async(
        sample_many(eagle_services, tiny_target_dir, 500, 2, drafter, chain, mode is VerificationMode.DRAFT_PROBS,
                    sampling, 2, sampling_mode=mode)
    )
    assert_distributed_as(samples, exact)


def test_coupled_tokens_are_the_target_only_tokens_of_the_seed(eagle_services, tiny_target_dir, tiny_reference):
    """COUPLED (the default for sampled requests): the EAGLE drafter proposes with the target's Gumbel noise, so
    every seed's tokens are exactly those of target-only decoding with that seed, and its drafts are accepted."""
    prompt = tiny_reference[0][0]

    async def go():
        config = OrchestratorConfig(eagle_services.target_address, eagle_services.draft_address, str(tiny_target_dir))
        orch = await Orchestrator.connect(config)
        try:
            runs = {}
            for seed in (3, 4, 5):
                for k, drafter in ((0, NG), (4, EA)):
                    sampling = SamplingParams(temperature=4.0, top_k=3, seed=seed)
                    request = GenerationRequest("", False, 24, sampling, (), k, drafter, False)
                    events = [e async for e in orch.generate(request, prompt)]
                    runs[seed, k] = [t for e in events for t in e.token_ids], events[-1].stats
            return runs
        finally:
            await orch.close()

    runs = run_async(go())
    accepted = 0
    for seed in (3, 4, 5):
        (alone, _), (eagle, stats) = runs[seed, 0], runs[seed, 4]
        assert stats.mode == VerificationMode.COUPLED.value and stats.drafter == EA.value
        assert eagle == alone, f"seed {seed}: EAGLE in COUPLED mode changed the tokens"
        accepted += stats.accepted_tokens
    assert len({tuple(runs[seed, 0][0]) for seed in (3, 4, 5)}) > 1  # the seed matters
    assert accepted > 0  # the head drafted with the target's noise and was accepted


def test_coupled_eagle_refuses_draft_probabilities(eagle_services):
    """COUPLED sends token ids only: a draft session that also asks for q is refused."""
    with pytest.raises(errors.InvalidArgument, match="COUPLED"):
        eagle_services.draft_engine.open(
            "coupled-probs", [1, 2, 3], SamplingParams(temperature=0.7, seed=1), EA, True, NgramConfig(),
            coupled=True, feature_width=192,
        )


def test_seeded_sampling_is_reproducible(eagle_services, tiny_target_dir):
    sampling = SamplingParams(temperature=1.5, top_k=50, top_p=0.95)
    args = (eagle_services, tiny_target_dir, 3, 4, EA, (), True, sampling, 8)
    first, again = run_async(sample_many(*args)), run_async(sample_many(*args))
    assert first == again and first != run_async(sample_many(*args, seed0=100))


# -- bad heads and bad feature traffic ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def narrow_target_services(background_loop, tmp_path_factory, gguf_tokenizer, tiny_target_dir, eagle_dir):
    """A target of hidden size 32 (same vocabulary) behind a draft whose head was trained for hidden size 64."""
    narrow = save_tiny_llama(tmp_path_factory.mktemp("narrow"), gguf_tokenizer, seed=3, layers=2, hidden=32)
    target, _ = make_engines(str(narrow), None)
    services = Services(background_loop, target, eagle_engine(tiny_target_dir, eagle_dir))
    yield services, narrow
    services.stop()


def test_a_head_for_another_target_is_refused_at_session_open(narrow_target_services):
    from specsplit.orchestrator.api.requests import parse_request

    services, narrow = narrow_target_services

    async def go():
        orch = await Orchestrator.connect(OrchestratorConfig(services.target_address, services.draft_address,
                                                             str(narrow)))
        try:
            with pytest.raises(errors.FailedPrecondition, match="reads 192 feature values .* hidden size 32"):
                await parse_request(pb.GenerateRequest(prompt="a b", max_new_tokens=4, k=4, drafter=EA.value), orch)
            with pytest.raises(errors.FailedPrecondition, match="trained for another target"):
                await parse_request(pb.GenerateRequest(prompt="a b", max_new_tokens=4, k=4, drafter=CH.value,
                                                 chain=[NG.value, EA.value]), orch)
            await parse_request(pb.GenerateRequest(prompt="a b", max_new_tokens=4, k=4, drafter=NG.value), orch)
        finally:
            await orch.close()

    run_async(go())


def draft_open(drafter, width=0, chain=()):
    return pb.DraftRequest(open=pb.DraftOpen(session_id="bad", tokens=[1, 2, 3], sampling=GREEDY, drafter=drafter,
                                             feature_width=width, chain=list(chain)))


def propose(position, tokens=(), k=2, features=None):
    msg = pb.ProposeRequest(position=position, tokens=list(tokens), k=k)
    if features is not None:
        msg.features.CopyFrom(features)
    return pb.DraftRequest(propose=msg)


def features(position, rows, width=192):
    return pb.HiddenFeatures(position=position, rows=rows, width=width, values=b"\x00" * (2 * rows * width))


BAD_DRAFT = {
    "no feature width": ([draft_open(EA.value)], grpc.StatusCode.INVALID_ARGUMENT, "set DraftOpen.feature_width"),
    "another target's width": ([draft_open(EA.value, 96)], grpc.StatusCode.FAILED_PRECONDITION, "reads 192"),
    "in a chain too": ([draft_open(CH.value, 96, [NG.value, EA.value])], grpc.StatusCode.FAILED_PRECONDITION,
                       "trained for another target"),
    "features past the context": ([draft_open(EA.value, 192), propose(3, features=features(0, 4))],
                                  grpc.StatusCode.FAILED_PRECONDITION, "past the committed context"),
    "features of another width": ([draft_open(EA.value, 192), propose(3, features=features(0, 2, 100))],
                                  grpc.StatusCode.INVALID_ARGUMENT, "expects 192 values per position"),
    "features for an n-gram session": ([draft_open(NG.value), propose(3, features=features(0, 2))],
                                       grpc.StatusCode.INVALID_ARGUMENT, "does not read them"),
    "truncated values": ([draft_open(EA.value, 192),
                          propose(3, features=pb.HiddenFeatures(position=0, rows=2, width=192, values=b"\x00" * 7))],
                         grpc.StatusCode.INVALID_ARGUMENT, "bytes of values"),
}


@pytest.mark.parametrize("case", list(BAD_DRAFT))
def test_bad_feature_traffic_to_the_draft_is_refused(eagle_services, case):
    messages, code, fragment = BAD_DRAFT[case]
    expect_status(draft_exchange(eagle_services.draft_address, messages), code, fragment)


def test_the_target_refuses_layers_it_does_not_have(eagle_services):
    opening = pb.TargetRequest(open=pb.TargetOpen(session_id="x", tokens=[1, 2], sampling=GREEDY,
                                                  mode=pb.VERIFICATION_MODE_GREEDY, feature_layers=[0, 5]))
    expect_status(target_exchange(eagle_services.target_address, [opening]), grpc.StatusCode.INVALID_ARGUMENT,
                  "outside [0, 2]")


def test_serve_draft_refuses_a_head_for_another_target_at_start(tiny_target_dir, tmp_path):
    model = models.load_model(models.ModelSpec(str(tiny_target_dir)))
    head = write_eagle3_head(tmp_path / "wide", model.config, torch.arange(100), hidden=128)
    result = subprocess.run(
        [sys.executable, "-m", "specsplit.cli", "serve-draft", "--port", "0", "--model", str(tiny_target_dir),
         "--eagle-head", str(head)], capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert "trained for another target" in result.stderr and "Traceback" not in result.stderr
