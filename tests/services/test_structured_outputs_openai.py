"""Structured outputs with the official `openai` client against `specsplit serve --http-port`, on the real SmolLM2.

Every output parses and validates against its schema (or matches its regex, or is one of its choices),
greedy and sampled, over several schemas and prompts; greedy speculative output (n-gram drafts plus forced
tokens) equals target-only decoding (k = 0) through the same server; a schema xgrammar cannot compile is
a 400 in OpenAI's error shape that says why.
"""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from tests.services.smollm2_http import smollm2_http

pytestmark = [pytest.mark.services, pytest.mark.slow]

MAX_TOKENS = 80
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "maxLength": 24},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
BOOK = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "genre": {"enum": ["fiction", "science", "history", "poetry"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
        "in_print": {"type": "boolean"},
    },
    "required": ["title", "genre", "tags", "in_print"],
    "additionalProperties": False,
}
ORDER = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {
                    "product": {"type": "string", "maxLength": 16},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
                },
                "required": ["product", "quantity"],
                "additionalProperties": False,
            },
        },
        "express": {"type": "boolean"},
    },
    "required": ["items", "express"],
    "additionalProperties": False,
}
CASES = [
    (PERSON, "Extract the person as JSON: Maria Lopez is 34 years old and lives in Madrid."),
    (PERSON, "Give the person as JSON. Text: 'Tom, aged 71, moved to Leeds last year.'"),
    (BOOK, "Describe the book 'A Brief History of Time' as JSON."),
    (ORDER, "Turn this order into JSON: two apples and one loaf of bread, delivered express."),
]


@pytest.fixture(scope="module")
def http(background_loop, tmp_path_factory):
    """`specsplit serve --http-port` as a process over an in-process SmolLM2 target and n-gram draft."""
    with smollm2_http(background_loop, tmp_path_factory.mktemp("structured"), "smollm2") as url:
        client = openai.OpenAI(base_url=url, api_key="-", max_retries=0, timeout=600)
        yield client
        client.close()


def chat(client, prompt: str, **options):
    done = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": prompt}], max_tokens=MAX_TOKENS, **options
    )
    return done.choices[0]


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": True}}


@pytest.mark.parametrize("schema, prompt", CASES)
def test_json_schema_outputs_validate_and_greedy_equals_target_only(http, schema, prompt):
    fmt = schema_format(schema)
    speculative = chat(http, prompt, temperature=0, response_format=fmt)
    target_only = chat(http, prompt, temperature=0, response_format=fmt, extra_body={"k": 0})
    assert speculative.finish_reason == "stop", speculative.message.content
    jsonschema.validate(json.loads(speculative.message.content), schema)
    assert speculative.message.content == target_only.message.content


@pytest.mark.parametrize("seed", [1, 2])
def test_sampled_json_schema_outputs_validate(http, seed):
    for schema, prompt in CASES[::2]:
        done = chat(http, prompt, temperature=0.8, seed=seed, response_format=schema_format(schema))
        assert done.finish_reason == "stop", done.message.content
        jsonschema.validate(json.loads(done.message.content), schema)


def test_guided_json_and_json_object_give_json(http):
    done = chat(http, CASES[0][1], temperature=0, extra_body={"guided_json": PERSON})
    jsonschema.validate(json.loads(done.message.content), PERSON)
    for temperature in (0, 0.8):
        done = chat(
            http,
            'Give a JSON object with the keys "fruit" and "colour" for a banana.',
            temperature=temperature,
            seed=3,
            response_format={"type": "json_object"},
        )
        assert done.finish_reason == "stop" and isinstance(json.loads(done.message.content), dict)


def test_guided_choice_and_regex(http):
    choices = ["positive", "negative", "neutral"]
    for temperature in (0, 0.9):
        done = chat(
            http,
            "Sentiment of 'I loved this film!'?",
            temperature=temperature,
            seed=4,
            extra_body={"guided_choice": choices},
        )
        assert done.message.content in choices
        phone = r"\(\d{3}\) \d{3}-\d{4}"
        done = chat(
            http, "Write a US phone number.", temperature=temperature, seed=5, extra_body={"guided_regex": phone}
        )
        assert re.fullmatch(phone, done.message.content), done.message.content
    completion = http.completions.create(
        model="smollm2",
        prompt="The answer is",
        max_tokens=8,
        temperature=0,
        extra_body={"guided_grammar": 'root ::= ("yes" | "no") "."'},
    )
    assert completion.choices[0].text in ("yes.", "no.")


def test_a_schema_that_does_not_compile_is_a_400_that_says_why(http):
    with pytest.raises(openai.BadRequestError) as refused:
        chat(http, "hi", response_format=schema_format({"type": "objec"}))
    assert refused.value.status_code == 400 and 'Unsupported type "objec"' in refused.value.message
    assert refused.value.type == "invalid_request_error"
