"""The pieces of tensor parallelism, each against its single-rank meaning: splits, the
shared-memory exchange, sharded linears and embeddings (two ranks as two threads), and a
loader that reads only a rank's slice of each tensor."""

from __future__ import annotations

import os
import threading

import pytest
import torch
from safetensors.torch import save_file

from mrv2.distributed.parallel import TensorParallel
from mrv2.distributed.shm_exchange import ShmExchange
from mrv2.layers.embedding import VocabEmbedding
from mrv2.layers.linear import Linear
from mrv2.layers.quantization import QuantizedWeight
from mrv2.loader.safetensors_weights import LazyTensor, iter_safetensors_weights
from mrv2.models.weights import read_part


def _tp(rank: int, size: int) -> TensorParallel:
    return TensorParallel(rank, size, group=object())  # a group no test below communicates over


@pytest.mark.parametrize("units,size,expected", [
    (8, 2, [(0, 4), (4, 4)]), (6, 3, [(0, 2), (2, 2), (4, 2)]),
    (1, 2, [(0, 1), (0, 1)]), (2, 4, [(0, 1), (0, 1), (1, 1), (1, 1)]),  # replicated below the rank count
])
def test_split(units, size, expected):
    assert [_tp(r, size).split(units) for r in range(size)] == expected


def test_split_refuses_what_does_not_divide():
    with pytest.raises(ValueError, match="9 attention heads do not split evenly over tensor_parallel_size=2"):
        _tp(0, 2).split(9, "attention heads")
    with pytest.raises(ValueError, match="3 KV heads cannot be replicated evenly over tensor_parallel_size=4"):
        _tp(0, 4).split(3, "KV heads")


@pytest.mark.parametrize("heads,kv,size", [(9, 3, 2), (8, 2, 2), (12, 4, 3), (8, 1, 2), (16, 2, 4), (6, 6, 4)])
def test_split_heads_keeps_gqa_groups_whole_and_covers_every_head(heads, kv, size):
    parts = [_tp(r, size).split_heads(heads, kv) for r in range(size)]
    group = heads // kv
    for (qf, qn), (kf, kn) in parts:
        assert qn >= 1 and kn >= 1
        assert qf // group >= kf and (qf + qn - 1) // group < kf + kn  # its queries read its KV heads
    assert sorted(q for (qf, qn), _ in parts for q in range(qf, qf + qn)) == list(range(heads))


def _run_ranks(size: int, fn):
    """fn(rank, TensorParallel) on `size` threads sharing one ShmExchange segment; results by rank."""
    owner = ShmExchange(None, 0, size, 1 << 16)
    exchanges = [owner] + [ShmExchange(owner.name, r, size, 1 << 16) for r in range(1, size)]
    results, errors = [None] * size, []

    def run(rank):
        try:
            results[rank] = fn(rank, TensorParallel(rank, size, group=object(), local=exchanges[rank]))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for e in exchanges[1:] + [owner]:
        e.close()
    assert not errors, errors
    return results


def test_shm_exchange_sums_and_gathers_the_same_bits_on_every_rank():
    xs = [torch.randn(5, 7) for _ in range(3)]

    def work(rank, tp):
        return [tp.all_reduce(xs[rank] * (i + 1)) for i in range(4)], tp.all_gather(xs[rank], dim=-1)

    results = _run_ranks(3, work)
    for i in range(4):
        expected = torch.stack([x * (i + 1) for x in xs]).sum(0)
        for sums, _ in results:
            assert torch.equal(sums[i], results[0][0][i])
            torch.testing.assert_close(sums[i], expected)
    for _, gathered in results:
        assert torch.equal(gathered, torch.cat(xs, dim=-1))


def test_shm_exchange_names_a_rank_that_is_gone():
    owner = ShmExchange(None, 0, 2, 1024)
    peer = ShmExchange(owner.name, 1, 2, 1024)
    dead = os.fork()
    if dead == 0:
        os._exit(0)
    os.waitpid(dead, 0)
    peer._pids[1] = dead  # rank 1 "was" a process that has exited
    try:
        with pytest.raises(RuntimeError, match=f"tensor-parallel rank 1 \\(pid {dead}\\) is gone"):
            owner.exchange(torch.ones(3))
    finally:
        peer.close()
        owner.close()


@pytest.mark.parametrize("bias", [False, True])
def test_column_and_row_parallel_linears_equal_the_whole_layers(bias):
    torch.manual_seed(0)
    fused = Linear(16, [24, 8], bias, torch.float32)  # two shards, as gate/up or q/k/v
    down = Linear(32, [16], bias, torch.float32)
    for p in (*fused.parameters(), *down.parameters()):
        p.data.normal_()
    x, h = torch.randn(3, 16), torch.randn(3, 32)

    def work(rank, tp):
        col = Linear(16, [24, 8], bias, torch.float32, tp=tp, parallel="column")
        row = Linear(32, [16], bias, torch.float32, tp=tp, parallel="row")
        for shard, (start, size) in enumerate([(0, 24), (24, 8)]):
            for name in ("weight",) + (("bias",) if bias else ()):
                whole = getattr(fused, name).data[start:start + size]
                col.load_shard(getattr(col, name), shard, read_part(whole, col.tp_slice(name, shard)))
        row.weight.data.copy_(read_part(down.weight.data, row.tp_slice("weight", None)))
        if bias:
            assert row.tp_slice("bias", None) is None  # whole on every rank, added once after the sum
            row.bias.data.copy_(down.bias.data)
        _, start, length = row.tp_slice("weight", None)
        return col(x), row(h[:, start:start + length])

    results = _run_ranks(2, work)
    y = fused(x)  # each rank holds half of every shard's rows
    torch.testing.assert_close(torch.cat([r[0][:, :12] for r in results], -1), y[:, :24])
    torch.testing.assert_close(torch.cat([r[0][:, 12:] for r in results], -1), y[:, 24:])
    torch.testing.assert_close(results[0][1], down(h))  # partial products summed over the ranks
    assert torch.equal(results[0][1], results[1][1])


def test_vocab_parallel_embedding_equals_the_whole_table():
    torch.manual_seed(0)
    whole = VocabEmbedding(10, 4, torch.float32)
    whole.weight.data.normal_()
    ids = torch.tensor([0, 9, 4, 5, 3])

    def work(rank, tp):
        emb = VocabEmbedding(10, 4, torch.float32, tp)
        emb.weight.data.copy_(read_part(whole.weight.data, emb.tp_slice("weight", None)))
        return emb(ids)

    for out in _run_ranks(2, work):
        assert torch.equal(out, whole(ids))


def test_quantized_weight_narrows_by_rows_and_whole_blocks():
    codes = torch.randint(0, 16, (8, 128), dtype=torch.uint8)
    w = QuantizedWeight("Q4_1", codes, torch.rand(8, 4), torch.rand(8, 4))
    full = w.dequantize()
    assert torch.equal(w.narrow(0, 2, 4).dequantize(), full[2:6])
    assert torch.equal(w.narrow(1, 64, 64).dequantize(), full[:, 64:])
    with pytest.raises(ValueError, match="only at 32-weight blocks"):
        w.narrow(1, 16, 32)


def test_lazy_tensors_read_only_the_slice_asked_for(tmp_path):
    a, b = torch.randn(6, 4), torch.randn(3, 8)
    save_file({"a": a, "b": b}, str(tmp_path / "model.safetensors"))
    got = {}
    for name, t in iter_safetensors_weights(tmp_path, lazy=True):
        assert isinstance(t, LazyTensor)
        got[name] = (t.shape, t.read((0, 2, 3)) if name == "a" else t.read((1, 4, 4)), t.read())
    assert got["a"][0] == (6, 4) and torch.equal(got["a"][1], a[2:5]) and torch.equal(got["a"][2], a)
    assert torch.equal(got["b"][1], b[:, 4:])


class _RecordingLazy(LazyTensor):
    """A LazyTensor that records how many elements were read."""

    def __init__(self, inner: LazyTensor, log: dict) -> None:
        self._inner, self._log, self.shape = inner, log, inner.shape

    def read(self, part=None):
        t = self._inner.read(part)
        self._log[self._inner._name] = t.numel()
        return t


def test_a_rank_reads_only_its_slice_of_sharded_tensors(tiny_checkpoint):
    from transformers import AutoConfig

    from mrv2.attention import get_attention_backend
    from mrv2.models.registry import build_model
    from mrv2.platforms import get_platform

    path, hf = tiny_checkpoint("llama", tied=False)
    config = AutoConfig.from_pretrained(path)
    model = build_model(config, get_attention_backend(get_platform(), "gqa"), torch.float32, 256, _tp(1, 2))
    read: dict[str, int] = {}
    model.load_weights((n, _RecordingLazy(t, read)) for n, t in iter_safetensors_weights(path, lazy=True))
    whole = {n: p.numel() for n, p in hf.state_dict().items()}
    replicated = [n for n in whole if "norm" in n]
    assert all(read[n] == whole[n] for n in replicated)
    assert all(read[n] * 2 == whole[n] for n in whole if n not in replicated)  # every projection, the vocabulary
    assert sum(read.values()) < 0.6 * sum(whole.values())
    torch.testing.assert_close(model.layers[0].self_attn.o_proj.weight, hf.model.layers[0].self_attn.o_proj.weight[:, 32:])


def test_lazy_quantized_weights_read_rows_or_whole_blocks(converted_default_model):
    from mrv2.loader.gguf_quant import LazyQuantizedWeight, iter_quantized_weights

    wholes = dict(iter_quantized_weights(converted_default_model))
    for name, lazy in iter_quantized_weights(converted_default_model, lazy=True):
        whole = wholes[name]
        assert isinstance(lazy, LazyQuantizedWeight) and lazy.shape == whole.shape, name
        for part in ((0, 16, 32), (1, 64, 128)):
            got, expected = lazy.read(part), whole.narrow(*part)
            assert got.qtype == expected.qtype and torch.equal(got.dequantize(), expected.dequantize())
        with pytest.raises(ValueError, match="32-weight blocks"):
            lazy.read((1, 16, 32))
        break  # one tensor of each call: the slicing is the same for all
