"""Incremental detokenization of one request's output, with stop strings.

Tokens are decoded as they arrive through the `tokenizers` library's `DecodeStream`,
primed with the prompt's last tokens so that the first output token decodes in
context (a leading space stays a space). `DecodeStream` holds back tokens that end
inside a multi-byte UTF-8 character until the character is whole, so no replacement
character ever reaches the text (bytes that no later token completes stay out of it).
Stop strings are searched only in the newly
decoded text plus the longest stop string's overlap, and text that could be the
start of a stop string is held back from streamed output until it is known not to
be one.
"""

from __future__ import annotations

from typing import Any

from tokenizers.decoders import DecodeStream

from mrv2.sampling_params import SamplingParams

# Prompt tokens the stream is primed with: enough context for the first output token's spacing.
_PRIME_TOKENS = 6


class IncrementalDetokenizer:
    """The text of one request's output tokens so far, and the stop string that ended it, if any."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._tokenizer = tokenizer.backend_tokenizer
        self._skip_special = params.skip_special_tokens
        # Special tokens as their own segments, joined to their neighbours by a space (HF's slow
        # tokenizers' `spaces_between_special_tokens`); only visible when specials are kept.
        self._spaced = not params.skip_special_tokens and params.spaces_between_special_tokens
        self._special_ids = set(tokenizer.all_special_ids) if self._spaced else set()
        self._after_special = False
        self._stream = DecodeStream(ids=prompt_token_ids[-_PRIME_TOKENS:], skip_special_tokens=self._skip_special)
        self._tokenizer_ref = tokenizer
        self._stop = params.stop
        self._min_tokens = params.min_tokens
        self._include_stop = params.include_stop_str_in_output
        # Characters a stop string's prefix may occupy at the end of the text: never streamed early.
        self._hold_back = max(map(len, self._stop)) - 1 if self._stop and not self._include_stop else 0
        self.num_tokens = 0
        self.text = ""
        self.stop_str: str | None = None
        self._sent = 0  # characters already returned by `delta`

    def add_token(self, token_id: int) -> bool:
        """Append one token's text; True when it completed a stop string (the text is cut there)."""
        self.num_tokens += 1
        if token_id in self._special_ids:
            piece = (" " if self.text else "") + self._tokenizer_ref.convert_ids_to_tokens(token_id)
            self._stream = DecodeStream(skip_special_tokens=False)
            self._after_special = True
        else:
            piece = self._stream.step(self._tokenizer, token_id) or ""
            if piece and self._after_special:
                piece, self._after_special = " " + piece, False
        if not piece:
            return False
        self.text += piece
        return self._check_stop(len(piece))

    def _check_stop(self, new_chars: int) -> bool:
        if not self._stop or self.num_tokens < self._min_tokens:
            return False
        found = None
        for stop in self._stop:
            # A match must end in the new text, so it starts at most len(stop) - 1 characters before it.
            at = self.text.find(stop, max(0, len(self.text) - new_chars - len(stop) + 1))
            if at >= 0 and (found is None or at < found[0]):
                found = (at, stop)
        if found is None:
            return False
        at, self.stop_str = found
        self.text = self.text[:at + len(self.stop_str) if self._include_stop else at]
        return True

    def output_text(self, finished: bool) -> str:
        """All the text that may be shown: the held-back tail only once the request finished."""
        return self.text if finished else self.text[:max(len(self.text) - self._hold_back, self._sent)]

    def delta(self, finished: bool) -> str:
        """The text not returned by earlier calls."""
        text = self.output_text(finished)
        new, self._sent = text[self._sent:], max(len(text), self._sent)
        return new
