"""``specsplit bench --suite structured``: JSON-schema extraction, constrained target-only against n-gram drafts
plus the tokens the grammar forces, prompt by prompt in one run.

    specsplit bench --suite structured --json bench/results/structured.json --target-cpus 1 --draft-cpus 0 \\
        [--structured-prompts 6] [--repeats 1]

One target and one n-gram draft service stay up; two orchestrators share them:
target-only (k = 0: every token one forward under the grammar's mask) and
speculative (n-gram drafts, which copy the values from the text being
extracted, plus forced tokens: the schema's keys, quotes and separators).
For each prompt target-only runs first, then speculative, so a shared
machine's drift touches both alike. Greedy; every output is checked to parse,
to validate against its schema, and to equal target-only's.
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import dataclass

import jsonschema
import torch

from specsplit.bench import runs
from specsplit.bench.evaluation import generate_to_end
from specsplit.lmkit import event_loop
from specsplit.lmkit.kinds import DrafterKind
from specsplit.lmkit.processes import local_services
from specsplit.lmkit.sampling import SamplingParams
from specsplit.orchestrator.api.config import OrchestratorConfig
from specsplit.orchestrator.api.generation import GenerationRequest, Orchestrator
from specsplit.orchestrator.decode.grammar import GrammarKind, GrammarSpec


def _object(properties: dict) -> dict:
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


TEXT = {"type": "string", "maxLength": 40}
PERSON = _object({"name": TEXT, "age": {"type": "integer", "minimum": 0, "maximum": 150}, "city": TEXT, "email": TEXT})
INVOICE = _object(
    {"invoice_number": TEXT, "customer": TEXT, "total": {"type": "number"}, "currency": TEXT, "due_date": TEXT}
)
EVENT = _object(
    {"title": TEXT, "date": TEXT, "location": TEXT, "speakers": {"type": "array", "items": TEXT, "maxItems": 3}}
)
PRODUCT = _object(
    {
        "product_name": TEXT,
        "brand": TEXT,
        "price": {"type": "number"},
        "in_stock": {"type": "boolean"},
        "colors": {"type": "array", "items": TEXT, "maxItems": 4},
    }
)


@dataclass(frozen=True)
class Extraction:
    name: str
    schema: dict
    text: str

    @property
    def prompt(self) -> str:
        return f"Extract the fields as JSON.\n\nText: {self.text}"


EXTRACTIONS = (
    Extraction("person", PERSON, "Maria Lopez, 34, lives in Madrid and can be reached at maria.lopez@example.com."),
    Extraction(
        "invoice", INVOICE, "Invoice INV-2024-0193 for Northwind Traders totals 1249.50 EUR, due on 2024-07-15."
    ),
    Extraction(
        "event",
        EVENT,
        "PyCon Lisbon 2025 takes place on 2025-05-14 at the Lisbon Congress Centre, with "
        "talks by Ana Silva and John Park.",
    ),
    Extraction(
        "product",
        PRODUCT,
        "The Acme Trailblazer backpack costs 89.99, is in stock, and comes in black, olive and navy.",
    ),
    Extraction("person-2", PERSON, "Contact: Tom Becker (age 71), Leeds, tom.becker@example.org."),
    Extraction(
        "invoice-2", INVOICE, "Customer Blue Harbor Ltd owes 312.00 USD on invoice A-77-551, payable by 2025-01-31."
    ),
)


def add_flags(parser) -> None:
    parser.add_argument(
        "--structured-prompts",
        type=int,
        default=len(EXTRACTIONS),
        help=f"--suite structured: how many of the {len(EXTRACTIONS)} extraction prompts to run",
    )


async def _one(orch: Orchestrator, extraction: Extraction, k: int, max_new: int) -> dict:
    spec = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(extraction.schema))
    request = GenerationRequest(
        extraction.prompt,
        True,
        max_new,
        SamplingParams(),
        (),
        k,
        DrafterKind.NGRAM,
        False,
        adaptive_k=k > 0,
        overlap=k > 0,
        grammar=orch.compile_grammar(spec),
    )
    text, ids, event = await generate_to_end(orch, request, orch.encode(extraction.prompt, True))
    s = event.stats
    return {
        "text": text,
        "ids": ids,
        "wall_s": s.wall_s,
        "rounds": s.rounds,
        "drafted": s.drafted_tokens,
        "accepted": s.accepted_tokens,
        "forced": s.forced_tokens,
        "finish": event.finish.name,
    }


def _valid(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


async def _measure(args, target_address: str, draft_address: str) -> list[dict]:
    config = OrchestratorConfig(target_address=target_address, draft_address=draft_address, tokenizer=args.model)
    target_only, speculative = await Orchestrator.connect(config), await Orchestrator.connect(config)
    extractions = EXTRACTIONS[: args.structured_prompts]
    rows = []
    try:
        await _one(target_only, extractions[0], 0, 16)  # one-off allocations; seeds the cost model
        await _one(speculative, extractions[0], args.k, 16)
        for repeat in range(args.repeats):
            for extraction in extractions:
                base = await _one(target_only, extraction, 0, args.max_new_tokens)
                spec = await _one(speculative, extraction, args.k, args.max_new_tokens)
                rows.append(
                    {
                        "name": extraction.name,
                        "repeat": repeat,
                        "target_only": base,
                        "speculative": spec,
                        "identical": base["ids"] == spec["ids"],
                        "valid": _valid(base["text"], extraction.schema) and _valid(spec["text"], extraction.schema),
                    }
                )
                print(
                    f"{extraction.name}: {base['wall_s'] / spec['wall_s']:.2f}x  tokens {len(spec['ids'])}  "
                    f"forced {spec['forced']}  identical {rows[-1]['identical']}  valid {rows[-1]['valid']}",
                    flush=True,
                )
    finally:
        await target_only.close()
        await speculative.close()
    return rows


def report(args, rows: list[dict]) -> dict:
    tokens = sum(len(r["speculative"]["ids"]) for r in rows)
    base_s = sum(r["target_only"]["wall_s"] for r in rows)
    spec_s = sum(r["speculative"]["wall_s"] for r in rows)
    spec = [r["speculative"] for r in rows]
    return {
        "benchmark": "structured_outputs",
        "target": args.model,
        "drafter": "ngram + forced tokens",
        "decoding": "greedy",
        "grammar": "json_schema",
        "k": args.k,
        "adaptive_k": True,
        "overlap": True,
        "max_new_tokens": args.max_new_tokens,
        "prompts": len(rows),
        "new_tokens": tokens,
        "tokens_per_s_target_only": round(tokens / base_s, 3) if base_s else 0.0,
        "tokens_per_s_speculative": round(tokens / spec_s, 3) if spec_s else 0.0,
        "speedup": round(base_s / spec_s, 3) if spec_s else 0.0,
        "forced_tokens": sum(s["forced"] for s in spec),
        "drafted_tokens": sum(s["drafted"] for s in spec),
        "accepted_tokens": sum(s["accepted"] for s in spec),
        "mean_committed_per_round": round(tokens / sum(s["rounds"] for s in spec), 3),
        "identical_to_target_only": sum(r["identical"] for r in rows),
        "valid": sum(r["valid"] for r in rows),
        "target_threads": args.target_threads,
        "draft_threads": args.draft_threads,
        "target_cpus": args.target_cpus or "unpinned",
        "draft_cpus": args.draft_cpus or "unpinned",
        "per_prompt": [
            {
                "name": r["name"],
                "repeat": r["repeat"],
                "identical": r["identical"],
                "valid": r["valid"],
                "target_only_s": round(r["target_only"]["wall_s"], 4),
                "speculative_s": round(r["speculative"]["wall_s"], 4),
                **{key: r["speculative"][key] for key in ("rounds", "drafted", "accepted", "forced", "finish", "text")},
            }
            for r in rows
        ],
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
    }


def run(args) -> int:
    if not 1 <= args.structured_prompts <= len(EXTRACTIONS):
        raise ValueError(f"--structured-prompts must be in [1, {len(EXTRACTIONS)}], got {args.structured_prompts}")
    started = time.time()
    target_args, draft_args = runs.service_args(args)
    with local_services(target_args, draft_args) as (target, draft):
        rows = event_loop.run(_measure(args, target.address, draft.address))
    out = {**report(args, rows), "duration_s": round(time.time() - started, 1)}
    path = runs.write(out, args.json)
    print(
        f"structured: {out['speedup']:.2f}x ({out['tokens_per_s_target_only']:.1f} -> "
        f"{out['tokens_per_s_speculative']:.1f} tok/s), forced {out['forced_tokens']} of {out['drafted_tokens']} "
        f"drafted, identical {out['identical_to_target_only']}/{out['prompts']}, valid {out['valid']}/{out['prompts']}"
    )
    print(f"-> {path}")
    return 0 if out["identical_to_target_only"] == out["valid"] == out["prompts"] else 1
