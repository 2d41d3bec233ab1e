"""DeepSeek-V3's multi-token-prediction (MTP) layer as a draft head (`mrv2.models.draft_head.DraftHead`).

DeepSeek-V3 checkpoints append `num_nextn_predict_layers` MTP layers after the last decoder
layer, named `model.layers.{num_hidden_layers + k}.*`. Each holds its own token embedding
(`embed_tokens`, a copy of the target's), two norms (`enorm`, `hnorm`), a projection
`eh_proj` [H, 2H], one DeepSeek decoder block (`self_attn.*`, `mlp.*`, the two layer norms;
MoE or dense by the layer index, as in the target) and an output head (`shared_head.norm`,
`shared_head.head`).

At position i the layer reads the token at i + 1 and the target's final, normed hidden
state at i:

    x = eh_proj(cat([enorm(embed(token)), hnorm(feature)]))
    out = block(x) (hidden + residual: the block's output before any final norm)
    logits = shared_head.head(shared_head.norm(out))

`out` is also the feature of the next draft pass. Like vLLM with one MTP layer, every draft
pass runs the first MTP layer (index num_hidden_layers); later ones are ignored. Unlike
vLLM, the embedding at position 0 is not zeroed (see `DeepseekMTPHead.forward`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from mrv2.attention.torch_mla import TorchMLAAttention
from mrv2.kv_spec import KVCacheSpec, KVPart
from mrv2.layers.embedding import VocabEmbedding
from mrv2.layers.linear import Linear, pack_linears
from mrv2.layers.mlp import GatedMLP
from mrv2.layers.moe import FusedMoE
from mrv2.layers.norm import RMSNorm
from mrv2.layers.quantization import QuantizedWeight
from mrv2.layers.rotary import RotaryEmbedding
from mrv2.models.base import PreNormBlock
from mrv2.models.deepseek import DeepseekConfig, MLAAttention
from mrv2.models.weights import copy_checked, load_hf_weights

# Checkpoint names (after `model.layers.{i}.`) that belong to the MTP layer itself; the rest
# (self_attn, mlp, input_layernorm, post_attention_layernorm) are its decoder block's.
_LAYER_PARTS = ("embed_tokens", "enorm", "hnorm", "eh_proj", "shared_head")
# Tensors a checkpoint may leave out: the head then shares the target's (`bind_target`).
_SHAREABLE = ("embed_tokens.weight", "shared_head.head.weight")


class _LayerTensorError(ValueError):
    """A ValueError `load_weights` raises itself, naming the checkpoint tensor in full."""


class SharedHead(nn.Module):
    """The MTP layer's output norm and LM head (`head` None: the target's LM head serves)."""

    def __init__(self, cfg: DeepseekConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.head: Linear | None = Linear(cfg.hidden_size, [cfg.vocab_size], False, dtype)


class DeepseekMTPHead(nn.Module):
    """The first MTP layer of a DeepSeek-V3 checkpoint; implements `DraftHead`."""

    aux_layer_ids: tuple[int, ...] = ()  # the features are the target's final, normed hidden states

    def __init__(self, cfg: DeepseekConfig, backend: TorchMLAAttention, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = cfg
        self.dtype = dtype
        self.layer_index = cfg.num_layers  # checkpoint layer index of the (first) MTP layer
        self.feature_size = cfg.hidden_size
        self.next_feature_size = cfg.hidden_size
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.embed_tokens: VocabEmbedding | None = VocabEmbedding(cfg.vocab_size, h, dtype)
        self.enorm = RMSNorm(h, eps, dtype)
        self.hnorm = RMSNorm(h, eps, dtype)
        self.eh_proj = Linear(2 * h, [h], False, dtype)
        rotary = RotaryEmbedding(cfg.qk_rope_head_dim, cfg.max_position, cfg.rope, dtype, cfg.rotary_style)
        mlp = (FusedMoE(cfg.moe, dtype) if cfg.is_moe_layer(self.layer_index) else
               GatedMLP(h, cfg.intermediate_size, cfg.mlp_bias, dtype, cfg.hidden_act))
        self.mtp_block = PreNormBlock(h, eps, MLAAttention(cfg, backend, rotary, dtype), mlp, dtype)
        self.shared_head = SharedHead(cfg, dtype)
        # The target model, once bound; a tuple so that torch does not register it as a submodule.
        self._target: tuple[nn.Module, ...] = ()

    # --- DraftHead ---------------------------------------------------------------------------

    def bind_target(self, target: nn.Module) -> None:
        """Use the target's embedding / LM head where the checkpoint has none for the MTP layer.

        May come before or after `load_weights`: what is shared is decided by what loaded.
        """
        self._target = (target,)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedWeight]]) -> None:
        """Load the MTP layer from the *whole* target checkpoint's tensors, ignoring every other one.

        Raises ValueError if the checkpoint has no MTP layer, if a tensor of the layer has no
        place in the head, or if a head parameter is left unset (the token embedding and LM
        head excepted: without them the head shares the target's).
        """
        prefix = f"model.layers.{self.layer_index}."
        own = {name: p for name, p in self.named_parameters() if not name.startswith("mtp_block.")}
        held: dict[str, torch.Tensor] = {}

        def block_tensors() -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
            # Holds the layer's own tensors on the way; yields the block's, renamed, to load_hf_weights.
            seen = 0
            for name, tensor in weights:
                if not name.startswith(prefix):
                    continue
                seen += 1
                suffix = name[len(prefix):]
                if suffix.split(".")[0] not in _LAYER_PARTS:
                    yield suffix, tensor
                    continue
                if suffix not in own:
                    raise _LayerTensorError(f"checkpoint tensor {name!r} has no place in the MTP head")
                held[suffix] = tensor.dequantize(torch.float32) if isinstance(tensor, QuantizedWeight) else tensor
            if not seen:
                raise _LayerTensorError(f"the checkpoint has no multi-token-prediction layer: no tensor is "
                                        f"named {prefix}* (the layer after its {self.layer_index} decoder layers)")

        try:
            load_hf_weights(self.mtp_block, block_tensors(), tied_lm_head=False)
        except _LayerTensorError:
            raise
        except ValueError as exc:  # load_hf_weights names the block's tensors without the layer prefix
            raise ValueError(f"MTP layer {prefix}*: {exc}") from exc
        for suffix, tensor in held.items():
            copy_checked(own[suffix], prefix + suffix, tensor, "the MTP head")
        loaded = held.keys()
        missing = sorted(prefix + n for n in own.keys() - loaded if n not in _SHAREABLE)
        if missing:
            raise ValueError(f"checkpoint is missing tensors of the MTP layer: {missing}")
        if "embed_tokens.weight" not in loaded:
            self.embed_tokens = None
        if "shared_head.head.weight" not in loaded:
            self.shared_head.head = None

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        c = self.config
        return [KVCacheSpec((KVPart("latent", 1, c.kv_lora_rank), KVPart("rope", 1, c.qk_rope_head_dim)),
                            self.dtype)]

    def pack_linear_weights(self, rows_hint: int) -> int:
        return pack_linears(self, rows_hint)  # the target's shared modules are not submodules: not repacked

    def attention_layers(self) -> list[nn.Module]:
        return [self.mtp_block.self_attn]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, features: torch.Tensor,
                attn_metadata: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens at i + 1, positions i, features [T, H] at i -> (hidden, next features), both [T, H].

        `attn_metadata` None: causal attention over the given tokens as one sequence, no cache.
        vLLM zeroes the embedding where the position is 0; that input is a real token here (the
        one after the prompt's first), so it is kept, as in DeepSeek's training (vLLM #33299).
        """
        block = self.mtp_block
        e = self.enorm(self._embedding()(input_ids))
        h = self.hnorm(features.to(e.dtype))
        x = self.eh_proj(torch.cat([e, h], dim=-1))
        inputs, residual = block.start(positions, x, None)
        x, residual = block.finish(block.self_attn.attend(inputs, attn_metadata), residual)
        out = x + residual
        return out, out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [rows, vocab] through the MTP layer's norm and head (or the target's LM head)."""
        normed = self.shared_head.norm(hidden)
        if self.shared_head.head is not None:
            return self.shared_head.head(normed).float()
        # The target's LM head in whatever form it runs (dense, packed, int4, tiled).
        return self._bound_target("LM head").compute_logits(normed)

    # --- helpers ------------------------------------------------------------------------------

    def _embedding(self) -> nn.Module:
        if self.embed_tokens is not None:
            return self.embed_tokens
        return self._bound_target("token embedding").embed_tokens

    def _bound_target(self, what: str) -> nn.Module:
        if not self._target:
            raise RuntimeError(f"the checkpoint's MTP layer has no {what}: call bind_target(target) to share "
                               f"the target model's")
        return self._target[0]


def build_mtp_head(head_hf_config: Any, target_hf_config: Any, backend: TorchMLAAttention, dtype: torch.dtype,
                   max_model_len: int) -> DeepseekMTPHead:
    """An uninitialised MTP head (weights via `load_weights`); for MTP both configs are the target's.

    The rotary cache covers `max_model_len` positions. Raises ValueError if the config says
    the checkpoint has no MTP layer (num_nextn_predict_layers 0) or the configs disagree.
    """
    n = getattr(head_hf_config, "num_nextn_predict_layers", None)
    if n is not None and n < 1:
        raise ValueError(f"num_nextn_predict_layers is {n}: the checkpoint has no multi-token-prediction "
                         "layer to draft with")
    if head_hf_config is not target_hf_config:
        for field in ("hidden_size", "vocab_size", "num_hidden_layers"):
            a, b = getattr(head_hf_config, field, None), getattr(target_hf_config, field, None)
            if a != b:
                raise ValueError(f"the MTP head's {field} ({a}) differs from the target's ({b}); "
                                 "MTP layers live in the target's own checkpoint")
    cfg = DeepseekConfig.from_hf(head_hf_config)
    return DeepseekMTPHead(replace(cfg, max_position=max_model_len), backend, dtype)
