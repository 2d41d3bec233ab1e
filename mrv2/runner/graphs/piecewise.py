"""PIECEWISE graphs: the segments between attention calls are captured, attention runs eagerly between them.

For a descriptor of t padded tokens the recorder captures segment 0 (embedding ->
inputs of attention call 0) over the persistent input ids and positions, then each
segment i over attention call i-1's output and segment i-1's residual, up to the last
segment's final hidden states (see `mrv2.models.base` for the segments). Attention is
never captured: at replay it runs between the pieces over the step's real tokens, with
the step's own metadata (real query_start_loc, sequence lengths and slot mapping, so
no padded token reaches the KV cache). Each piece's results go to the next as they are
(a device graph copies them into its captured inputs where they live elsewhere); an
attention output of fewer rows than the padded count is copied into a padded buffer
first. Rows past the real tokens hold stale values; they only feed padded rows, which
are discarded.

Because attention stays outside the graphs, every batch up to the largest size fits,
mixed prefill/decode steps included, and attention needs no per-size workspace.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, Protocol

import torch

from mrv2.platforms.graphs import CapturedGraph, GraphBackend
from mrv2.runner.graphs.descriptor import BatchDescriptor


class SegmentedModel(Protocol):
    """A forward split at attention calls (implemented by `mrv2.models.base.CausalLM`)."""

    @property
    def num_attention_calls(self) -> int: ...

    def segment_call(self, i: int) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        """Segment i as fn and leading arguments: fn(*args, positions, x, residual)."""

    def attend(self, i: int, inputs: tuple[torch.Tensor, ...], attn_metadata: Any) -> torch.Tensor: ...

    def store_aux_hidden(self, i: int, residual: torch.Tensor) -> None:
        """Keep segment i's residual where the model records auxiliary hidden states (else nothing)."""


class PiecewiseRecording:
    """The captured segments of one descriptor and the attention calls between them."""

    def __init__(self, model: SegmentedModel, pieces: list[CapturedGraph], input_ids: torch.Tensor,
                 attn_out: list[torch.Tensor], build_attention_metadata: Callable[[Any], Any]) -> None:
        self.model = model
        self.pieces = pieces
        self.input_ids = input_ids  # segment 0's input: the persistent ids, padded
        self.attn_out = attn_out  # per attention call: where an output of fewer rows is padded
        self.build_attention_metadata = build_attention_metadata

    def replay(self, metadata: Any) -> torch.Tensor:
        """Replay over the persistent inputs; `metadata` is the step's (unpadded) common metadata."""
        attn_metadata = self.build_attention_metadata(metadata)
        t = metadata.num_tokens
        x, residual = self.input_ids, None
        for i, piece in enumerate(self.pieces[:-1]):
            inputs, residual = piece.replay(x, residual)
            self.model.store_aux_hidden(i, residual[:t])
            x = self.model.attend(i, tuple(v[:t] for v in inputs), attn_metadata)
            buf = self.attn_out[i]
            if x.shape != buf.shape or x.stride() != buf.stride():  # fewer rows (or another layout)
                buf[:t].copy_(x)
                x = buf
        return self.pieces[-1].replay(x, residual)


class PiecewiseForward:
    """Records a segmented model's forward as one graph per segment, over persistent ids and positions.

    Attention-output padding buffers are shared by all descriptors (they never run at the
    same time): allocated at the first (largest) descriptor's size and sliced for the others.
    """

    def __init__(self, model: SegmentedModel, input_ids: torch.Tensor, positions: torch.Tensor,
                 build_attention_metadata: Callable[[Any], Any]) -> None:
        self.model = model
        self.input_ids = input_ids
        self.positions = positions
        self.build_attention_metadata = build_attention_metadata
        self._attn_out: list[torch.Tensor | None] = [None] * model.num_attention_calls

    def record(self, graph_backend: GraphBackend, pool: Any, desc: BatchDescriptor,
               metadata: Any) -> PiecewiseRecording:
        t, model = desc.num_tokens, self.model
        positions = self.positions[:t]
        pieces: list[CapturedGraph] = []
        attn_out: list[torch.Tensor] = []
        x, residual = self.input_ids[:t], None
        for i in range(model.num_attention_calls + 1):
            fn, args = model.segment_call(i)
            piece = graph_backend.capture(partial(fn, *args, positions), pool, (x, residual))
            pieces.append(piece)
            if i == model.num_attention_calls:
                break
            inputs, residual = piece.output
            x = self._attention_buffer(i, model.attend(i, inputs, None))  # no cache: shapes only
            attn_out.append(x)
        return PiecewiseRecording(model, pieces, self.input_ids[:t], attn_out, self.build_attention_metadata)

    def _attention_buffer(self, i: int, like: torch.Tensor) -> torch.Tensor:
        buf = self._attn_out[i]
        t = like.shape[0]
        if buf is None or buf.shape[0] < t or buf.shape[1:] != like.shape[1:]:
            buf = self._attn_out[i] = torch.zeros_like(like)
        return buf[:t]
