"""Loading HF-named checkpoint tensors into mrv2 modules.

mrv2 fuses some HF projections (q/k/v into `qkv_proj`, gate/up into `gate_up_proj`)
and stacks MoE experts. A module declares how HF names map onto it:

- `hf_fused = {"q_proj": ("qkv_proj", 0), ...}`: an HF sub-module is shard i of a
  fused `Linear` child;
- `load_hf_weight(suffix, tensor) -> bool` and `missing_weights() -> list[str]`:
  the module loads (and accounts for) everything under it itself.

Everything else is copied into the parameter of the same name. A `QuantizedWeight`
(a GGUF tensor kept quantized) goes to its owner's `load_quantized(name, value)` where
the owner has one, and is dequantized into the parameter otherwise. Unknown names, shape
mismatches and parameters left unset all raise ValueError naming the tensor.

Under tensor parallelism a module holding a slice of a tensor says which through
`tp_slice(name, shard) -> (dim, start, length) | None`; a `LazyTensor` is then read only
that far (a rank never reads the rest of a layer).
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from mrv2.layers.linear import Linear, TPSlice
from mrv2.layers.quantization import QuantizedWeight
from mrv2.loader.gguf_quant import LazyQuantizedWeight
from mrv2.loader.safetensors_weights import LazyTensor


def read_part(tensor: torch.Tensor | QuantizedWeight | LazyTensor | LazyQuantizedWeight, part: TPSlice | None):
    """`tensor`, or its `part` (dim, start, length), read from the checkpoint if it is still lazy."""
    if isinstance(tensor, (LazyTensor, LazyQuantizedWeight)):
        return tensor.read(part)
    return tensor if part is None else tensor.narrow(*part)


def _part_for(module: nn.Module, name: str, shard: int | None) -> TPSlice | None:
    return module.tp_slice(name, shard) if hasattr(module, "tp_slice") else None


def load_hf_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor | QuantizedWeight]], *,
                    tied_lm_head: bool, ignore: tuple[str, ...] = ("rotary_emb.",)) -> None:
    """Load every tensor of `weights` into `model`; raise if one has no place or a parameter is left unset."""
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    custom: dict[str, nn.Module] = {}
    for name, tensor in weights:
        if any(s in name for s in ignore):
            continue
        name = name.removeprefix("model.")
        if name == "lm_head.weight":
            if tied_lm_head:
                continue
            name = "lm_head_weight"
        module, prefix, parts = model, "", name.split(".")
        while True:
            if hasattr(module, "load_hf_weight"):
                custom[prefix] = module
                suffix = ".".join(parts)
                if not module.load_hf_weight(suffix, read_part(tensor, _part_for(module, suffix, None))):
                    raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
                break
            fused = getattr(module, "hf_fused", {})
            if len(parts) == 2 and parts[0] in fused:
                child, shard = fused[parts[0]]
                target = f"{prefix}{child}.{parts[1]}"
                if target not in params:
                    raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
                linear = getattr(module, child)
                linear.load_shard(params[target], shard, read_part(tensor, _part_for(linear, parts[1], shard)))
                loaded.add(f"{target}#{shard}")
                break
            if len(parts) == 1 or not hasattr(module, parts[0]):
                target = prefix + ".".join(parts)
                tensor = read_part(tensor, _part_for(module, parts[0], None) if len(parts) == 1 else None)
                if isinstance(tensor, QuantizedWeight):
                    if len(parts) == 1 and hasattr(module, "load_quantized") and module.load_quantized(parts[0], tensor):
                        loaded.add(target)
                        break
                    tensor = tensor.dequantize(torch.float32)
                _copy(params, target, name, tensor)
                loaded.add(target)
                break
            module, prefix, parts = getattr(module, parts[0]), f"{prefix}{parts[0]}.", parts[1:]
    missing = sorted(_expected(model, params, tied_lm_head) - loaded)
    for prefix, module in custom.items():
        missing += [prefix + m for m in module.missing_weights()]
    custom_modules = [p for p, m in model.named_modules() if hasattr(m, "load_hf_weight")]
    missing += [p for p in custom_modules if p + "." not in custom]  # custom modules that got nothing at all
    if missing:
        raise ValueError(f"checkpoint is missing tensors: {missing[:8]}{' ...' if len(missing) > 8 else ''}")


def _copy(params: dict[str, nn.Parameter], target: str, name: str, tensor: torch.Tensor) -> None:
    if target not in params:
        raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
    copy_checked(params[target], name, tensor)


def copy_checked(param: torch.Tensor, name: str, tensor: torch.Tensor, owner: str = "the model") -> None:
    """Copy checkpoint tensor `name` into `param`; a ValueError naming both shapes if they differ."""
    if param.shape != tensor.shape:
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                         f"{owner} expects {tuple(param.shape)}")
    param.data.copy_(tensor)


def _expected(model: nn.Module, params: dict[str, nn.Parameter], tied_lm_head: bool) -> set[str]:
    custom = tuple(p + "." for p, m in model.named_modules() if hasattr(m, "load_hf_weight"))
    expected = set()
    for name in params:
        if custom and name.startswith(custom):
            continue
        module_name = name.rpartition(".")[0]
        module = model.get_submodule(module_name) if module_name else model
        if isinstance(module, Linear) and len(module.shard_sizes) > 1:
            expected.update(f"{name}#{i}" for i in range(len(module.shard_sizes)))
        else:
            expected.add(name)
    if tied_lm_head:
        expected.discard("lm_head_weight")
    return expected
