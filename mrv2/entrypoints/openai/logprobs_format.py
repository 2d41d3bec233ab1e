"""Engine logprobs (`CompletionOutput.logprobs`) in the OpenAI API's two shapes."""

from __future__ import annotations

from typing import Any

from mrv2.engine.outputs import Logprob


def completion_logprobs(token_ids: list[int], entries: list[dict[int, Logprob]], text_offset: int) -> dict[str, Any]:
    """The legacy completions shape: tokens, token_logprobs, top_logprobs (sampled token included), text_offset.

    `text_offset` is where the first token's text starts in the choice's text.
    """
    tokens, token_logprobs, top, offsets = [], [], [], []
    for token_id, entry in zip(token_ids, entries):
        chosen = entry[token_id]
        tokens.append(chosen.decoded_token)
        token_logprobs.append(chosen.logprob)
        top.append({lp.decoded_token: lp.logprob for lp in entry.values()})
        offsets.append(text_offset)
        text_offset += len(chosen.decoded_token or "")
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def _chat_item(lp: Logprob) -> dict[str, Any]:
    text = lp.decoded_token or ""
    return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(token_ids: list[int], entries: list[dict[int, Logprob]], top_logprobs: int) -> dict[str, Any]:
    """The chat shape: per token its text, logprob and bytes, and the `top_logprobs` most likely, by rank."""
    content = []
    for token_id, entry in zip(token_ids, entries):
        ranked = sorted((lp for lp in entry.values() if lp.rank is not None and lp.rank <= top_logprobs),
                        key=lambda lp: lp.rank)
        content.append(_chat_item(entry[token_id]) | {"top_logprobs": [_chat_item(lp) for lp in ranked]})
    return {"content": content}


def prompt_completion_logprobs(tokenizer: Any, prompt_ids: list[int],
                               entries: list[dict[int, Logprob] | None]) -> dict[str, Any]:
    """The prompt's tokens in the completions shape (for `echo`): the first has no logprob."""
    tokens, token_logprobs, top, offsets, offset = [], [], [], [], 0
    for token_id, entry in zip(prompt_ids, entries):
        text = entry[token_id].decoded_token if entry else tokenizer.decode([token_id])
        tokens.append(text)
        token_logprobs.append(entry[token_id].logprob if entry else None)
        top.append({lp.decoded_token: lp.logprob for lp in entry.values()} if entry else None)
        offsets.append(offset)
        offset += len(text or "")
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def join_logprobs(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    """Two completions-shaped logprobs, the second's text offsets continuing the first's text."""
    shift = (first["text_offset"][-1] + len(first["tokens"][-1] or "")) if first["tokens"] else 0
    return {"tokens": first["tokens"] + second["tokens"],
            "token_logprobs": first["token_logprobs"] + second["token_logprobs"],
            "top_logprobs": first["top_logprobs"] + second["top_logprobs"],
            "text_offset": first["text_offset"] + [o + shift for o in second["text_offset"]]}


def prompt_logprobs_json(entries: list[dict[int, Logprob] | None] | None) -> list[dict[str, Any] | None] | None:
    """vLLM's `prompt_logprobs` response field: per prompt token, token id -> logprob, rank, text."""
    if entries is None:
        return None
    return [None if e is None else {str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
                                    for t, lp in e.items()} for e in entries]
