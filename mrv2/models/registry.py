"""Map HF `architectures` names to mrv2 model classes."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import nn

from mrv2.attention.backend import AttentionBackend
from mrv2.distributed.parallel import SINGLE, TensorParallel
from mrv2.models.architectures import DECODER_ARCHITECTURES, MLA_ARCHITECTURES, SUPPORTED_ARCHITECTURES
from mrv2.models.decoder import DecoderConfig, DecoderForCausalLM
from mrv2.loader.errors import UnsupportedArchitectureError


def architecture_of(hf_config: Any) -> str:
    archs = getattr(hf_config, "architectures", None) or []
    if not archs:
        raise ValueError("config.json names no architecture ('architectures' is empty)")
    return archs[0]


def attention_kind(hf_config: Any) -> str:
    """Which attention backend kind the architecture needs: "gqa" or "mla"."""
    return "mla" if architecture_of(hf_config) in MLA_ARCHITECTURES else "gqa"


def build_model(hf_config: Any, backend: AttentionBackend, dtype: torch.dtype,
                max_model_len: int | None = None, tp: TensorParallel = SINGLE) -> nn.Module:
    """An uninitialised model for `hf_config` (weights are loaded afterwards).

    The shared rotary cache covers `max_model_len` positions (default: the config's
    max_position_embeddings); no position the engine runs reaches past it.
    """
    arch = architecture_of(hf_config)
    if arch in DECODER_ARCHITECTURES:
        cfg = DecoderConfig.from_hf(hf_config)
        return DecoderForCausalLM(replace(cfg, max_position=max_model_len or cfg.max_position), backend, dtype, tp)
    if arch in MLA_ARCHITECTURES:
        from mrv2.models.deepseek import DeepseekConfig, DeepseekForCausalLM

        cfg = DeepseekConfig.from_hf(hf_config)
        return DeepseekForCausalLM(replace(cfg, max_position=max_model_len or cfg.max_position), backend, dtype, tp)
    raise UnsupportedArchitectureError(arch, SUPPORTED_ARCHITECTURES)
