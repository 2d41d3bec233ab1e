"""Multi-head latent attention (DeepSeek V2/V3) over a paged latent cache, in torch ops.

The cache holds per token only the compressed latent (`kv_lora_rank`) and the
rotated rope key (`qk_rope_head_dim`): parts "latent" and "rope", joint or split.
Two ways to attend, which agree to rounding:

- absorbed: W_UK is folded into the query (q_nope @ W_UK -> latent space) and W_UV is
  applied after attention, so attention is multi-query over [latent | rope] with the
  latent as the value. Reads only the latent cache: used for decodes.
- up-projected: the group's latents are expanded through kv_b_proj into per-head keys
  and values, then standard attention. Cheaper per query token for long chunks: used
  for prefill.

`prefill_absorbed` / `decode_absorbed` override the choice per group (tests compare the
two paths, `mrv2 bench mla` times them).

Metadata (decode/prefill groups, block gathers, masks) is the same as the GQA backend's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mrv2.attention.registry import register_backend
from mrv2.attention.torch_paged import TorchPagedAttention, TorchPagedMetadata, _Group
from mrv2.kv_spec import LayerKVCache


def _masked_softmax(scores: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    # SDPA would fall back to its unfused math path here (value dim != query dim), which
    # copies K/V per head: explicit matmul-softmax-matmul measured several times faster.
    return torch.softmax(scores.mul_(scale).masked_fill_(~mask, float("-inf")), dim=-1)


@register_backend
class TorchMLAAttention(TorchPagedAttention):
    """Reference MLA backend; runs wherever torch runs."""

    name = "torch-mla"
    kind = "mla"

    def __init__(self, prefill_absorbed: bool = False, decode_absorbed: bool = True) -> None:
        self.prefill_absorbed = prefill_absorbed
        self.decode_absorbed = decode_absorbed

    def forward_mla(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor,
                    w_kv_b: torch.Tensor, cache: LayerKVCache | None, metadata: TorchPagedMetadata | None,
                    scale: float) -> torch.Tensor:
        """Write the latent and rope key into `cache`, then attend.

        q_nope [T, H, nope], q_pe [T, H, rope], latent [T, kv_lora], k_pe [T, rope],
        w_kv_b [H, nope + v, kv_lora] (kv_b_proj's weight by head) -> [T, H, v].
        """
        if metadata is None:
            return self._causal_up_projected(q_nope, q_pe, latent, k_pe, w_kv_b, scale)
        num_tokens = metadata.slot_mapping.shape[0]
        cache["latent"].flatten(0, 1).index_copy_(0, metadata.slot_mapping, latent[:num_tokens, None])
        cache["rope"].flatten(0, 1).index_copy_(0, metadata.slot_mapping, k_pe[:num_tokens, None])
        nope = q_nope.shape[-1]
        out = q_nope.new_empty(q_nope.shape[0], q_nope.shape[1], w_kv_b.shape[1] - nope)
        if metadata.decode is not None:
            g = metadata.decode
            n = g.num_rows
            fn = self._absorbed if self.decode_absorbed else self._up_projected
            out[:n] = fn(q_nope[:n, :, None], q_pe[:n, :, None], cache, g, w_kv_b, scale)[:, :, 0]
        for g in metadata.prefills:
            qn, qp = q_nope[g.query_index].transpose(1, 2), q_pe[g.query_index].transpose(1, 2)  # [P, H, Lq, *]
            fn = self._absorbed if self.prefill_absorbed else self._up_projected
            o = fn(qn, qp, cache, g, w_kv_b, scale)  # [P, H, Lq, v]
            out[g.token_start:g.token_end] = o.transpose(1, 2).flatten(0, 1)[g.out_index]
        return out

    @staticmethod
    def _gather_latent(cache: LayerKVCache, g: _Group) -> tuple[torch.Tensor, torch.Tensor]:
        """[R, num_keys, kv_lora] latents and [R, num_keys, rope] keys of the group's blocks."""
        kv_lora = cache["latent"].shape[-1]
        if cache.joint is not None:
            row = cache.joint.index_select(0, g.blocks).view(g.num_rows, g.num_keys, -1)
            return row[..., :kv_lora], row[..., kv_lora:]
        latent = cache["latent"].index_select(0, g.blocks).view(g.num_rows, g.num_keys, -1)
        rope = cache["rope"].index_select(0, g.blocks).view(g.num_rows, g.num_keys, -1)
        return latent, rope

    def _absorbed(self, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: LayerKVCache, g: _Group,
                  w_kv_b: torch.Tensor, scale: float) -> torch.Tensor:
        nope = q_nope.shape[-1]
        w_uk, w_uv = w_kv_b[:, :nope], w_kv_b[:, nope:]  # [H, nope, kv_lora], [H, v, kv_lora]
        q_latent = torch.einsum("rhqn,hnl->rhql", q_nope, w_uk)
        q = torch.cat([q_latent, q_pe], dim=-1)  # [R, H, Lq, kv_lora + rope]
        latent, rope = self._gather_latent(cache, g)
        k = torch.cat([latent, rope], dim=-1)  # one key head shared by all query heads
        r, h, lq, d = q.shape
        # All heads' queries against the one key head: a single batched matmul, no K/V copies per head.
        scores = torch.matmul(q.reshape(r, h * lq, d), k.transpose(1, 2)).view(r, h, lq, -1)
        probs = _masked_softmax(scores, g.mask, scale)
        o = torch.matmul(probs.view(r, h * lq, -1), latent).view(r, h, lq, -1)
        return torch.einsum("rhql,hvl->rhqv", o, w_uv)

    def _up_projected(self, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: LayerKVCache, g: _Group,
                      w_kv_b: torch.Tensor, scale: float) -> torch.Tensor:
        latent, rope = self._gather_latent(cache, g)
        k, v = self._expand(latent, rope, w_kv_b, q_nope.shape[-1])
        q = torch.cat([q_nope, q_pe], dim=-1)
        return torch.matmul(_masked_softmax(torch.matmul(q, k.transpose(-1, -2)), g.mask, scale), v)

    @staticmethod
    def _expand(latent: torch.Tensor, rope: torch.Tensor, w_kv_b: torch.Tensor,
                nope: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head keys [R, H, L, nope + rope] and values [R, H, L, v] from latents [R, L, kv_lora]."""
        kv = torch.einsum("rkl,hdl->rhkd", latent, w_kv_b)
        k_nope, v = kv[..., :nope], kv[..., nope:]
        k = torch.cat([k_nope, rope[:, None].expand(-1, k_nope.shape[1], -1, -1)], dim=-1)
        return k, v

    def _causal_up_projected(self, q_nope, q_pe, latent, k_pe, w_kv_b, scale) -> torch.Tensor:
        k, v = self._expand(latent[None], k_pe[None], w_kv_b, q_nope.shape[-1])
        q = torch.cat([q_nope, q_pe], dim=-1).transpose(0, 1)[None]
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)[0].transpose(0, 1)
