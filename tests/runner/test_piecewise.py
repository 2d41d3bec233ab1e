"""PIECEWISE recording: segment capture order, eager attention between pieces, fixed addresses, padding."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from mrv2.platforms.graphs import CapturedGraph, EagerGraphBackend, GraphBackend
from mrv2.runner.graphs import BatchDescriptor, GraphInputs, GraphManager, GraphMode
from mrv2.runner.graphs.piecewise import PiecewiseForward


def _tree(obj, fn):
    if isinstance(obj, tuple):
        return tuple(_tree(x, fn) for x in obj)
    return fn(obj)


def _copy_tree(dst, src):
    if isinstance(dst, tuple):
        for d, s in zip(dst, src, strict=True):
            _copy_tree(d, s)
    else:
        dst.copy_(src)


class _Piece(CapturedGraph):
    """A device graph's contract: inputs copied into the captured ones, outputs at addresses it owns."""

    def __init__(self, fn, inputs, index, log):
        self.fn, self.inputs, self.index, self.log = fn, inputs, index, log
        self.output = _tree(fn(*inputs), torch.clone)
        self.copied = 0  # inputs that arrived at other addresses

    def replay(self, *inputs):
        self.log.append(("replay", self.index))
        for captured, given in zip(self.inputs, inputs, strict=True):
            if given is not None and given.data_ptr() != captured.data_ptr():
                captured.copy_(given)
                self.copied += 1
        _copy_tree(self.output, self.fn(*self.inputs))
        return self.output


class PieceRecorder(GraphBackend):
    """Numbers every capture and logs captures and replays."""

    def __init__(self, log):
        self.log, self.count = log, 0

    def new_pool(self):
        return "pool"

    def capture(self, fn, pool, inputs=()):
        assert pool == "pool"
        self.log.append(("capture", self.count))
        piece = _Piece(fn, inputs, self.count, self.log)
        self.count += 1
        return piece


class ToyModel:
    """Two attention calls; attention mixes rows (a prefix sum), so padding leaking into it would show."""

    num_attention_calls = 2

    def __init__(self, log):
        self.log = log

    def segment_call(self, i):
        return self.segment, (i,)

    def segment(self, i, positions, x, residual):
        if i == 0:
            h = x.float()[:, None].repeat(1, 3)
        else:
            h = x + residual
        if i == self.num_attention_calls:
            return h * 10
        return (h + positions[:, None], h * 2), h

    def store_aux_hidden(self, i, residual):
        pass

    def attend(self, i, inputs, metadata):
        q, k = inputs
        self.log.append(("attend", i, q.shape[0], None if metadata is None else metadata["bias"]))
        bias = 0.0 if metadata is None else metadata["bias"]
        return torch.cumsum(q * k, dim=0) / 100 + bias

    def forward(self, ids, positions, metadata):
        x, residual = ids, None
        for i in range(self.num_attention_calls):
            inputs, residual = self.segment(i, positions, x, residual)
            x = self.attend(i, inputs, metadata)
        return self.segment(self.num_attention_calls, positions, x, residual)


def piecewise(n):
    return BatchDescriptor(GraphMode.PIECEWISE, n, 0, 0)


def make(log, backend=None, size=16):
    ids, positions = torch.zeros(size, dtype=torch.int64), torch.zeros(size)
    model = ToyModel(log)
    recorder = PiecewiseForward(model, ids, positions, lambda common: {"bias": common.bias})
    manager = GraphManager(backend or PieceRecorder(log), GraphInputs({"ids": ids, "positions": positions}),
                           lambda d: None, recorder)
    return manager, model, ids, positions, recorder


def step(ids, positions, tokens, padded):
    ids[:padded].zero_()
    positions[:padded].zero_()
    ids[:len(tokens)] = torch.tensor(tokens)
    positions[:len(tokens)] = torch.arange(len(tokens), dtype=torch.float32)
    return SimpleNamespace(num_tokens=len(tokens), bias=0.5)


def test_capture_order_segments_then_sizes():
    log = []
    m, *_ = make(log)
    m.capture([piecewise(4), piecewise(8)])
    captures = [e for e in log if e[0] == "capture"]
    assert captures == [("capture", i) for i in range(6)]  # 8 tokens: pieces 0, 1, 2; then 4 tokens: 3, 4, 5
    # Capture runs attention without the cache (metadata None) between pieces, at the padded size.
    assert [e for e in log if e[0] == "attend"] == [("attend", 0, 8, None), ("attend", 1, 8, None),
                                                      ("attend", 0, 4, None), ("attend", 1, 4, None)]
    assert m.descriptors == [piecewise(8), piecewise(4)]


def test_replay_interleaves_eager_attention_over_real_tokens():
    log = []
    m, model, ids, positions, _ = make(log)
    m.capture([piecewise(8)])
    log.clear()
    tokens = [3, 1, 4, 1, 5]
    common = step(ids, positions, tokens, 8)
    out = m.replay(piecewise(8), common)
    assert log == [("replay", 0), ("attend", 0, 5, 0.5), ("replay", 1), ("attend", 1, 5, 0.5), ("replay", 2)]
    want = model.forward(torch.tensor(tokens), torch.arange(5, dtype=torch.float32), {"bias": 0.5})
    torch.testing.assert_close(out[:5], want)


def test_addresses_are_fixed_across_replays_and_buffers_shared_across_sizes():
    m, model, ids, positions, recorder = make([])
    m.capture([piecewise(8), piecewise(4)])
    out = m.replay(piecewise(8), step(ids, positions, [1, 2, 3], 8))
    first = out.clone()
    ptr = out.data_ptr()
    out2 = m.replay(piecewise(8), step(ids, positions, [9, 9, 9, 9, 9, 9, 9], 8))
    assert out2 is out and out2.data_ptr() == ptr and not torch.equal(out2[:3], first[:3])
    want = model.forward(torch.tensor([9] * 7), torch.arange(7, dtype=torch.float32), {"bias": 0.5})
    torch.testing.assert_close(out2[:7], want)
    # Every size reads the same attention-output buffers: the smaller one's are prefixes.
    big, small = (m._entries[piecewise(n)].recording for n in (8, 4))
    for buf8, buf4 in zip(big.attn_out, small.attn_out, strict=True):
        assert buf4.data_ptr() == buf8.data_ptr() and buf4.shape[0] == 4 and buf8.shape[0] == 8
    out4 = m.replay(piecewise(4), step(ids, positions, [2, 7], 4))
    want4 = model.forward(torch.tensor([2, 7]), torch.arange(2, dtype=torch.float32), {"bias": 0.5})
    torch.testing.assert_close(out4[:2], want4)


def test_device_pieces_copy_only_attention_outputs_of_full_batches():
    """A device graph reads captured inputs: a full batch's attention output is copied into it,
    a padded one's lands there already (the padding buffer is the captured input); residuals
    stay in the previous piece's output."""
    log = []
    m, *_, ids, positions, _ = make(log)
    m.capture([piecewise(8)])
    pieces = m._entries[piecewise(8)].recording.pieces
    m.replay(piecewise(8), step(ids, positions, list(range(8)), 8))
    assert [p.copied for p in pieces] == [0, 1, 1]
    m.replay(piecewise(8), step(ids, positions, [1, 2, 3], 8))
    assert [p.copied for p in pieces] == [0, 1, 1]


class _TracingModel(ToyModel):
    """Records what each segment is given and returns, and what attention returns."""

    def __init__(self, log):
        super().__init__(log)
        self.calls, self.attended = [], []

    def segment(self, i, positions, x, residual):
        out = super().segment(i, positions, x, residual)
        self.calls.append((x, residual, out))
        return out

    def attend(self, i, inputs, metadata):
        out = super().attend(i, inputs, metadata)
        self.attended.append(out)
        return out


def test_host_pieces_pass_results_on_as_they_are():
    model = _TracingModel([])
    ids, positions = torch.zeros(8, dtype=torch.int64), torch.zeros(8)
    recorder = PiecewiseForward(model, ids, positions, lambda common: {"bias": common.bias})
    m = GraphManager(EagerGraphBackend(), GraphInputs({"ids": ids, "positions": positions}), lambda d: None, recorder)
    m.capture([piecewise(8)])
    for tokens in (list(range(1, 9)), [4, 2]):
        model.calls.clear(), model.attended.clear()
        out = m.replay(piecewise(8), step(ids, positions, tokens, 8))
        (_, _, first), (x1, res1, second), (x2, res2, last) = model.calls
        assert res1 is first[1] and res2 is second[1] and out is last
        if len(tokens) == 8:  # a full batch: attention outputs go on as they are
            assert x1 is model.attended[0] and x2 is model.attended[1]
        else:  # padded into the buffers
            attn_out = m._entries[piecewise(8)].recording.attn_out
            assert x1 is attn_out[0] and x2 is attn_out[1]
        want = model.forward(torch.tensor(tokens), torch.arange(len(tokens), dtype=torch.float32), {"bias": 0.5})
        torch.testing.assert_close(out[:len(tokens)], want)


def test_eager_graph_backend_runs_the_same_pieces():
    log = []
    m, model, ids, positions, _ = make(log, EagerGraphBackend())
    m.capture([piecewise(16), piecewise(8)])
    for tokens in ([5], [1, 2, 3, 4, 5, 6, 7, 8], [4, 4, 2]):
        out = m.replay(piecewise(8), step(ids, positions, tokens, 8))
        n = len(tokens)
        want = model.forward(torch.tensor(tokens), torch.arange(n, dtype=torch.float32), {"bias": 0.5})
        torch.testing.assert_close(out[:n], want)
