"""The skeleton every mrv2 causal LM shares: pre-norm blocks between embeddings and LM head.

A model provides its attention and feed-forward modules and its KV-cache spec; the
embedding, residual stream, final norm, LM head and weight loading are here once.

The forward is a chain of segments split at attention calls: segment i runs from
attention call i-1 (or the embedding) to the inputs of attention call i (or the final
norm). Attention modules therefore come in three parts, `project` (positions, hidden
-> token-major attention inputs, rotary included), `attend` (inputs, metadata ->
output; the only part that reads or writes the KV cache) and `output`. The eager
forward runs the chain with attention inline; piecewise graphs capture each segment
and run attention eagerly between them (`mrv2.runner.graphs.piecewise`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from mrv2.config import DenseGemvPolicy, QuantPolicy
from mrv2.distributed.kv_transfer.base import KVConnectorWorker
from mrv2.distributed.parallel import SINGLE, TensorParallel
from mrv2.kv_spec import KVCacheSpec
from mrv2.layers.batch_invariant import ROW_TILE, tiled_linear
from mrv2.layers.embedding import VocabEmbedding
from mrv2.layers.linear import Linear, TPSlice, dense_linear, pack_linears, plain_fp32
from mrv2.layers.norm import RMSNorm
from mrv2.layers.packed import PACKED_DTYPES, pack_weight, packed_linear, packing_available
from mrv2.layers.quantization import (QuantizedMatmul, QuantizedWeight, block_gemvs, place_in_one_buffer,
                                      quantized_matmul)
from mrv2.layers.weight_buffer import into_one_buffer
from mrv2.models.weights import load_hf_weights


class SplitAttention(Protocol):
    """An attention module in the three parts segments are cut between."""

    def project(self, positions: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Token-major attention inputs (queries, keys, values or their MLA parts)."""

    def attend(self, inputs: tuple[torch.Tensor, ...], attn_metadata: Any) -> torch.Tensor:
        """Write the step's KV into the cache and attend; [tokens, ...] output."""

    def output(self, attn_out: torch.Tensor) -> torch.Tensor:
        """The output projection back to the hidden size."""

    def warm_up(self) -> None:
        """Let the attention backend prepare its kernels for this layer (after the KV cache is bound)."""


class PreNormBlock(nn.Module):
    """x + attn(norm(x)), then + mlp(norm(.)), with the residual add fused into the norms.

    `self_attn` implements `SplitAttention`; `start` runs up to its inputs, `finish` from its output on.
    """

    def __init__(self, hidden_size: int, eps: float, self_attn: nn.Module, mlp: nn.Module,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(hidden_size, eps, dtype)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(hidden_size, eps, dtype)
        self.mlp = mlp

    def start(self, positions: torch.Tensor, x: torch.Tensor,
              residual: torch.Tensor | None) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        return self.self_attn.project(positions, x), residual

    def finish(self, attn_out: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = self.post_attention_layernorm(self.self_attn.output(attn_out), residual)
        return self.mlp(x), residual


def _first_segment(embed: VocabEmbedding, block: PreNormBlock, positions: torch.Tensor, input_ids: torch.Tensor,
                   residual: None) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    return block.start(positions, embed(input_ids), None)


def _middle_segment(prev: PreNormBlock, block: PreNormBlock, positions: torch.Tensor, attn_out: torch.Tensor,
                    residual: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    x, residual = prev.finish(attn_out, residual)
    return block.start(positions, x, residual)


def _last_segment(prev: PreNormBlock, norm: RMSNorm, positions: torch.Tensor, attn_out: torch.Tensor,
                  residual: torch.Tensor) -> torch.Tensor:
    x, residual = prev.finish(attn_out, residual)
    return norm(x, residual)[0]


class CausalLM(nn.Module):
    """Embeddings -> PreNormBlocks -> final norm -> LM head (tied or not).

    Subclasses set `config` (with vocab_size, hidden_size, rms_norm_eps,
    tie_word_embeddings) and call `_build` with their blocks, then implement
    `kv_cache_specs` and `estimate_activation_bytes`. Under tensor parallelism (`tp`) the
    embedding and the LM head hold this rank's vocabulary rows; logits are gathered whole.
    """

    config: Any

    def _build(self, blocks: list[PreNormBlock], dtype: torch.dtype, tp: TensorParallel = SINGLE) -> None:
        c = self.config
        self.dtype = dtype
        self.tp = tp
        self.embed_tokens = VocabEmbedding(c.vocab_size, c.hidden_size, dtype, tp)
        self.layers = nn.ModuleList(blocks)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        if c.tie_word_embeddings:
            self.lm_head_weight = self.embed_tokens.weight
        else:
            self.lm_head_weight = nn.Parameter(torch.empty(self.embed_tokens.num_embeddings, c.hidden_size,
                                                           dtype=dtype), requires_grad=False)
        self._lm_head_quantized: QuantizedWeight | None = None
        self.lm_head_int4: QuantizedMatmul | None = None
        self.lm_head_int4_max_rows = 0
        self.lm_head_packed: torch.Tensor | None = None  # the dense LM head in oneDNN's layout
        self.lm_head_gemv: DenseGemvPolicy | None = None  # small batches on the platform's dense GEMV
        self.row_tile = 0  # > 0: batch-invariant LM head (`make_batch_invariant`)
        self.aux_hidden: torch.Tensor | None = None  # see `keep_aux_hidden`
        # Prefill/decode disaggregation: told around every attention call over the cache.
        self.kv_connector: KVConnectorWorker | None = None
        self._aux_columns: dict[int, slice] = {}

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        raise NotImplementedError

    def estimate_activation_bytes(self, num_tokens: int, num_logits: int) -> int:
        """Live activations of one step, from shapes (for platforms without peak statistics)."""
        raise NotImplementedError

    def attention_layers(self) -> list[nn.Module]:
        """The modules the runner binds KV-cache views to (`.kv_cache`), one per cache spec."""
        return [layer.self_attn for layer in self.layers]

    @property
    def num_attention_calls(self) -> int:
        return len(self.layers)

    def segment_call(self, i: int) -> tuple[Callable[..., Any], tuple[nn.Module, nn.Module]]:
        """Segment i as a plain function and the two modules it runs: fn(*modules, positions, x, residual).

        Every segment between two blocks is the same function of different blocks, so a
        compiled piece (one per token count) serves every layer.
        """
        if i == 0:
            return _first_segment, (self.embed_tokens, self.layers[0])
        if i == len(self.layers):
            return _last_segment, (self.layers[-1], self.norm)
        return _middle_segment, (self.layers[i - 1], self.layers[i])

    def segment(self, i: int, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None) -> Any:
        """The work between attention calls i-1 and i.

        Segment 0 takes the input ids as `x`; segment i > 0 takes attention output
        i-1 and the residual. Segments before the last return (attention inputs of
        call i, residual); the last (i == num_attention_calls) returns the final hidden states.
        """
        fn, modules = self.segment_call(i)
        return fn(*modules, positions, x, residual)

    def keep_aux_hidden(self, layer_ids: tuple[int, ...], max_tokens: int) -> None:
        """From now on every forward keeps the inputs of layers `layer_ids` (hidden + residual), side
        by side, in the persistent `aux_hidden` [max_tokens, len(layer_ids) * hidden] (Eagle-3's features)."""
        h = self.config.hidden_size
        for i in layer_ids:
            if not 0 <= i < self.num_attention_calls:
                raise ValueError(f"auxiliary hidden state layer {i} is not a layer of the target "
                                 f"({self.num_attention_calls} layers)")
        self._aux_columns = {i: slice(j * h, (j + 1) * h) for j, i in enumerate(layer_ids)}
        self.aux_hidden = torch.zeros(max_tokens, len(layer_ids) * h, dtype=self.dtype,
                                      device=self.norm.weight.device)

    def store_aux_hidden(self, i: int, residual: torch.Tensor) -> None:
        """After segment i: its residual is layer i's input (hidden + residual, summed by the fused norm)."""
        if (cols := self._aux_columns.get(i)) is not None:
            self.aux_hidden[:residual.shape[0], cols].copy_(residual)

    def attend(self, i: int, inputs: tuple[torch.Tensor, ...], attn_metadata: Any) -> torch.Tensor:
        """Attention call i over the KV cache (`attn_metadata` None: causal over the tokens, no cache)."""
        if self.kv_connector is None or attn_metadata is None:
            return self.layers[i].self_attn.attend(inputs, attn_metadata)
        self.kv_connector.wait_for_layer_load(i)
        out = self.layers[i].self_attn.attend(inputs, attn_metadata)
        self.kv_connector.save_kv_layer(i)  # layer i's KV for this step is written: it can travel now
        return out

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: Any) -> torch.Tensor:
        x, residual = input_ids, None
        for i in range(self.num_attention_calls):
            inputs, residual = self.segment(i, positions, x, residual)
            self.store_aux_hidden(i, residual)
            x = self.attend(i, inputs, attn_metadata)
        return self.segment(self.num_attention_calls, positions, x, residual)

    def compute_logits(self, hidden: torch.Tensor, chunk_rows: int | None = None) -> torch.Tensor:
        """fp32 logits [rows, vocab]; `chunk_rows` splits the LM head by vocabulary rows (see Platform)."""
        return self.tp.all_gather(self._local_logits(hidden, chunk_rows))

    def tp_slice(self, name: str, shard: int | None) -> TPSlice | None:
        """An untied LM head's rows: the embedding's vocabulary slice."""
        return self.embed_tokens.tp_slice(name, shard) if name == "lm_head_weight" else None

    def _local_logits(self, hidden: torch.Tensor, chunk_rows: int | None) -> torch.Tensor:
        if self.row_tile:
            return tiled_linear(hidden, self.lm_head_weight, None, self.row_tile).float()
        dense = self.lm_head_weight is not None or self.lm_head_packed is not None
        if self.lm_head_int4 is not None and (not dense or hidden.shape[0] <= self.lm_head_int4_max_rows):
            return self.lm_head_int4(hidden, torch.float32)
        gemv = self.lm_head_gemv
        if gemv is not None and (hidden.shape[0] <= gemv.max_rows or gemv.onednn_above):
            return dense_linear(hidden, self.lm_head_weight, None, gemv)  # one call, in threads
        if self.lm_head_packed is not None:  # one call: oneDNN blocks the packed vocabulary itself
            return packed_linear(hidden, self.lm_head_packed, None).float()
        if chunk_rows is None or chunk_rows >= self.lm_head_weight.shape[0]:
            return F.linear(hidden, self.lm_head_weight).float()
        out = hidden.new_empty(hidden.shape[0], self.lm_head_weight.shape[0])
        for start in range(0, out.shape[1], chunk_rows):
            w = self.lm_head_weight[start:start + chunk_rows]
            torch.mm(hidden, w.t(), out=out[:, start:start + w.shape[0]])
        return out.float()

    def make_batch_invariant(self, tile: int = ROW_TILE) -> None:
        """Run every matmul with weights (linears, LM head, MoE router and experts) in fixed tiles of
        `tile` rows, so that a row's output does not depend on the batch (`mrv2.layers.batch_invariant`).

        Needs dense, unpacked weights: call it after loading, instead of quantized kernels or packing.
        """
        for m in self.modules():
            if isinstance(m, Linear) and (m.int4 is not None or m.weight is None):
                raise ValueError("batch-invariant mode needs dense weights: load quantized GGUF weights "
                                 "dequantized (quantization=None) and do not prepack them")
            if hasattr(m, "row_tile"):
                m.row_tile = tile
        if self.lm_head_int4 is not None or self.lm_head_weight is None:
            raise ValueError("batch-invariant mode needs a dense LM head (quantization=None)")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors; raise if any parameter is left unset or a name is unknown."""
        load_hf_weights(self, weights, tied_lm_head=self.config.tie_word_embeddings)

    def load_quantized(self, name: str, value: QuantizedWeight) -> bool:
        """An untied LM head arriving quantized (placed by `finalize_quantization`)."""
        if name != "lm_head_weight" or self.config.tie_word_embeddings:
            return False
        if tuple(value.shape) != tuple(self.lm_head_weight.shape):
            raise ValueError(f"checkpoint tensor 'lm_head.weight' has shape {tuple(value.shape)}, "
                             f"the model expects {tuple(self.lm_head_weight.shape)}")
        self._lm_head_quantized = value
        return True

    def int4_rows(self) -> int:
        """Steps up to this many tokens run every linear layer through the int4 kernel (0: some never do)."""
        rows = [m.int4_max_rows if m.int4 is not None else 0 for m in self.modules() if isinstance(m, Linear)]
        return min(rows, default=0)

    def pack_linear_weights(self, rows_hint: int) -> int:
        """Prepack every packable dense linear weight and the LM head for oneDNN (`layers/packed.py`);
        how many were.

        A tied LM head is packed as a copy (the embedding keeps its table for lookups): at 64 rows
        the default model's head ran 2.5x faster packed than as row chunks through `torch.mm`.
        """
        if not packing_available():
            return 0
        packed = pack_linears(self, rows_hint)
        if self.lm_head_weight is not None and self.lm_head_weight.dtype in PACKED_DTYPES:
            self.lm_head_packed = pack_weight(self.lm_head_weight, rows_hint)
            if not self.config.tie_word_embeddings:
                self.lm_head_weight = None
            packed += 1
        return packed

    def use_dense_gemv(self, policy: DenseGemvPolicy, allocate: Callable[[int], torch.Tensor] | None = None) -> int:
        """Run small batches of every plain float32 linear weight and of the LM head on the platform's dense
        GEMV (`layers/linear.py`); how many weights do. Call it after loading, instead of packing.

        With `allocate` (a platform's `weight_storage`) those weights move into one buffer from it, in the order
        a step reads them: on the CPU, 2 MiB pages, where a batch-1 step in float32 streams ~540 MB of weights
        with fewer TLB misses and fewer restarts of the hardware prefetchers (see the platform's note).
        """
        weights = [m.weight for m in self.modules() if isinstance(m, Linear) and m.use_dense_gemv(policy)]
        if (plain_fp32(self.lm_head_weight) and self.lm_head_int4 is None and self.lm_head_packed is None
                and not self.row_tile):
            self.lm_head_gemv = policy
            weights.append(self.lm_head_weight)
        if allocate is not None and weights:
            for param, view in zip(weights, into_one_buffer([w.data for w in weights], allocate)):
                param.data = view  # a tied LM head is the embedding's own parameter: both read the copy
        return len(weights)

    def finalize_quantization(self, policy: QuantPolicy,
                              allocate: Callable[[int], torch.Tensor] | None = None) -> str | None:
        """Place the weights that loaded quantized: int4 kernels for batches up to `policy.int4_max_rows`
        rows, and a dense copy for larger ones if all of it fits `policy.dense_budget` (else int4 only).
        With `allocate` (a platform's `weight_storage`), the block GEMVs' weights move into one buffer
        from it, layer by layer in the order a step reads them, then the LM head.

        Returns a line for the log, None when nothing loaded quantized.
        """
        linears = [m for m in self.modules() if isinstance(m, Linear)]
        embed, tied = self.embed_tokens, self.config.tie_word_embeddings
        head = embed.quantized if tied else self._lm_head_quantized
        tables = [embed.quantized] if tied else [embed.quantized, head]
        dense = sum(m.quantized_dense_bytes() for m in linears)
        dense += sum(q.shape.numel() * self.dtype.itemsize for q in tables if q is not None)
        if dense == 0:
            return None
        keep_dense = dense <= policy.dense_budget
        for m in linears:
            m.finalize_quantization(policy, keep_dense)
        if head is not None and (matmul := quantized_matmul(head, self.dtype, policy)) is not None:
            self.lm_head_int4, self.lm_head_int4_max_rows = matmul, policy.int4_max_rows
        head_dense = keep_dense or self.lm_head_int4 is None
        embed.finalize_quantization(keep_dense or (tied and head_dense))
        if tied:
            self.lm_head_weight = embed.weight
        elif self._lm_head_quantized is not None:
            if head_dense:
                self.lm_head_weight.data.copy_(self._lm_head_quantized.dequantize(torch.float32))
            else:
                self.lm_head_weight = None
        if embed.weight is not None:
            embed.quantized = None  # the dense table serves lookups; the LM head has its own packs
        self._lm_head_quantized = None
        gemvs = [g for matmul in [m.int4 for m in linears] + [self.lm_head_int4] for g in block_gemvs(matmul)]
        if allocate is not None and gemvs:
            place_in_one_buffer(gemvs, allocate)
        int4 = sum(m.int4.nbytes for m in linears if m.int4 is not None)
        int4 += self.lm_head_int4.nbytes if self.lm_head_int4 is not None else 0
        if policy.gemm_isa:
            return f"quantized kernels ({int4 / 2**20:.0f} MiB, GEMV and GEMM tile layouts) for every batch"
        return (f"quantized kernels ({int4 / 2**20:.0f} MiB) for batches of up to {policy.int4_max_rows} rows; "
                + (f"a dense copy ({dense / 2**20:.0f} MiB) for larger ones" if keep_dense else
                   f"no dense copy ({dense / 2**20:.0f} MiB would exceed the budget of "
                   f"{policy.dense_budget / 2**20:.0f} MiB): quantized for every batch"))
