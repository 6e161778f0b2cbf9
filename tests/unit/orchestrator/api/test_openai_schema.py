"""OpenAI requests become the GenerateRequests they stand for; responses take OpenAI's shapes; log lines name requests."""

from __future__ import annotations

import json
import logging

import pytest

from specsplit.lmkit import logs
from specsplit.orchestrator.api.config import OrchestratorConfig
from specsplit.orchestrator.api.openai_schema import (
    ChatCompletionRequest,
    ChatShape,
    Choice,
    CompletionRequest,
    CompletionShape,
    RequestError,
    completion_prompts,
    to_generate_request,
    validate,
)
from specsplit.v1 import specsplit_pb2 as pb

pytestmark = pytest.mark.unit

CONFIG = OrchestratorConfig("127.0.0.1:1", max_new_tokens_limit=256)


def chat(**fields) -> pb.GenerateRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return to_generate_request(validate(ChatCompletionRequest, body), CONFIG, "rid-1")


def test_a_chat_request_maps_field_by_field():
    msg = chat(messages=[{"role": "developer", "content": [{"type": "text", "text": "Be "}, {"type": "text",
                                                                                            "text": "brief."}]},
                         {"role": "user", "content": "hi"}, {"role": "assistant", "content": None}],
               max_tokens=9, max_completion_tokens=7, top_p=0.5, seed=3, stop="END", logprobs=True, top_logprobs=2,
               top_k=-1, k=0, drafter="ngram", adaptive_k=False)
    assert [(m.role, m.content) for m in msg.messages] == [("system", "Be brief."), ("user", "hi"), ("assistant", "")]
    assert msg.max_new_tokens == 7  # max_completion_tokens wins over the deprecated max_tokens
    assert msg.sampling.temperature == 1.0 and msg.sampling.top_p == 0.5 and msg.sampling.seed == 3
    assert msg.sampling.top_k == 0 and list(msg.stop) == ["END"] and msg.request_id == "rid-1"
    assert msg.return_logprobs and msg.top_logprobs == 2
    assert msg.k == 0 and msg.drafter == pb.DRAFTER_KIND_NGRAM and msg.HasField("adaptive_k") and not msg.adaptive_k
    assert not msg.HasField("overlap") and not msg.prompt


def test_penalties_and_biases_map_to_sampling():
    sampling = chat(presence_penalty=0.5, frequency_penalty=-1, logit_bias={"5": 10, "42": -100.0},
                    repetition_penalty=1.3, min_tokens=4, ignore_eos=True).sampling
    assert sampling.presence_penalty == 0.5 and sampling.frequency_penalty == -1.0
    assert dict(sampling.logit_bias) == {5: 10.0, 42: -100.0}
    assert sampling.repetition_penalty == pytest.approx(1.3) and sampling.min_tokens == 4 and sampling.ignore_eos
    plain = chat().sampling
    assert not plain.HasField("repetition_penalty") and not plain.logit_bias and not plain.presence_penalty


def test_the_models_defaults_fill_only_what_a_request_leaves_unset():
    defaults = {"temperature": 0.6, "top_k": 20, "top_p": 0.9, "repetition_penalty": 1.2}
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    unset = to_generate_request(validate(ChatCompletionRequest, body), CONFIG, "r", defaults).sampling
    assert unset.temperature == pytest.approx(0.6) and unset.top_k == 20
    assert not unset.HasField("top_p") and not unset.HasField("repetition_penalty")  # the orchestrator fills them
    sent = {**body, "temperature": 0, "top_k": -1}
    explicit = to_generate_request(validate(ChatCompletionRequest, sent), CONFIG, "r", defaults).sampling
    assert explicit.temperature == 0 and explicit.top_k == 0


def test_unset_options_stay_unset_for_the_servers_defaults():
    msg = chat(temperature=0)
    assert not msg.HasField("max_new_tokens") and not msg.HasField("k") and not msg.sampling.HasField("seed")
    assert msg.sampling.temperature == 0 and not msg.return_logprobs


def test_a_completion_request_takes_one_prompt_and_legacy_logprobs():
    msg = to_generate_request(validate(CompletionRequest, {"model": "m", "prompt": ["once"], "logprobs": 3}),
                              CONFIG, "rid-2")
    assert msg.prompt == "once" and not msg.messages and msg.return_logprobs and msg.top_logprobs == 3


@pytest.mark.parametrize("fields, param, fragment", [
    ({"temperature": "0.5"}, "temperature", "valid number"),
    ({"temperature": -1}, "temperature", ">= 0"),
    ({"max_tokens": 0}, "max_tokens", "[1, 256]"),
    ({"max_completion_tokens": 300}, "max_completion_tokens", "[1, 256]"),
    ({"top_p": 0}, "top_p", "(0, 1]"),
    ({"seed": -4}, "seed", "[0, 2**63)"),
    ({"n": 0}, "n", "[1, 16]"),
    ({"n": 17}, "n", "[1, 16] (this server's --max-n), got 17"),
    ({"n": 2.5}, "n", "valid integer"),
    ({"n": "2"}, "n", "valid integer"),
    ({"presence_penalty": 2.5}, "presence_penalty", "[-2, 2]"),
    ({"frequency_penalty": -3}, "frequency_penalty", "[-2, 2]"),
    ({"repetition_penalty": 0}, "repetition_penalty", "> 0"),
    ({"logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
    ({"logit_bias": {"hello": 1}}, "logit_bias", "token ids"),
    ({"logit_bias": {"-5": 1}}, "logit_bias", "token ids"),
    ({"logit_bias": {"\u00b2": 1}}, "logit_bias", "token ids"),
    ({"min_tokens": -1}, "min_tokens", ">= 0"),
    ({"tools": [{"type": "function"}]}, "tools[0]", '"function": {"name"'),
    ({"tool_choice": "auto"}, "tool_choice", "needs tools"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "text, json_object or json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": []}}}, "response_format.json_schema",
     "`schema` object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}},
     "response_format.json_schema.strict", "boolean"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex", "one structured output"),
    ({"guided_choice": "yes"}, "guided_choice", "valid list"),
    ({"top_logprobs": 3}, "top_logprobs", "needs logprobs"),
    ({"stop": ["a", 5]}, "stop", "valid string"),
    ({"drafter": "psychic"}, "drafter", "unknown drafter"),
    ({"k": -2}, "k", ">= 0"),
    ({"messages": []}, "messages", "at least 1"),
    ({"messages": [{"role": "function", "content": "x"}]}, "messages.0.role", "Input should be"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f"}}]}]},
     "messages.0.tool_calls.0.function.arguments", "missing"),
    ({"stream": "yes"}, "stream", "valid boolean"),
    ({"temprature": 0}, "temprature", "unrecognized request argument"),
])
def test_bad_parameters_are_refused_naming_them(fields, param, fragment):
    with pytest.raises(RequestError) as info:
        chat(**fields)
    assert info.value.status == 400 and info.value.param == param and fragment in info.value.message
    assert info.value.body()["error"]["type"] == "invalid_request_error"


def test_missing_and_non_object_bodies():
    with pytest.raises(RequestError, match="missing required parameter: model"):
        validate(ChatCompletionRequest, {"messages": []})
    with pytest.raises(RequestError, match="JSON object, got list"):
        validate(ChatCompletionRequest, [1])


def _prompts(prompt) -> list:
    return completion_prompts(validate(CompletionRequest, {"model": "m", "prompt": prompt}))


def test_completions_take_openais_four_prompt_shapes():
    assert _prompts("a b") == ["a b"]
    assert _prompts(["a", "b c"]) == ["a", "b c"]
    assert _prompts([5, 6, 7]) == [[5, 6, 7]]
    assert _prompts([[5, 6], [7]]) == [[5, 6], [7]]
    msg = to_generate_request(validate(CompletionRequest, {"model": "m", "prompt": [[5, 6], [7]]}), CONFIG, "r")
    assert list(msg.prompt_token_ids) == [5, 6] and not msg.prompt  # the first prompt; the server copies it for each
    text = to_generate_request(validate(CompletionRequest, {"model": "m", "prompt": ["x", "y"]}), CONFIG, "r")
    assert text.prompt == "x" and not text.prompt_token_ids


@pytest.mark.parametrize("prompt, fragment", [
    ([], "empty list"),
    ([[1, 2], []], "prompt[1] is an empty list"),
    ([1, -2], "prompt[1] = -2 is not a token id"),
    ([[3], [4, 2**32]], "prompt[1][1] = 4294967296 is not a token id"),
    ([1, "a"], "invalid value for prompt"),
    ([True], "invalid value for prompt"),
])
def test_bad_prompt_shapes_are_refused_naming_the_prompt(prompt, fragment):
    with pytest.raises(RequestError) as info:
        _prompts(prompt)
    assert info.value.status == 400 and info.value.param.startswith("prompt") and fragment in info.value.message


def logprob(token: str, value: float, *top) -> pb.TokenLogprob:
    return pb.TokenLogprob(token=token, logprob=value, top=[pb.TopLogprob(token=t, logprob=v) for t, v in top])


def test_shapes_of_chunks_and_whole_responses():
    stats = pb.GenerationStats(prompt_tokens=5, new_tokens=2, rounds=1, drafted_tokens=3, accepted_tokens=1, k=3,
                               drafter=pb.DRAFTER_KIND_NGRAM, mode=pb.VERIFICATION_MODE_GREEDY)
    shape = ChatShape("chatcmpl-x", "m", logprobs=True)
    (opening,) = shape.opening()
    assert opening["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    chunk = shape.chunk("Hé", [logprob("H", -0.5, ("H", -0.5), ("A", -2.0)), logprob("é", -1.0)], None)
    content = chunk["choices"][0]["logprobs"]["content"]
    assert chunk["object"] == "chat.completion.chunk" and chunk["choices"][0]["delta"] == {"content": "Hé"}
    assert content[1]["bytes"] == [195, 169] and [t["token"] for t in content[0]["top_logprobs"]] == ["H", "A"]
    assert shape.chunk("", [], "stop")["choices"][0]["delta"] == {}
    whole = shape.whole([Choice("Hé", [], "length")], [stats])
    assert whole["object"] == "chat.completion" and whole["choices"][0]["message"] == {"role": "assistant",
                                                                                    "content": "Hé"}
    assert whole["usage"]["total_tokens"] == 7 and whole["usage"]["speculative"]["drafter"] == "ngram"
    assert shape.usage_chunk([stats])["choices"] == []
    legacy = CompletionShape("cmpl-x", "m", logprobs=True)
    first = legacy.chunk("ab", [logprob("a", -1.0, ("a", -1.0)), logprob("b", -2.0)], None)["choices"][0]
    second = legacy.chunk("c", [logprob("c", -3.0)], "stop")["choices"][0]
    assert first["logprobs"] == {"tokens": ["a", "b"], "token_logprobs": [-1.0, -2.0],
                                 "top_logprobs": [{"a": -1.0}, {}], "text_offset": [0, 1]}
    assert second["logprobs"]["text_offset"] == [2] and second["finish_reason"] == "stop"


def test_log_lines_carry_the_request_id_of_their_task(capsys):
    logs.configure("INFO", "orchestrator", "json")
    log = logging.getLogger("specsplit.orchestrator.test")
    with logs.request_context("req-7"):
        log.info("inside")
    log.info("outside")
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert [(line["message"], line.get("request_id")) for line in lines] == [("inside", "req-7"), ("outside", None)]
    assert lines[0]["component"] == "orchestrator" and lines[0]["logger"] == "specsplit.orchestrator.test"
    logs.configure("INFO", "orchestrator", "text")
    with logs.request_context("req-8"):
        log.warning("tagged")
    assert "orchestrator WARNING [req=req-8] tagged" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--log-format"):
        logs.configure("INFO", "x", "xml")


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("fields, grammar", [
    ({"response_format": {"type": "json_object"}}, pb.Grammar(json_object=True)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
     pb.Grammar(json_schema=json.dumps(SCHEMA), strict=True)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
     pb.Grammar(json_schema=json.dumps(SCHEMA))),
    ({"guided_json": SCHEMA}, pb.Grammar(json_schema=json.dumps(SCHEMA))),
    ({"guided_json": '{"type": "string"}'}, pb.Grammar(json_schema='{"type": "string"}')),
    ({"guided_regex": "[0-9]+"}, pb.Grammar(regex="[0-9]+")),
    ({"guided_choice": ["yes", "no"]}, pb.Grammar(choice=pb.GrammarChoices(choices=["yes", "no"]))),
    ({"guided_grammar": 'root ::= "a"'}, pb.Grammar(ebnf='root ::= "a"')),
])
def test_structured_outputs_become_the_request_grammar(fields, grammar):
    assert chat(**fields).grammar == grammar


def test_text_response_format_and_no_constraint_leave_no_grammar():
    assert not chat(response_format={"type": "text"}).HasField("grammar")
    assert not chat().HasField("grammar")


def test_completions_take_the_guided_parameters():
    body = {"model": "m", "prompt": "p", "guided_choice": ["a", "b"]}
    msg = to_generate_request(validate(CompletionRequest, body), CONFIG, "rid-1")
    assert list(msg.grammar.choice.choices) == ["a", "b"]


def test_n_samples_map_to_the_request_and_best_of_may_only_equal_n():
    assert chat(n=4).n == 4 and not chat().HasField("n")
    completion = {"model": "m", "prompt": "p"}
    assert to_generate_request(validate(CompletionRequest, {**completion, "n": 3, "best_of": 3}), CONFIG, "r").n == 3
    with pytest.raises(RequestError, match="best_of may only equal n") as info:
        to_generate_request(validate(CompletionRequest, {**completion, "n": 2, "best_of": 4}), CONFIG, "r")
    assert info.value.param == "best_of"


def test_choices_of_several_samples_are_indexed_and_usage_counts_the_prompt_once():
    samples = [pb.GenerationStats(prompt_tokens=5, new_tokens=n, rounds=2, drafted_tokens=4, accepted_tokens=a,
                                  seed=s, wall_s=1.0, tokens_per_s=n) for n, a, s in ((3, 1, 7), (4, 3, 9))]
    whole = ChatShape("chatcmpl-x", "m", logprobs=False).whole([Choice("a", [], "stop"), Choice("bc", [], "length")],
                                                                 samples)
    assert [(c["index"], c["message"]["content"], c["finish_reason"]) for c in whole["choices"]] == [
        (0, "a", "stop"), (1, "bc", "length")]
    usage = whole["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (5, 7, 12)
    spec = usage["speculative"]
    assert (spec["rounds"], spec["drafted_tokens"], spec["accepted_tokens"], spec["acceptance_rate"]) == (4, 8, 4, 0.5)
    assert spec["seed"] == 7 and spec["seeds"] == [7, 9] and spec["tokens_per_s"] == 7.0
    chat_shape = ChatShape("chatcmpl-x", "m", logprobs=False)
    assert [c["choices"][0]["index"] for c in chat_shape.opening(3)] == [0, 1, 2]
    assert chat_shape.chunk("x", [], None, 2)["choices"][0]["index"] == 2


def test_completion_logprob_offsets_count_per_choice():
    shape = CompletionShape("cmpl-x", "m", logprobs=True)
    shape.chunk("ab", [logprob("a", -1.0), logprob("b", -1.0)], None, 0)
    other = shape.chunk("c", [logprob("c", -1.0)], None, 1)["choices"][0]
    again = shape.chunk("d", [logprob("d", -1.0)], None, 0)["choices"][0]
    assert (other["index"], other["logprobs"]["text_offset"]) == (1, [0])
    assert (again["index"], again["logprobs"]["text_offset"]) == (0, [2])
