"""DeepSeek-V2/V3 mixture of experts: top-k router, stacked routed experts and shared experts.

Routing follows transformers' DeepseekV2TopkRouter / DeepseekV3TopkRouter in fp32. The routed experts run
sync-free: the (token, expert) pairs are sorted by expert and each expert's GEMM runs on its contiguous
segment through `grouped_mm`, with segment ends computed on the device. (torch runs bf16 grouped_mm as one
kernel on recent GPUs; its fallback for other dtypes loops over the groups on the host.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mrv2.distributed.parallel import SINGLE, TensorParallel
from mrv2.layers.batch_invariant import tiled_grouped_linear, tiled_linear
from mrv2.layers.mlp import ACTIVATIONS, GatedMLP


@torch.library.custom_op("mrv2::grouped_mm", mutates_args=())
def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """`F.grouped_mm(a, b, offs=offs)` as an opaque op.

    torch.compile (piecewise graphs) sees only its output shape: torch's own meta
    function for it accepts bf16 only, while the eager kernels run every float dtype.
    """
    return F.grouped_mm(a, b, offs=offs)


@grouped_mm.register_fake
def _(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return a.new_empty(a.shape[0], b.shape[-1])


@dataclass(frozen=True)
class MoEConfig:
    """The MoE block of a DeepSeek-V2/V3 layer, resolved from an HF config."""

    hidden_size: int
    moe_intermediate_size: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    topk_method: str  # "greedy", "group_limited_greedy" (V2) or "noaux_tc" (V3)
    scoring_func: str  # "softmax" (V2) or "sigmoid" (V3)
    norm_topk_prob: bool
    hidden_act: str = "silu"
    shared_bias: bool = False

    @staticmethod
    def from_hf(c: Any) -> "MoEConfig":
        if c.model_type == "deepseek_v2":
            if c.topk_method not in ("greedy", "group_limited_greedy"):
                raise ValueError(f"DeepSeek-V2 topk_method {c.topk_method!r} is not supported")
            # transformers' V2 router always uses softmax and never renormalizes the top-k weights.
            topk_method, scoring_func, norm = c.topk_method, "softmax", False
        elif c.model_type == "deepseek_v3":
            # transformers' V3 router ignores topk_method/scoring_func: always sigmoid + noaux_tc.
            topk_method, scoring_func, norm = "noaux_tc", "sigmoid", bool(c.norm_topk_prob)
        else:
            raise ValueError(f"no DeepSeek MoE for model_type {c.model_type!r}")
        if c.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act {c.hidden_act!r} is not supported")
        return MoEConfig(
            hidden_size=c.hidden_size, moe_intermediate_size=c.moe_intermediate_size,
            n_routed_experts=c.n_routed_experts, n_shared_experts=c.n_shared_experts or 0,
            num_experts_per_tok=c.num_experts_per_tok, n_group=c.n_group or 1, topk_group=c.topk_group or 1,
            routed_scaling_factor=float(c.routed_scaling_factor), topk_method=topk_method,
            scoring_func=scoring_func, norm_topk_prob=norm, hidden_act=c.hidden_act,
            shared_bias=bool(getattr(c, "mlp_bias", False)) and c.model_type == "deepseek_v2",
        )


class Router(nn.Module):
    """Top-k expert choice per token; returns fp32 weights [T, k] and expert ids [T, k]."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        e = cfg.n_routed_experts
        if e % cfg.n_group:
            raise ValueError(f"{e} experts do not split into {cfg.n_group} groups")
        self.weight = nn.Parameter(torch.empty(e, cfg.hidden_size, dtype=torch.float32), requires_grad=False)
        self.e_score_correction_bias = (
            nn.Parameter(torch.zeros(e, dtype=torch.float32), requires_grad=False)
            if cfg.topk_method == "noaux_tc" else None)
        self.row_tile = 0  # > 0: batch-invariant logits (`mrv2.layers.batch_invariant`)

    def _group_mask(self, choice: torch.Tensor, top2: bool) -> torch.Tensor:
        """[T, E] bool: the experts of each token's `topk_group` best groups."""
        c = self.cfg
        grouped = choice.view(-1, c.n_group, c.n_routed_experts // c.n_group)
        group_scores = grouped.topk(2, dim=-1)[0].sum(-1) if top2 else grouped.amax(-1)
        group_idx = group_scores.topk(c.topk_group, dim=-1, sorted=False)[1]
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
        return mask.unsqueeze(-1).expand_as(grouped).reshape(-1, c.n_routed_experts)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.cfg
        logits = (tiled_linear(x.float(), self.weight, None, self.row_tile) if self.row_tile
                  else F.linear(x.float(), self.weight))
        scores = logits.softmax(dim=-1) if c.scoring_func == "softmax" else logits.sigmoid()
        if c.topk_method == "noaux_tc":
            # The bias only steers the choice; the weights come from the unbiased scores.
            choice = scores + self.e_score_correction_bias
            choice = choice.masked_fill(~self._group_mask(choice, top2=True), float("-inf"))
        elif c.topk_method == "group_limited_greedy":  # group score = its best expert; masked experts score 0
            scores = scores.masked_fill(~self._group_mask(scores, top2=False), 0.0)
            choice = scores
        else:
            choice = scores
        ids = choice.topk(c.num_experts_per_tok, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if c.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * c.routed_scaling_factor, ids


_PROJS = ("gate_proj", "up_proj", "down_proj")


def _rows(fused: torch.Tensor, proj: str) -> torch.Tensor:
    """The rows of `proj` in a gate/up-fused tensor (all of a down projection)."""
    return fused if proj == "down_proj" else fused.chunk(2)[int(proj == "up_proj")]


class FusedMoE(nn.Module):
    """Routed experts stacked as w13 [E, 2I, H] (gate rows, then up rows) and w2 [E, H, I], plus shared experts.

    Under tensor parallelism every rank routes every token and holds I / tp intermediate features
    of every expert (vLLM's tensor-parallel MoE): gate/up split by rows, down by columns, and the
    ranks' partial outputs are summed.
    """

    def __init__(self, cfg: MoEConfig, dtype: torch.dtype, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.cfg = cfg
        self.tp = tp
        e, h = cfg.n_routed_experts, cfg.hidden_size
        self._first, i = tp.split(cfg.moe_intermediate_size, "expert intermediate features")
        self.act = ACTIVATIONS[cfg.hidden_act]
        self.gate = Router(cfg)
        self.w13 = nn.Parameter(torch.empty(e, 2 * i, h, dtype=dtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(e, h, i, dtype=dtype), requires_grad=False)
        self.shared_experts = (GatedMLP(h, cfg.moe_intermediate_size * cfg.n_shared_experts, cfg.shared_bias, dtype,
                                        cfg.hidden_act, tp)
                               if cfg.n_shared_experts else None)
        self.register_buffer("expert_ids", torch.arange(e), persistent=False)
        self._expected = self._expected_names()
        self._loaded: set[str] = set()
        self.row_tile = 0  # > 0: batch-invariant expert GEMMs (`mrv2.layers.batch_invariant`)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t, k = x.shape[0], self.cfg.num_experts_per_tok
        weights, ids = self.gate(x)
        sorted_ids, order = ids.flatten().sort(stable=True)
        # offs[e] = end of expert e's segment among the sorted pairs, computed without leaving the device.
        offs = torch.searchsorted(sorted_ids, self.expert_ids, right=True, out_int32=True)
        if self.row_tile:
            gate, up = tiled_grouped_linear(x[order // k], self.w13, offs, self.row_tile).chunk(2, dim=-1)
            y = tiled_grouped_linear(self.act(gate) * up, self.w2, offs, self.row_tile)
        else:
            gate, up = grouped_mm(x[order // k], self.w13.transpose(1, 2), offs).chunk(2, dim=-1)
            y = grouped_mm(self.act(gate) * up, self.w2.transpose(1, 2), offs)
        y = y * weights.flatten()[order, None]  # fp32, like transformers
        # Undo the sort (a permutation, so deterministic) and sum each token's k experts in fp32.
        out = self.tp.all_reduce(torch.empty_like(y).index_copy_(0, order, y).view(t, k, x.shape[1]).sum(1))
        out = out.to(x.dtype)
        return out if self.shared_experts is None else out + self.shared_experts(x)

    def _expected_names(self) -> set[str]:
        names = {"gate.weight"}
        if self.gate.e_score_correction_bias is not None:
            names.add("gate.e_score_correction_bias")
        names.update(f"experts.{e}.{p}.weight" for e in range(self.cfg.n_routed_experts) for p in _PROJS)
        if self.shared_experts is not None:
            kinds = ("weight", "bias") if self.cfg.shared_bias else ("weight",)
            names.update(f"shared_experts.{p}.{k}" for p in _PROJS for k in kinds)
        return names

    def missing_weights(self) -> list[str]:
        """HF names (per-expert form, relative to `mlp.`) not loaded yet."""
        return sorted(self._expected - self._loaded)

    def tp_slice(self, suffix: str, shard: int | None) -> tuple[int, int, int] | None:
        """This rank's intermediate features of an expert tensor (the stacked gate_up is cut on load)."""
        if self.tp.size == 1 or suffix.startswith("gate.") or suffix == "experts.gate_up_proj":
            return None
        n = self.w2.shape[2]
        if suffix == "experts.down_proj":
            return 2, self._first, n
        if suffix.startswith("shared_experts."):
            _, proj, kind = suffix.split(".")
            mlp = self.shared_experts
            return (mlp.down_proj if proj == "down_proj" else mlp.gate_up_proj).tp_slice(kind, 0)
        return (1, self._first, n) if suffix.endswith("down_proj.weight") else (0, self._first, n)

    def load_hf_weight(self, suffix: str, tensor: torch.Tensor) -> bool:
        """Load one HF tensor named relative to `mlp.`; False if this module owns no such name.

        Experts may come per expert (`experts.{e}.gate_proj.weight`) or stacked as transformers 5 holds them
        (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]).
        """
        e = self.cfg.n_routed_experts
        done = [suffix]
        if suffix == "experts.gate_up_proj":
            dst = self.w13.data
            if self.tp.size > 1:  # gate rows then up rows: this rank's part of each
                full, n = tensor.shape[1] // 2, self.w2.shape[2]
                tensor = torch.cat([tensor[:, self._first:self._first + n],
                                    tensor[:, full + self._first:full + self._first + n]], dim=1)
            done = [f"experts.{x}.{p}.weight" for x in range(e) for p in _PROJS[:2]]
        elif suffix == "experts.down_proj":
            dst = self.w2.data
            done = [f"experts.{x}.down_proj.weight" for x in range(e)]
        elif suffix not in self._expected:
            return False
        elif suffix.startswith("experts."):
            _, ex, proj, _ = suffix.split(".")
            dst = _rows((self.w2 if proj == "down_proj" else self.w13).data[int(ex)], proj)
        elif suffix.startswith("gate."):
            dst = getattr(self.gate, suffix.split(".")[1]).data
        else:
            _, proj, kind = suffix.split(".")
            mlp = self.shared_experts
            dst = _rows(getattr(mlp.down_proj if proj == "down_proj" else mlp.gate_up_proj, kind).data, proj)
        if dst.shape != tensor.shape:
            raise ValueError(f"MoE tensor {suffix!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
        dst.copy_(tensor)
        self._loaded.update(done)
        return True
