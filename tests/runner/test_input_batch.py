"""InputBuffers.prepare: the per-step device gather against a naive Python computation."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from mrv2.engine.scheduler_output import NewRequestData
from mrv2.runner.block_table import BlockTables
from mrv2.runner.input_batch import InputBuffers
from mrv2.runner.states import RequestStates
from mrv2.sampling_params import SamplingParams

CPU = torch.device("cpu")
MAX_REQS, MAX_LEN, MAX_TOKENS = 8, 64, 96


@dataclass
class Req:
    tokens: list[int]
    computed: int
    blocks: list[int]
    slot: int = -1


class World:
    """RequestStates + BlockTables + InputBuffers, and a naive mirror of what they hold."""

    def __init__(self, block_size: int, seed: int = 0) -> None:
        self.bs = block_size
        self.max_blocks = -(-MAX_LEN // block_size)
        self.states = RequestStates(MAX_REQS, MAX_LEN, CPU, pin_memory=False)
        self.tables = BlockTables(MAX_REQS, self.max_blocks, block_size, CPU, pin_memory=False)
        self.inputs = InputBuffers(MAX_REQS, MAX_TOKENS, self.max_blocks, CPU, pin_memory=False)
        self.rng = np.random.default_rng(seed)
        self.free_blocks = [int(b) for b in self.rng.permutation(np.arange(1, 200))]  # shuffled, never block 0
        self.reqs: dict[str, Req] = {}

    def add(self, req_id: str, num_tokens: int, computed: int, num_blocks: int) -> Req:
        tokens = self.rng.integers(1, 10_000, size=num_tokens).tolist()
        blocks = [self.free_blocks.pop() for _ in range(num_blocks)]
        data = NewRequestData(req_id, tokens, tokens, SamplingParams(), blocks, computed)
        req = Req(tokens, computed, blocks, self.states.add(data))
        self.tables.reset(req.slot)
        self.tables.append(req.slot, blocks)
        self.reqs[req_id] = req
        return req

    def grow(self, req_id: str, num_blocks: int) -> None:
        req = self.reqs[req_id]
        new = [self.free_blocks.pop() for _ in range(num_blocks)]
        req.blocks += new
        self.tables.append(req.slot, new)

    def remove(self, req_id: str) -> None:
        self.states.remove(req_id)
        del self.reqs[req_id]

    def apply(self) -> None:
        self.states.apply_staged()
        self.tables.apply_staged()

    def prepare(self, schedule: list[tuple[str, int]]):
        req_ids = [r for r, _ in schedule]
        idx = np.array([self.reqs[r].slot for r in req_ids], dtype=np.int64)
        n = np.array([k for _, k in schedule], dtype=np.int64)
        return self.inputs.prepare(req_ids, idx, n, self.states, self.tables)

    def check(self, batch, schedule: list[tuple[str, int]]) -> None:
        """Every output of prepare() against a pure-Python computation."""
        bs = self.bs
        ids, pos, slots, qsl, seq_lens, logits_idx = [], [], [], [0], [], []
        for req_id, k in schedule:
            r = self.reqs[req_id]
            assert r.computed + k <= len(r.tokens)
            for p in range(r.computed, r.computed + k):
                ids.append(r.tokens[p])
                pos.append(p)
                slots.append(r.blocks[p // bs] * bs + p % bs)
            qsl.append(qsl[-1] + k)
            seq_lens.append(r.computed + k)
            logits_idx.append(qsl[-1] - 1)
        t = qsl[-1]
        assert batch.num_tokens == t
        assert batch.input_ids.tolist() == ids
        assert batch.positions.tolist() == pos
        assert batch.logits_indices.tolist() == logits_idx
        assert batch.idx_mapping.tolist() == [self.reqs[r].slot for r, _ in schedule]
        assert batch.num_scheduled.tolist() == [k for _, k in schedule]
        a = batch.attn
        assert a.num_reqs == len(schedule) and a.num_tokens == t and a.block_size == bs
        assert a.num_decodes == sum(k == 1 for _, k in schedule)
        assert a.max_query_len == max(k for _, k in schedule) and a.max_seq_len == max(seq_lens)
        assert a.query_start_loc.tolist() == qsl and a.query_start_loc_cpu.tolist() == qsl
        assert a.seq_lens.tolist() == seq_lens and a.seq_lens_cpu.tolist() == seq_lens
        assert a.slot_mapping.tolist() == slots
        assert a.block_table.shape == (len(schedule), self.max_blocks)
        for row, (req_id, _) in enumerate(schedule):
            r = self.reqs[req_id]
            assert a.block_table[row, :len(r.blocks)].tolist() == r.blocks
            assert torch.equal(a.block_table[row], self.tables.table[r.slot])

    def post_update(self, batch, sampled: list[int]) -> None:
        """Advance the runner state and the naive mirror by one step."""
        self.states.post_update(batch.idx_mapping, batch.num_scheduled, torch.tensor(sampled), batch.idx_cpu,
                                batch.num_scheduled_cpu)
        for req_id, k, tok in zip(batch.req_ids, batch.num_scheduled_cpu.tolist(), sampled):
            r = self.reqs[req_id]
            r.computed += k
            if r.computed >= len(r.tokens):
                r.tokens.append(tok)


def _buffers(inputs: InputBuffers) -> dict[str, int]:
    return {name: t.data_ptr() for name, t in vars(inputs).items() if isinstance(t, torch.Tensor)}


@pytest.mark.parametrize("block_size", [4, 16])
def test_prepare_mixed_batch_matches_naive(block_size):
    w = World(block_size)
    bs = block_size
    w.add("filler", 3, 0, 1)
    w.add("dec_a", 10, 9, -(-10 // bs))  # decodes: only the last token is new
    w.add("fresh", 7, 0, -(-7 // bs))  # whole prompt, nothing cached
    w.remove("filler")  # leave a hole: slots are not contiguous
    w.add("chunk", 30, 8, -(-20 // bs))  # cached prefix of 8, a chunk of 12 this step
    w.add("cached", 13, 8, -(-13 // bs))  # cached prefix, rest of the prompt this step
    w.add("dec_b", 5, 4, -(-5 // bs))
    w.apply()
    # Decodes first (as the runner orders), the rest in an order unrelated to slots.
    schedule = [("dec_b", 1), ("dec_a", 1), ("chunk", 12), ("fresh", 7), ("cached", 5)]
    batch = w.prepare(schedule)
    w.check(batch, schedule)


def test_buffers_keep_their_addresses_across_steps():
    w = World(block_size=4, seed=1)
    ptrs = _buffers(w.inputs)
    assert {"input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens", "idx_mapping",
            "num_scheduled", "logits_indices", "block_table"} <= set(ptrs)
    w.add("a", 9, 0, 3)
    w.add("b", 20, 0, 2)
    w.add("c", 6, 5, 2)
    w.apply()

    steps = 0
    schedule = [("c", 1), ("a", 9), ("b", 8)]  # "b" is chunked: 8 of 20 this step
    while schedule:
        batch = w.prepare(schedule)
        w.check(batch, schedule)
        assert _buffers(w.inputs) == ptrs
        # Each step's tensors are prefix views of the persistent buffers.
        for view, buf in ((batch.input_ids, "input_ids"), (batch.positions, "positions"),
                          (batch.logits_indices, "logits_indices"), (batch.idx_mapping, "idx_mapping"),
                          (batch.num_scheduled, "num_scheduled"), (batch.attn.query_start_loc, "query_start_loc"),
                          (batch.attn.seq_lens, "seq_lens"), (batch.attn.slot_mapping, "slot_mapping"),
                          (batch.attn.block_table, "block_table")):
            assert view.data_ptr() == ptrs[buf], buf
        w.post_update(batch, [1000 + 10 * steps + i for i in range(len(schedule))])
        steps += 1
        # Next step: grow blocks where needed, drop finished requests, vary the batch size.
        schedule = []
        for req_id, r in list(w.reqs.items()):
            if len(r.tokens) >= 24:
                w.remove(req_id)
                continue
            k = min(len(r.tokens) - r.computed, 8)
            if steps % 3 == 1 and req_id == "a":
                continue  # sometimes not scheduled at all
            need = -(-(r.computed + k) // w.bs) - len(r.blocks)
            if need > 0:
                w.grow(req_id, need)
            schedule.append((req_id, k))
        if steps == 4:
            w.add("late", 11, 0, 3)
            schedule.append(("late", 11))
        w.apply()
        schedule.sort(key=lambda s: s[1] != 1)  # decodes first
    assert steps >= 6
    assert _buffers(w.inputs) == ptrs


def test_slot_reuse_with_stale_block_table_row():
    """A reused slot's table row may keep a previous request's block ids beyond its own blocks."""
    w = World(block_size=4, seed=2)
    w.add("old", 30, 0, 8)
    w.apply()
    w.remove("old")
    new = w.add("new", 5, 0, 2)
    w.apply()
    assert new.slot == 0
    schedule = [("new", 5)]
    batch = w.prepare(schedule)
    w.check(batch, schedule)
    assert batch.attn.block_table[0, :2].tolist() == new.blocks


@pytest.mark.parametrize("padded_reqs", [3, 4, 8])
def test_padding_to_a_captured_size(padded_reqs):
    """Padded steps: real rows unchanged, padded tokens write only the null block, shapes static."""
    from mrv2.attention.torch_paged import TorchPagedAttention
    from mrv2.kv_spec import KVCacheSpec
    from mrv2.runner.input_batch import StepPadding
    from mrv2.runner.kv_cache import allocate_kv_cache

    w = World(block_size=4, seed=11)
    for i, (n, blocks) in enumerate([(9, 3), (5, 2), (13, 4)]):
        w.add(f"r{i}", n, n - 1, blocks)  # three decodes
    w.states.apply_staged()
    w.tables.apply_staged()
    ids = list(w.reqs)
    idx = np.array([w.reqs[r].slot for r in ids])
    sched = np.ones(3, dtype=np.int64)
    spec = KVCacheSpec.gqa(2, 8, 8, torch.float32)
    backend = TorchPagedAttention()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(padded_reqs, n, 8, generator=g) for n in (4, 2, 2))

    def run(padding):
        cache = allocate_kv_cache([spec], "split", 200, 4, 64, CPU)
        cache.raw.zero_()
        batch = w.inputs.prepare(ids, idx, sched, w.states, w.tables, padding)
        out = backend.forward(q[:batch.input_ids.shape[0]], k[:batch.input_ids.shape[0]],
                              v[:batch.input_ids.shape[0]], cache.layers[0], backend.build_metadata(batch.attn), 0.5)
        return batch, out, cache.layers[0]

    eager, out_eager, cache_eager = run(None)
    padded, out_padded, cache_padded = run(StepPadding(padded_reqs, padded_reqs, MAX_LEN))
    assert padded.input_ids.shape[0] == padded_reqs and padded.attn.num_reqs == padded_reqs
    assert padded.attn.num_decodes == padded_reqs and padded.attn.static_shapes
    torch.testing.assert_close(out_padded[:3], out_eager)
    assert torch.isfinite(out_padded).all()
    qsl = padded.attn.query_start_loc.tolist()
    assert qsl == sorted(qsl) and qsl[-1] == padded_reqs
    assert padded.attn.seq_lens[3:].eq(0).all() and padded.attn.slot_mapping[3:].eq(0).all()
    for name in ("k", "v"):  # outside the null block, the caches hold exactly the same writes
        torch.testing.assert_close(cache_padded[name][1:], cache_eager[name][1:])


def test_token_only_padding_keeps_real_attention_metadata():
    """PIECEWISE padding: ids and positions padded with zeros, attention metadata exactly the unpadded one."""
    from mrv2.runner.input_batch import StepPadding

    w = World(block_size=4, seed=12)
    w.add("d", 9, 8, 3)  # a decode
    w.add("p", 7, 0, 2)  # a prefill of 7 tokens
    w.states.apply_staged()
    w.tables.apply_staged()
    ids = list(w.reqs)
    idx = np.array([w.reqs[r].slot for r in ids])
    sched = np.array([1, 7])

    real = w.inputs.prepare(ids, idx, sched, w.states, w.tables)
    real_attn = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in vars(real.attn).items()}
    real_ids, real_pos = real.input_ids.clone(), real.positions.clone()
    w.inputs.input_ids[8:16] = 7  # stale values a previous step left behind
    w.inputs.positions[8:16] = 7
    padded = w.inputs.prepare(ids, idx, sched, w.states, w.tables, StepPadding(2, 16, None))
    assert padded.input_ids.shape[0] == 16 and padded.positions.shape[0] == 16
    assert torch.equal(padded.input_ids[:8], real_ids) and torch.equal(padded.positions[:8], real_pos)
    assert padded.input_ids[8:].eq(0).all() and padded.positions[8:].eq(0).all()
    assert padded.num_tokens == 8 and padded.logits_indices.tolist() == real.logits_indices.tolist()
    for name, want in real_attn.items():
        got = getattr(padded.attn, name)
        if isinstance(want, torch.Tensor):
            assert torch.equal(got, want), name
        elif isinstance(want, np.ndarray):
            assert np.array_equal(got, want), name
        else:
            assert got == want, name


def test_logits_rows_lead_a_decode_batch_and_are_gathered_otherwise():
    w = World(4)
    w.add("dec_a", 10, 9, 3)
    w.add("dec_b", 5, 4, 2)
    w.add("fresh", 7, 0, 2)
    w.apply()
    hidden = torch.randn(MAX_TOKENS, 8)
    for schedule, lead in (([("dec_b", 1), ("dec_a", 1)], True), ([("dec_a", 1), ("fresh", 7)], False)):
        batch = w.prepare(schedule)
        assert batch.logits_lead is lead
        assert torch.equal(batch.logits_hidden(hidden), hidden[batch.logits_indices])
        slots = batch.logits_slots()
        assert torch.equal(slots, batch.idx_mapping[batch.logits_rows])
        counts = w.states.num_tokens[slots]
        assert torch.equal(batch.logits_positions(counts), counts.long() + batch.logits_offsets)
