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
