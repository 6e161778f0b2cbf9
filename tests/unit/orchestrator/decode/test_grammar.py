"""A generation's grammar state over its blocks (xgrammar on the SmolLM2 tokenizer): refused tokens cut,
forced tokens appended, one mask per verified position, the matcher left where it was."""

from __future__ import annotations

import json

import pytest

from specsplit.lmkit import token_mask
from specsplit.orchestrator.decode.grammar import GrammarError, GrammarKind, Grammars, GrammarSpec, choice_ebnf

pytestmark = pytest.mark.unit

VOCAB = 49152
EOS = 2
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "colour": {"enum": ["red", "green"]}},
    "required": ["name", "colour"],
}
TEXT = '{"name": "Bob", "colour": "red"}'
SCHEMA_SPEC = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(SCHEMA))


@pytest.fixture(scope="module")
def grammars(gguf_tokenizer) -> Grammars:
    return Grammars(gguf_tokenizer, VOCAB, [EOS])


def constraint(grammars, spec=SCHEMA_SPEC, jump_forward=True):
    return grammars.constraint(grammars.compile(spec), max_block=32, jump_forward=jump_forward)


def allowed_rows(fitted):
    return token_mask.unpack(fitted.bits, len(fitted.tokens) + 1, VOCAB)  # [rows, vocab]


def test_a_valid_chain_is_kept_with_a_mask_per_position(grammars, gguf_tokenizer):
    ids = gguf_tokenizer.encode(TEXT)
    c = constraint(grammars)
    fitted = c.fit([*ids, EOS, 17, 18], [], room=30)
    assert fitted.tokens == [*ids, EOS]  # nothing after the end-of-sequence token
    rows = allowed_rows(fitted)
    assert all(rows[i, token] for i, token in enumerate(fitted.tokens))
    assert rows[-1].all()  # past the end: nothing is kept, anything goes
    assert not rows[0, gguf_tokenizer.encode("hello")[0]]
    assert c.fit([], [], room=0).tokens == []  # the matcher ended where it began
    c.advance([*ids, EOS])
    assert c.terminated


def test_a_chain_is_cut_at_the_first_refused_token_and_forced_tokens_follow(grammars, gguf_tokenizer):
    ids = gguf_tokenizer.encode(TEXT)
    c = constraint(grammars)
    c.advance(ids[:5])  # {"name": "Bob
    fitted = c.fit([ids[5], 999, 1000], [], room=8)
    assert fitted.tokens[0] == ids[5] and 999 not in fitted.tokens
    assert fitted.forced == len(fitted.tokens) - 1 > 0
    assert gguf_tokenizer.decode(fitted.tokens).startswith('", "colour":')
    assert constraint(grammars, jump_forward=False).fit([], [], room=8).tokens == []


def test_room_bounds_the_block_forced_tokens_included(grammars):
    assert len(constraint(grammars).fit([], [], room=2).tokens) == 2


def test_a_tree_loses_refused_nodes_with_their_subtrees(grammars, gguf_tokenizer):
    ids = gguf_tokenizer.encode(TEXT)
    c = constraint(grammars)
    c.advance(ids[:3])
    # node 0 valid, node 1 refused with its child 3, node 2 valid under node 0
    fitted = c.fit([ids[3], 999, ids[4], 5], [-1, -1, 0, 1], room=8)
    assert fitted.tokens == [ids[3], ids[4]] and fitted.parents == []  # what is left is a chain
    rows = allowed_rows(fitted)
    assert rows[0, ids[3]] and rows[1, ids[4]]


def test_choices_are_escaped_exactly(grammars, gguf_tokenizer):
    choices = ['say "hi"', "back\\slash", "ünï €"]
    assert choice_ebnf(choices).startswith('root ::= "say \\"hi\\"" | ')
    for choice in choices:
        c = constraint(grammars, GrammarSpec(GrammarKind.CHOICE, choices=tuple(choices)))
        c.advance([*gguf_tokenizer.encode(choice), EOS])
        assert c.terminated


@pytest.mark.parametrize(
    "spec, reason",
    [
        (GrammarSpec(GrammarKind.JSON_SCHEMA, '{"type": "objec"}'), 'Unsupported type "objec"'),
        (GrammarSpec(GrammarKind.REGEX, "a(b"), "The parenthesis is not closed."),
        (GrammarSpec(GrammarKind.EBNF, "root ::= missing"), "missing"),
    ],
)
def test_a_grammar_that_does_not_compile_says_why_without_xgrammars_log_prefix(grammars, spec, reason):
    with pytest.raises(GrammarError) as refused:
        grammars.compile(spec)
    assert reason in str(refused.value)
    assert not str(refused.value).startswith("[") and ".cc:" not in str(refused.value)
