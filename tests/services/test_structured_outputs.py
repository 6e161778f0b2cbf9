"""Structured outputs through the real services (tiny random models): the grammar holds at every token, and
greedy output equals the constrained non-speculative run, token for token.

References: target-only decoding (k = 0) through the same services, and a plain transformers loop that
applies the same xgrammar mask to the tiny target's logits at every step. Speculation (n-gram and model
drafts, forced tokens, overlap, trees) must reproduce them exactly; with the draft down the mask still holds;
a grammar xgrammar cannot compile is refused with INVALID_ARGUMENT saying why.
"""

from __future__ import annotations

import json

import grpc
import pytest

from specsplit.lmkit import models
from specsplit.orchestrator.api.config import OrchestratorConfig
from specsplit.orchestrator.api.generation import Orchestrator
from specsplit.orchestrator.api.server import start_server
from specsplit.v1 import specsplit_pb2 as pb
from specsplit.v1 import specsplit_pb2_grpc as pb_grpc
from tests.conftest import TINY_PROMPTS, run_async
from tests.services.masked_reference import masked_greedy

pytestmark = pytest.mark.services

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "colour": {"enum": ["red", "green", "blue"]},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2},
    },
    "required": ["name", "colour", "age", "tags"],
}
GRAMMARS = {
    "json_schema": pb.Grammar(json_schema=json.dumps(SCHEMA)),
    "json_object": pb.Grammar(json_object=True),
    "regex": pb.Grammar(regex=r"(yes|no), [a-z]{2,8} [0-9]{1,3}\."),
    "choice": pb.Grammar(choice=pb.GrammarChoices(choices=["alpha", "beta gamma", 'delta "quoted"'])),
    "ebnf": pb.Grammar(ebnf='root ::= "[" item ("," item)* "]"\nitem ::= [0-9]+'),
}
MAX_NEW = 40


def _served(tiny_services, tiny_target_dir, background_loop):
    """An orchestrator over the tiny services and its gRPC server: yields (address, orchestrator)."""
    config = OrchestratorConfig(tiny_services.target_address, tiny_services.draft_address, str(tiny_target_dir))
    orch = background_loop.run(Orchestrator.connect(config))
    server, port = background_loop.run(start_server(orch))
    yield f"127.0.0.1:{port}", orch
    background_loop.run(server.stop(0))
    background_loop.run(orch.close())


@pytest.fixture(scope="module")
def api(tiny_services, tiny_target_dir, background_loop):
    yield from _served(tiny_services, tiny_target_dir, background_loop)


async def _generate(address: str, request: pb.GenerateRequest) -> tuple[list[int], pb.GenerateResponse]:
    async with grpc.aio.insecure_channel(address) as channel:
        responses = [r async for r in pb_grpc.GeneratorStub(channel).Generate(request)]
    return [t for r in responses for t in r.token_ids], responses[-1]


def generate(address: str, prompt: str, grammar: pb.Grammar, **options) -> tuple[list[int], pb.GenerateResponse]:
    request = pb.GenerateRequest(prompt=prompt, max_new_tokens=MAX_NEW, return_token_ids=True, **options)
    request.grammar.CopyFrom(grammar)
    return run_async(_generate(address, request))


@pytest.fixture(scope="module")
def masked_reference(tiny_target_dir, api):
    """The tiny target's greedy continuation under the grammar's mask, by a plain transformers loop."""
    _, orch = api
    model = models.load_model(models.ModelSpec(str(tiny_target_dir)))

    def greedy(prompt_ids: list[int], grammar: pb.Grammar) -> list[int]:
        from specsplit.orchestrator.api.requests import grammar_spec

        return masked_greedy(model, orch.compile_grammar(grammar_spec(grammar)), prompt_ids, MAX_NEW)

    return greedy


def _follows(orch, grammar: pb.Grammar, tokens: list[int]) -> bool:
    """Every token is one the grammar allows after the ones before it (a prefix when the budget ran out)."""
    import xgrammar

    from specsplit.orchestrator.api.requests import grammar_spec

    matcher = xgrammar.GrammarMatcher(orch.compile_grammar(grammar_spec(grammar)))
    return all(matcher.accept_token(t) for t in tokens)


@pytest.mark.parametrize("kind", list(GRAMMARS))
def test_greedy_equals_the_masked_reference_loop(api, masked_reference, kind):
    address, orch = api
    for prompt in TINY_PROMPTS[:3]:
        prompt_ids = orch.encode(prompt, chat=False)
        expected = masked_reference(prompt_ids, GRAMMARS[kind])
        target_only, _ = generate(address, prompt, GRAMMARS[kind], k=0)
        speculative, last = generate(address, prompt, GRAMMARS[kind], k=6, drafter=pb.DRAFTER_KIND_NGRAM)
        assert target_only == expected, (kind, prompt)
        assert speculative == expected, (kind, prompt)
        assert _follows(orch, GRAMMARS[kind], speculative)
        if len(expected) < MAX_NEW:  # the grammar completed: the generation ended on its end-of-sequence token
            assert last.finish_reason == pb.FINISH_REASON_EOS


@pytest.mark.parametrize(
    "drafter,branches", [(pb.DRAFTER_KIND_MODEL, 1), (pb.DRAFTER_KIND_MODEL, 3), (pb.DRAFTER_KIND_NGRAM, 1)]
)
def test_every_drafter_and_tree_gives_the_target_only_tokens(api, drafter, branches):
    address, _ = api
    for kind in ("json_schema", "regex", "ebnf"):
        for prompt in TINY_PROMPTS[3:6]:
            expected, _ = generate(address, prompt, GRAMMARS[kind], k=0)
            got, last = generate(
                address, prompt, GRAMMARS[kind], k=5, drafter=drafter, tree_branches=branches, overlap=True
            )
            assert got == expected, (kind, prompt, drafter, branches)


# Grammars loose enough that the model drafter's second choices survive the mask, so its rounds can stay trees
# (under a JSON schema's a runner-up is nearly always refused and pruned, leaving a chain).
LOOSE = {"line": pb.Grammar(regex=r"[^\n]{1,80}"), "words": pb.Grammar(regex=r"[a-z ,.']{1,60}")}


@pytest.fixture
def fresh_api(tiny_services, tiny_target_dir, background_loop):
    """An orchestrator of its own: no figures measured by the tests before (the round model keeps a tree's
    second choices only while their measured acceptance pays for them)."""
    yield from _served(tiny_services, tiny_target_dir, background_loop)


def test_trees_under_a_grammar_give_the_target_only_tokens_and_are_trees(fresh_api):
    """The target masks every node of a tree (each node's row is the grammar's after its own path): the text is
    the target-only text and follows the grammar, and rounds were trees. With adaptive_k off each drafted tree is
    verified whole (the round model's cut turns on measured costs, which a loaded run makes unreliable)."""
    address, orch = fresh_api
    trees = 0
    for kind, grammar in LOOSE.items():
        for prompt in TINY_PROMPTS[:3]:
            expected, _ = generate(address, prompt, grammar, k=0)
            for _ in range(2):
                got, last = generate(address, prompt, grammar, k=5, drafter=pb.DRAFTER_KIND_MODEL, tree_branches=3,
                                     adaptive_k=False)
                assert got == expected, (kind, prompt)
                assert _follows(orch, grammar, got)
                trees += last.stats.tree_rounds
    assert trees > 0


def test_coupled_sampling_under_a_grammar_gives_the_seeds_k_0_text(api):
    """COUPLED verification: a seed gives the same text whatever K and drafter, the grammar's masks included."""
    address, _ = api
    for kind in ("json_schema", "regex", "choice"):
        for seed in (1, 2):
            options = dict(sampling=pb.SamplingParams(temperature=1.0, seed=seed), mode=pb.VERIFICATION_MODE_COUPLED)
            expected, _ = generate(address, TINY_PROMPTS[seed], GRAMMARS[kind], k=0, **options)
            for drafter in (pb.DRAFTER_KIND_MODEL, pb.DRAFTER_KIND_NGRAM):
                got, last = generate(address, TINY_PROMPTS[seed], GRAMMARS[kind], k=5, drafter=drafter, **options)
                assert got == expected, (kind, seed, drafter)


def test_forced_tokens_are_drafted_for_free(api):
    """A schema's keys and punctuation are forced: they reach the target as drafts even with no drafter match."""
    address, _ = api
    _, last = generate(address, TINY_PROMPTS[0], GRAMMARS["json_schema"], k=6, drafter=pb.DRAFTER_KIND_NGRAM)
    assert last.stats.forced_tokens > 0
    assert last.stats.accepted_tokens >= last.stats.forced_tokens // 2


def test_sampled_output_follows_the_grammar(api):
    address, orch = api
    for kind, grammar in GRAMMARS.items():
        for seed in range(3):
            sampling = pb.SamplingParams(temperature=1.0, seed=seed)
            for mode in (pb.VERIFICATION_MODE_COUPLED, pb.VERIFICATION_MODE_TOKEN_ONLY):
                tokens, _ = generate(
                    address,
                    TINY_PROMPTS[seed],
                    grammar,
                    k=5,
                    drafter=pb.DRAFTER_KIND_MODEL,
                    sampling=sampling,
                    mode=mode,
                )
                assert tokens and _follows(orch, grammar, tokens), (kind, seed, mode)


def test_the_mask_holds_with_the_draft_down(tiny_services, tiny_target_dir, background_loop, api):
    """A draft that dies before the generation: every round is target-only, still under the grammar."""
    from specsplit.draft_service.server import start_server as start_draft

    _, reference_orch = api
    draft_server, port = background_loop.run(start_draft(tiny_services.draft_engine))
    config = OrchestratorConfig(tiny_services.target_address, f"127.0.0.1:{port}", str(tiny_target_dir))
    orch = background_loop.run(Orchestrator.connect(config))
    server, api_port = background_loop.run(start_server(orch))
    try:
        background_loop.run(draft_server.stop(0))
        address = f"127.0.0.1:{api_port}"
        for kind in ("json_schema", "choice"):
            expected, _ = generate(api[0], TINY_PROMPTS[1], GRAMMARS[kind], k=0)
            tokens, last = generate(address, TINY_PROMPTS[1], GRAMMARS[kind], k=4, drafter=pb.DRAFTER_KIND_MODEL)
            assert last.stats.draft_fallback_rounds > 0
            assert tokens == expected
            assert _follows(reference_orch, GRAMMARS[kind], tokens)
    finally:
        background_loop.run(server.stop(0))
        background_loop.run(orch.close())


@pytest.mark.parametrize(
    "grammar,says",
    [
        (pb.Grammar(json_schema='{"type": "objec"}'), 'Unsupported type "objec"'),
        (pb.Grammar(json_schema="not json"), "Failed to parse JSON"),
        (pb.Grammar(regex="a(b"), "parenthesis is not closed"),
        (pb.Grammar(ebnf='root ::= "a" |'), "EBNF parser error"),
        (pb.Grammar(choice=pb.GrammarChoices()), "at least one choice"),
        (pb.Grammar(), "names none"),
    ],
)
def test_a_grammar_that_does_not_compile_is_refused(api, grammar, says):
    address, _ = api
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        generate(address, TINY_PROMPTS[0], grammar)
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert says in refused.value.details()


def test_draft_probs_with_a_grammar_is_refused(api):
    address, _ = api
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        generate(
            address,
            TINY_PROMPTS[0],
            GRAMMARS["regex"],
            k=4,
            drafter=pb.DRAFTER_KIND_MODEL,
            draft_probs=True,
            sampling=pb.SamplingParams(temperature=1.0),
        )
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "draft_probs" in refused.value.details()


@pytest.mark.parametrize("sampling", [pb.SamplingParams(ignore_eos=True), pb.SamplingParams(min_tokens=4)])
def test_a_grammar_with_the_end_of_text_banned_is_refused(api, sampling):
    """A complete grammar allows only the end of text; banning it would leave a position with no token."""
    address, _ = api
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        generate(address, TINY_PROMPTS[0], GRAMMARS["regex"], sampling=sampling)
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "ignore_eos and min_tokens" in refused.value.details()


def test_a_grammar_compiles_off_the_loop_within_its_bound_and_counts_toward_the_size_limit(
    tiny_services, tiny_target_dir
):
    """--grammar-timeout-s refuses a grammar still compiling (INVALID_ARGUMENT naming the flag), a grammar's text
    counts toward the request's byte limit, and within both a grammar request parses."""
    from specsplit.lmkit import errors
    from specsplit.orchestrator.api.requests import parse_request

    schema = pb.Grammar(json_schema=json.dumps(SCHEMA))  # ~300 bytes of text
    request = pb.GenerateRequest(prompt="Describe a person.", chat=False, max_new_tokens=8, grammar=schema)

    async def parse(**config):
        orch = await Orchestrator.connect(OrchestratorConfig(
            tiny_services.target_address, tiny_services.draft_address, str(tiny_target_dir), **config))
        try:
            return await parse_request(request, orch)
        finally:
            await orch.close()

    parsed, prompt_ids = run_async(parse())
    assert parsed.grammar is not None and prompt_ids
    with pytest.raises(errors.InvalidArgument, match=r"took over 1e-06 s to compile \(--grammar-timeout-s\); simplify it"):
        run_async(parse(grammar_timeout_s=1e-6))
    size = len(request.prompt) + len(schema.json_schema)
    with pytest.raises(errors.InvalidArgument, match=f"the prompt is (at least )?{size} bytes \\(with its tools and grammar\\)"):
        run_async(parse(max_prompt_bytes=size - 1))
    assert run_async(parse(max_prompt_bytes=size))[0].grammar is not None
