"""Building a drafter for `SpeculativeConfig`: a draft model, an Eagle / Eagle-3 head, or DeepSeek MTP.

Every drafter is built on the target's attention backend and dtype, so its layers'
KV cache is cut from the same blocks as the target's (see `mrv2.spec_decode.drafter`).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mrv2.attention.backend import AttentionBackend
from mrv2.config import SpeculativeConfig
from mrv2.kv_spec import KVCacheSpec
from mrv2.models.base import CausalLM
from mrv2.spec_decode.drafter import Drafter


class DraftModel(nn.Module):
    """A whole causal LM as a drafter: it reads token i at position i and no target features."""

    feature_size = next_feature_size = 0
    aux_layer_ids: tuple[int, ...] = ()

    def __init__(self, model: CausalLM) -> None:
        super().__init__()
        self.model = model

    def bind_target(self, target: nn.Module) -> None:
        """Nothing to share: a draft model has its own embedding and LM head."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.model.load_weights(weights)

    def pack_linear_weights(self, rows_hint: int) -> int:
        return self.model.pack_linear_weights(rows_hint)

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        return self.model.kv_cache_specs()

    def attention_layers(self) -> list[nn.Module]:
        return self.model.attention_layers()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, features: torch.Tensor | None,
                attn_metadata: Any) -> tuple[torch.Tensor, None]:
        return self.model(input_ids, positions, attn_metadata), None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)


def _build_head(method: str, hf_config: Any, target_hf_config: Any, backend: AttentionBackend,
                dtype: torch.dtype, max_model_len: int, device: torch.device) -> nn.Module:
    """The drafter's model for `method`, uninitialised (weights are loaded afterwards)."""
    from mrv2.loader.resolve import check_architecture

    with torch.device(device):
        if method == "draft_model":
            from mrv2.models.registry import build_model

            check_architecture(hf_config)
            if hf_config.vocab_size != target_hf_config.vocab_size:
                raise ValueError(f"the draft model's vocabulary ({hf_config.vocab_size} tokens) differs from the "
                                 f"target's ({target_hf_config.vocab_size}): it must share the tokenizer")
            return DraftModel(build_model(hf_config, backend, dtype, max_model_len))
        if method in ("eagle", "eagle3"):
            from mrv2.models.architectures import EAGLE3_ARCHITECTURES, EAGLE_ARCHITECTURES
            from mrv2.models.eagle import build_eagle3_head, build_eagle_head

            check_architecture(hf_config, EAGLE_ARCHITECTURES if method == "eagle" else EAGLE3_ARCHITECTURES)
            build = build_eagle_head if method == "eagle" else build_eagle3_head
            return build(hf_config, target_hf_config, backend, dtype, max_model_len)
        from mrv2.models.architectures import MLA_ARCHITECTURES
        from mrv2.models.deepseek_mtp import build_mtp_head

        check_architecture(hf_config, MLA_ARCHITECTURES)
        return build_mtp_head(hf_config, target_hf_config, backend, dtype, max_model_len)


def build_drafter(spec: SpeculativeConfig, target: CausalLM, target_hf_config: Any, target_path: Path,
                  backend: AttentionBackend, dtype: torch.dtype, max_num_reqs: int, max_num_tokens: int,
                  max_model_len: int, block_size: int, device: torch.device) -> Drafter:
    """Load the drafter `spec` names, bound to `target` (features, shared embedding / LM head)."""
    from transformers import AutoConfig

    from mrv2.loader.checkpoint_weights import iter_checkpoint_weights
    from mrv2.loader.errors import UnsupportedArchitectureError
    from mrv2.loader.resolve import resolve_model_path
    from mrv2.loader.safetensors_weights import iter_safetensors_weights

    method = spec.method
    path = resolve_model_path(spec.model) if spec.model is not None else target_path
    hf_config = AutoConfig.from_pretrained(path) if spec.model is not None else target_hf_config
    try:
        head = _build_head(method, hf_config, target_hf_config, backend, dtype, max_model_len, device)
    except UnsupportedArchitectureError as e:
        what = {"draft_model": "a causal LM", "eagle": "an Eagle-1 head", "eagle3": "an Eagle-3 head",
                "mtp": "a DeepSeek-V2/V3 checkpoint with MTP layers"}[method]
        source = f"model {spec.model!r}" if spec.model is not None else "the target model"
        raise ValueError(f"speculative_config method {method!r} needs {what}, but {source} is "
                         f"{e.architecture!r} (supported: {', '.join(e.supported)})") from e
    # Eagle heads are often published as pytorch_model.bin; an MTP layer sits in the target's checkpoint.
    weights = iter_checkpoint_weights(path) if method in ("eagle", "eagle3") else iter_safetensors_weights(path)
    head.bind_target(target)
    head.load_weights(weights)
    head.eval()
    if head.aux_layer_ids:
        target.keep_aux_hidden(head.aux_layer_ids, max_num_tokens)
    return Drafter(head, spec.num_speculative_tokens, shifted=method != "draft_model", backend=backend,
                   max_num_reqs=max_num_reqs, max_model_len=max_model_len, block_size=block_size, dtype=dtype,
                   device=device, probabilistic=spec.draft_sampling == "probabilistic",
                   vocab_size=target_hf_config.vocab_size)
