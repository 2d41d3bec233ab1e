"""Incremental detokenization: the stream equals the final text, UTF-8 is never split, stop strings never leak."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from mrv2.engine.detokenizer import IncrementalDetokenizer
from mrv2.sampling_params import SamplingParams

PROMPT = "Write a short story:"
# Multi-byte characters (CJK, emoji, accents) split across byte-level tokens, and plain text.
TEXT = st.text(alphabet=st.sampled_from(list("ab cdé,ü.\n日本語テキ😀🎉ñ")) | st.characters(codec="utf-8"),
               min_size=1, max_size=40)


@pytest.fixture(scope="module")
def tokenizer(converted_default_model):
    return AutoTokenizer.from_pretrained(converted_default_model)


def stream(tokenizer, ids: list[int], **params) -> tuple[list[str], IncrementalDetokenizer]:
    """Feed `ids` one at a time; the deltas returned after each token (the last one as finished)."""
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode(PROMPT), SamplingParams(**params))
    deltas = []
    for i, t in enumerate(ids):
        stopped = detok.add_token(t)
        deltas.append(detok.delta(finished=stopped or i == len(ids) - 1))
        if stopped:
            break
    return deltas, detok


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=TEXT)
def test_stream_equals_the_final_text_and_never_splits_a_character(tokenizer, text):
    ids = tokenizer.encode(text)
    assume(ids)  # control characters alone encode to nothing
    deltas, detok = stream(tokenizer, ids)
    expected = tokenizer.decode(ids, skip_special_tokens=True)
    assert "".join(deltas) == detok.text
    if "\ufffd" not in expected:
        assert detok.text == expected and all("\ufffd" not in d for d in deltas)
    else:  # bytes no character completes (text the tokenizer cannot spell) are dropped at the end only
        assert expected.startswith(detok.text) and set(expected[len(detok.text):]) <= {"\ufffd"}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=TEXT, data=st.data())
def test_a_stop_string_cuts_the_text_and_no_partial_match_is_ever_streamed(tokenizer, text, data):
    ids = tokenizer.encode(text)
    full = tokenizer.decode(ids)
    assume(full and "\ufffd" not in full)  # text the tokenizer can spell
    start = data.draw(st.integers(0, len(full) - 1))
    stop = full[start:data.draw(st.integers(start + 1, min(len(full), start + 6)))]
    include = data.draw(st.booleans())
    deltas, detok = stream(tokenizer, ids, stop=[stop], include_stop_str_in_output=include)
    at = full.find(stop)
    expected = full[:at + len(stop)] if include else full[:at]
    assert detok.stop_str == stop
    assert "".join(deltas) == detok.text == expected  # deltas only grow the text: nothing was taken back


def test_the_earliest_of_several_stop_strings_wins(tokenizer):
    ids = tokenizer.encode("one two three four")
    _, detok = stream(tokenizer, ids, stop=["four", "two"])
    assert detok.stop_str == "two" and detok.text == "one "


def test_stop_strings_apply_only_from_min_tokens(tokenizer):
    ids = tokenizer.encode(" stop here, stop there")
    _, early = stream(tokenizer, ids, stop=["stop"])
    _, late = stream(tokenizer, ids, stop=["stop"], min_tokens=3)
    assert early.text == " " and late.text == " stop here, "


def _slow_join(tokenizer, ids: list[int], sep: str) -> str:
    """HF slow tokenizers' decode with special tokens kept: runs of ordinary tokens and special tokens, joined."""
    special, parts, run = set(tokenizer.all_special_ids), [], []
    for t in ids:
        if t in special:
            parts += [tokenizer.decode(run)] if run else []
            parts.append(tokenizer.convert_ids_to_tokens(t))
            run = []
        else:
            run.append(t)
    parts += [tokenizer.decode(run)] if run else []
    return sep.join(parts)


@pytest.mark.parametrize("spaces", [True, False])
def test_special_tokens_kept_with_and_without_spaces_between_them(tokenizer, spaces):
    end, start = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|im_start|>"])
    ids = tokenizer.encode("Hello") + [end] + tokenizer.encode(" world") + [start, end] + tokenizer.encode("!")
    deltas, detok = stream(tokenizer, ids, skip_special_tokens=False, spaces_between_special_tokens=spaces)
    expected = _slow_join(tokenizer, ids, " ") if spaces else tokenizer.decode(ids, skip_special_tokens=False)
    assert "".join(deltas) == detok.text == expected
    assert "<|im_end|>" in expected
    skipped, _ = stream(tokenizer, ids)
    assert "".join(skipped) == tokenizer.decode(ids, skip_special_tokens=True) == "Hello world!"
