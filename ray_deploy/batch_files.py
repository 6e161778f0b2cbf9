"""The JSONL formats of ``specsplit batch``: prompts in, one result per finished prompt out.

Pure functions of text and bytes; the file handling is in ``specsplit.ray_deploy.batch_job``.

Input, one JSON object a line (blank lines are skipped)::

    {"id": "p1", "prompt": "Summarise: ...", "max_new_tokens": 64, "temperature": 0.8, "seed": 7}

Only ``prompt`` is required. A line without ``id`` gets ``line-<n>``, its 1-based
line number (stable while lines are only appended). Output, one JSON object per
finished prompt: ``id``, ``text``, ``finish_reason`` and the generation stats,
or ``id`` and ``error`` (``code``, ``details``) for a request the orchestrator
refused (INVALID_ARGUMENT and the like), which a re-run does not retry.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from specsplit.lmkit.kinds import DrafterKind
from specsplit.v1 import specsplit_pb2 as pb

# key -> accepted JSON types (bool is not a number here)
KEYS: dict[str, tuple[type, ...]] = {
    "id": (str,),
    "prompt": (str,),
    "chat": (bool,),  # apply the chat template (default true, like `specsplit generate`)
    "max_new_tokens": (int,),
    "temperature": (int, float),
    "top_k": (int,),
    "top_p": (int, float),
    "seed": (int,),
    "stop": (str, list),
    "k": (int,),
    "drafter": (str,),
    "draft_probs": (bool,),
}
DRAFTERS = {kind.name.lower() for kind in DrafterKind}
_TYPE_NAMES = {str: "a string", bool: "true or false", int: "an integer", float: "a number", list: "a list"}


@dataclass(frozen=True)
class PromptSpec:
    id: str
    line: int  # 1-based line number in the input
    fields: dict[str, Any]  # the validated JSON object, "id" included


def parse_prompt_line(text: str, line: int) -> PromptSpec:
    """One input line -> PromptSpec; a ValueError names the line and what to fix."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"line {line}: not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"line {line}: expected a JSON object like {{\"prompt\": \"...\"}}")
    unknown = sorted(set(obj) - set(KEYS))
    if unknown:
        raise ValueError(f"line {line}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(KEYS)}")
    for key, value in obj.items():
        if isinstance(value, bool) and bool not in KEYS[key] or not isinstance(value, KEYS[key]):
            names = " or ".join(_TYPE_NAMES[t] for t in KEYS[key] if not (t is int and float in KEYS[key]))
            raise ValueError(f"line {line}: {key} must be {names}, got {json.dumps(value)}")
    if not obj.get("prompt"):
        raise ValueError(f"line {line}: \"prompt\" is missing or empty")
    if isinstance(obj.get("stop"), list) and not all(isinstance(s, str) for s in obj["stop"]):
        raise ValueError(f"line {line}: stop must be a string or a list of strings")
    if "drafter" in obj and obj["drafter"] not in DRAFTERS:
        raise ValueError(f"line {line}: drafter must be one of {', '.join(sorted(DRAFTERS))}")
    prompt_id = obj.get("id") or f"line-{line}"
    return PromptSpec(prompt_id, line, {**obj, "id": prompt_id})


def parse_prompts(text: str) -> list[PromptSpec]:
    """All prompts of an input file; duplicate ids are refused with both line numbers."""
    specs: list[PromptSpec] = []
    seen: dict[str, int] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        spec = parse_prompt_line(line, number)
        if spec.id in seen:
            raise ValueError(f"line {number}: id {spec.id!r} already used on line {seen[spec.id]}; ids must be unique")
        seen[spec.id] = number
        specs.append(spec)
    return specs


def to_request(fields: dict[str, Any]) -> pb.GenerateRequest:
    """A validated prompt's fields -> the public API's request (the orchestrator checks the ranges)."""
    sampling = pb.SamplingParams(temperature=float(fields.get("temperature", 0.0)), top_k=fields.get("top_k", 0))
    if "top_p" in fields:
        sampling.top_p = float(fields["top_p"])
    if "seed" in fields:
        sampling.seed = fields["seed"]
    stop = fields.get("stop", [])
    request = pb.GenerateRequest(
        prompt=fields["prompt"], chat=fields.get("chat", True), sampling=sampling,
        stop=[stop] if isinstance(stop, str) else stop, draft_probs=fields.get("draft_probs", False),
    )
    if "max_new_tokens" in fields:
        request.max_new_tokens = fields["max_new_tokens"]
    if "k" in fields:
        request.k = fields["k"]
    if "drafter" in fields:
        request.drafter = DrafterKind[fields["drafter"].upper()].value
    return request


def result_record(prompt_id: str, text: str, finish_reason: int, stats: pb.GenerationStats) -> dict[str, Any]:
    return {
        "id": prompt_id,
        "text": text,
        "finish_reason": pb.FinishReason.Name(finish_reason).removeprefix("FINISH_REASON_").lower(),
        "prompt_tokens": stats.prompt_tokens,
        "new_tokens": stats.new_tokens,
        "drafted_tokens": stats.drafted_tokens,
        "accepted_tokens": stats.accepted_tokens,
        "acceptance_rate": round(stats.acceptance_rate, 4),
        "mean_accepted_length": round(stats.mean_accepted_length, 4),
        "tokens_per_s": round(stats.tokens_per_s, 2),
        "wall_s": round(stats.wall_s, 4),
        "seed": stats.seed,
    }


def error_record(prompt_id: str, code: str, details: str) -> dict[str, Any]:
    return {"id": prompt_id, "error": {"code": code, "details": details}}


def encode_record(record: dict[str, Any]) -> bytes:
    return (json.dumps(record, ensure_ascii=False) + "\n").encode()


def scan_output(data: bytes) -> tuple[set[str], int]:
    """Ids already in an output file, and how many leading bytes to keep.

    A crash can leave a torn last line (no newline, or not JSON): it is not
    counted and falls outside the kept length. A bad line before the last one
    means the file is not ours to rewrite: ValueError.
    """
    done: set[str] = set()
    keep = 0
    lines = data.split(b"\n")
    complete, tail = lines[:-1], lines[-1]
    for number, line in enumerate(complete, start=1):
        if not line.strip():
            keep += len(line) + 1
            continue
        try:
            record = json.loads(line)
            prompt_id = record["id"]
        except (ValueError, TypeError, KeyError):
            if number == len(complete) and not tail:
                return done, keep  # the last line is torn
            raise ValueError(f"output line {number} is not a result line; move the file or fix it") from None
        done.add(prompt_id)
        keep += len(line) + 1
    return done, keep  # an unterminated tail is torn: not kept
