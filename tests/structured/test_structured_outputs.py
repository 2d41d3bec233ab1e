"""Structured output through xgrammar on the default model: sampled at temperature 1.0, every output
follows its JSON schema, regex, choice or grammar; async and serial scheduling, n-gram speculation and
tensor parallelism give the same constrained outputs; bad specs are refused before anything runs."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from mrv2 import LLM, SamplingParams, StructuredOutputsParams

N = 50  # samples per spec

SCHEMAS = {
    "nested": {"type": "object", "additionalProperties": False, "required": ["user", "active"],
               "properties": {"user": {"type": "object", "additionalProperties": False, "required": ["name", "age"],
                                       "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 12},
                                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}}},
                              "active": {"type": "boolean"}}},
    "array": {"type": "object", "additionalProperties": False, "required": ["items"],
              "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 3,
                                       "items": {"type": "object", "additionalProperties": False,
                                                 "required": ["id", "score"],
                                                 "properties": {"id": {"type": "integer", "minimum": 0,
                                                                       "maximum": 999},
                                                                "score": {"type": "number"}}}}}},
    "enum": {"type": "object", "additionalProperties": False, "required": ["color", "size"],
             "properties": {"color": {"enum": ["red", "green", "blue"]},
                            "size": {"type": "string", "enum": ["S", "M", "L", "XL"]},
                            "note": {"type": "string", "maxLength": 8}}},
    "required": {"type": "object", "additionalProperties": False, "required": ["a", "b", "c"],
                 "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                "b": {"type": "string", "maxLength": 6}, "c": {"type": "null"},
                                "d": {"type": "boolean"}}},
}
REGEXES = [r"\d{3}-\d{4}", r"(yes|no|maybe)", r"[A-Z][a-z]{2,8} [A-Z][a-z]{2,8}", r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]"]
CHOICES = ["Paris", "London", "Berlin", "Madrid"]
ARITHMETIC = 'root ::= term op term\nop ::= "+" | "-" | "*"\nterm ::= [1-9] [0-9]?'


@pytest.fixture(scope="module")
def llm():
    # The default dtype (bf16 here): validity does not depend on exact logits.
    return LLM(max_model_len=1024, max_num_seqs=64, kv_cache_memory=128 << 20)


def _sample(llm, prompt, spec: StructuredOutputsParams, max_tokens=120, seed=0, n=N):
    params = SamplingParams(n=n, temperature=1.0, seed=seed, max_tokens=max_tokens, structured_outputs=spec)
    return llm.generate(prompt, params)[0].outputs


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_every_sample_follows_its_json_schema(llm, name):
    schema = SCHEMAS[name]
    outs = _sample(llm, f"Write one JSON record ({name}):", StructuredOutputsParams(json=schema))
    assert [o.finish_reason for o in outs] == ["stop"] * N  # EOS came, and only once the object was complete
    for o in outs:
        jsonschema.validate(json.loads(o.text), schema)
    assert len({o.text for o in outs}) > 1  # really sampled


def test_every_sample_matches_its_regex_or_choice(llm):
    for regex in REGEXES:
        outs = _sample(llm, "Answer:", StructuredOutputsParams(regex=regex), max_tokens=40)
        assert all(re.fullmatch(regex, o.text) and o.finish_reason == "stop" for o in outs), \
            (regex, [o.text for o in outs if not re.fullmatch(regex, o.text)][:3])
    outs = _sample(llm, "The best city:", StructuredOutputsParams(choice=CHOICES))
    assert all(o.text in CHOICES for o in outs) and len({o.text for o in outs}) > 1


def test_every_sample_follows_an_ebnf_grammar_and_json_object(llm):
    outs = _sample(llm, "A sum:", StructuredOutputsParams(grammar=ARITHMETIC), max_tokens=40)
    assert all(re.fullmatch(r"[1-9][0-9]?[-+*][1-9][0-9]?", o.text) and o.finish_reason == "stop" for o in outs)
    outs = _sample(llm, 'Write {"a": 1} as JSON:', StructuredOutputsParams(json_object=True), max_tokens=200, n=10)
    finished = [o for o in outs if o.finish_reason == "stop"]
    assert finished and all(isinstance(json.loads(o.text), dict) for o in finished)  # an object, not any value


def test_max_tokens_inside_the_structure_reports_length(llm):
    [out] = _sample(llm, "A record:", StructuredOutputsParams(json=SCHEMAS["nested"]), max_tokens=4, n=1)
    assert out.finish_reason == "length" and len(out.token_ids) == 4
    with pytest.raises(json.JSONDecodeError):
        json.loads(out.text)


def test_async_serial_and_ngram_speculation_give_the_same_constrained_outputs(default_llm):
    # Seeded sampling draws the same tokens whatever the scheduling (fp32: batch shapes do not change
    # the logits): the masks must be the same too, also when tokens reach the matcher a step late
    # (async) or as verified drafts (n-gram).
    prompt = "Repeat the record {\"user\": {\"name\": \"Ann\", \"age\": 31}, \"active\": true} as JSON:"
    params = SamplingParams(n=8, temperature=1.0, seed=7, max_tokens=60,
                            structured_outputs=StructuredOutputsParams(json=SCHEMAS["nested"]))

    def run(engine):
        return [o.token_ids for o in engine.generate(prompt, params)[0].outputs]

    reference = run(default_llm)
    kwargs = dict(dtype="float32", max_model_len=1024, max_num_seqs=16, kv_cache_memory=64 << 20)
    for engine_kwargs in ({"async_scheduling": not default_llm.engine.config.async_scheduling},
                          {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}}):
        other = LLM(**kwargs, **engine_kwargs)
        try:
            assert run(other) == reference, engine_kwargs
            if "speculative_config" in engine_kwargs:
                assert other.engine.scheduler.spec_stats.num_accepted_tokens > 0  # drafts verified under masks
        finally:
            other.engine.shutdown()


def test_tensor_parallel_ranks_apply_the_same_masks(default_llm):
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(
        json=SCHEMAS["enum"]))
    expected = default_llm.generate("Describe a shirt as JSON:", params)[0].outputs[0].text
    tp = LLM(dtype="float32", tensor_parallel_size=2, max_model_len=1024, kv_cache_memory=64 << 20)
    try:
        assert tp.generate("Describe a shirt as JSON:", params)[0].outputs[0].text == expected
    finally:
        tp.engine.shutdown()
    jsonschema.validate(json.loads(expected), SCHEMAS["enum"])


@pytest.mark.parametrize("spec, problem", [
    (dict(json={"type": "objec"}), "structured_outputs.json is invalid: Unsupported type \"objec\""),
    (dict(json="{not json"), "structured_outputs.json is invalid"),
    (dict(regex="([a-z"), "structured_outputs.regex is invalid"),
    (dict(grammar="root ::= undefined_rule"), "structured_outputs.grammar is invalid"),
    (dict(choice=[]), "choice must be a non-empty list"),
    (dict(regex="a", choice=["a"]), "needs exactly one of"),
])
def test_bad_specs_are_refused_before_anything_runs(llm, spec, problem):
    with pytest.raises(ValueError, match=re.escape(problem)):
        llm.generate("x", SamplingParams(structured_outputs=StructuredOutputsParams(**spec)))
    assert llm.engine.scheduler.block_pool.is_whole() and not llm.engine.scheduler.requests
    assert llm.engine.structured.num_active == 0
    out = llm.generate("Hi", SamplingParams(max_tokens=3, structured_outputs=StructuredOutputsParams(choice=["ok"])))
    assert out[0].outputs[0].text == "ok"  # the engine serves on


def test_grammars_compile_once_per_spec(llm):
    backend = llm.engine.structured.backend
    before = backend.num_compiled
    spec = {"type": "object", "properties": {"only_here": {"type": "integer"}}, "required": ["only_here"]}
    for _ in range(3):
        _sample(llm, "x", StructuredOutputsParams(json=dict(spec)), n=2, max_tokens=20)
    assert backend.num_compiled == before + 1
