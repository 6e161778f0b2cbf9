"""``specsplit bench --suite structured``: its flags, its figures' arithmetic, and schemas xgrammar compiles."""

from __future__ import annotations

import argparse
import json

import pytest

from specsplit.bench import structured
from specsplit.bench.speculative import build_parser
from specsplit.orchestrator.decode.grammar import GrammarKind, Grammars, GrammarSpec

pytestmark = pytest.mark.unit


def args(*extra: str):
    return build_parser(argparse.ArgumentParser()).parse_args(["--json", "x.json", "--suite", "structured", *extra])


def run_of(wall_s: float, tokens: int, forced: int) -> dict:
    return {
        "text": "{}",
        "ids": list(range(tokens)),
        "wall_s": wall_s,
        "rounds": tokens // 2,
        "drafted": forced + 2,
        "accepted": forced,
        "forced": forced,
        "finish": "EOS",
    }


def test_the_report_reads_the_speedup_over_all_prompts():
    rows = [
        {
            "name": "a",
            "repeat": 0,
            "target_only": run_of(4.0, 40, 0),
            "speculative": run_of(2.0, 40, 15),
            "identical": True,
            "valid": True,
        },
        {
            "name": "b",
            "repeat": 0,
            "target_only": run_of(2.0, 20, 0),
            "speculative": run_of(2.0, 20, 5),
            "identical": True,
            "valid": False,
        },
    ]
    out = structured.report(args(), rows)
    assert out["speedup"] == 1.5 and out["new_tokens"] == 60
    assert out["forced_tokens"] == 20 and out["mean_committed_per_round"] == 2.0
    assert out["identical_to_target_only"] == 2 and out["valid"] == 1


def test_a_prompt_count_out_of_range_is_refused():
    with pytest.raises(ValueError, match=r"--structured-prompts must be in \[1, 6\]"):
        structured.run(args("--structured-prompts", "0"))


def test_every_extraction_schema_compiles(gguf_tokenizer):
    grammars = Grammars(gguf_tokenizer, 49152, [2])
    for extraction in structured.EXTRACTIONS:
        grammars.compile(GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(extraction.schema)))
