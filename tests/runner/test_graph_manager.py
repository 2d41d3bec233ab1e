"""GraphManager: capture order, hooks, address checks, two independent managers, a shared workspace."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from mrv2.platforms.graphs import CapturedGraph, EagerGraphBackend, GraphBackend
from mrv2.runner.graphs import (BatchDescriptor, GraphConfig, GraphDispatcher, GraphInputs, GraphManager, GraphMode,
                               WholeForward)


class _RecordedGraph(CapturedGraph):
    def __init__(self, fn, log, desc_of):
        self._fn, self._log, self._desc_of = fn, log, desc_of
        self.output = fn().clone()  # a fixed-address output, as a device graph would own

    def replay(self):
        self._log.append(("replay", self._desc_of()))
        return self.output.copy_(self._fn())


class RecordingGraphBackend(GraphBackend):
    """Logs every capture (with the descriptor the manager is capturing) and replays by re-running."""

    def __init__(self, log):
        self.log, self.pools, self.current = log, [], None

    def new_pool(self):
        self.pools.append(object())
        return self.pools[-1]

    def capture(self, fn, pool, inputs=()):
        assert pool is self.pools[-1] and inputs == ()
        desc = self.current
        self.log.append(("capture", desc))
        return _RecordedGraph(fn, self.log, lambda: desc)


class RecordingAttention:
    """An attention backend's graph hooks, logged."""

    def __init__(self, log, graphs: RecordingGraphBackend):
        self.log, self.graphs = log, graphs

    def before_capture(self, desc):
        self.log.append(("before", desc))
        self.graphs.current = desc

    def after_capture(self, desc):
        self.log.append(("after", desc))

    def prepare_replay(self, desc, metadata):
        self.log.append(("prepare", desc))


class Buffers:
    def __init__(self, n: int, scale: float):
        self.x = torch.arange(n, dtype=torch.float32)
        self.scale = torch.tensor([scale])


def make_manager(buffers: Buffers, log):
    graphs = RecordingGraphBackend(log)
    attn = RecordingAttention(log, graphs)

    def forward(desc, metadata):
        assert metadata == {"n": desc.num_tokens}
        return buffers.x[:desc.num_tokens] * buffers.scale

    return GraphManager(graphs, GraphInputs.of(buffers, ["x", "scale"]), lambda d: {"n": d.num_tokens},
                        WholeForward(forward), [attn])


def full(n: int) -> BatchDescriptor:
    return BatchDescriptor(GraphMode.FULL, n, n, 1)


def test_capture_largest_first_with_hooks_in_order():
    log = []
    m = make_manager(Buffers(16, 1.0), log)
    dispatcher = GraphDispatcher(GraphConfig(capture_sizes=(1, 2, 4, 8)), max_num_reqs=16, max_num_tokens=16)
    m.capture(reversed(dispatcher.descriptors))  # given smallest first: the manager reorders
    expected = [(event, full(n)) for n in (8, 4, 2, 1) for event in ("before", "capture", "after")]
    assert log == expected
    assert m.descriptors == [full(n) for n in (8, 4, 2, 1)]
    assert all(m.has(full(n)) for n in (1, 2, 4, 8)) and not m.has(full(16))
    assert m.captured_metadata(full(4)) == {"n": 4}

    log.clear()
    m.replay(full(2), "step-metadata")
    m.replay(full(2), "step-metadata")
    assert log == [("prepare", full(2)), ("replay", full(2))] * 2


def test_replay_reads_current_buffer_contents_at_stable_addresses():
    buffers = Buffers(8, 2.0)
    m = make_manager(buffers, [])
    m.capture([full(4)])
    out = m.replay(full(4), None)
    ptr = out.data_ptr()
    assert out.tolist() == [0.0, 2.0, 4.0, 6.0]
    buffers.x[:4] = torch.tensor([1.0, 1.0, 1.0, 1.0])
    buffers.scale.fill_(3.0)
    out2 = m.replay(full(4), None)
    assert out2 is out and out2.data_ptr() == ptr
    assert out2.tolist() == [3.0, 3.0, 3.0, 3.0]


def test_moved_buffer_is_detected():
    buffers = Buffers(8, 1.0)
    m = make_manager(buffers, [])
    m.capture([full(2)])
    buffers.x = torch.zeros(8)  # a reassigned buffer: the graph would still read the old one
    with pytest.raises(RuntimeError, match="x"):
        m.replay(full(2), None)
    with pytest.raises(RuntimeError, match="x"):
        m.capture([full(1)])


def test_moved_buffer_in_plain_mapping_is_detected():
    x = torch.zeros(8)
    inputs = GraphInputs({"x": x})
    m = GraphManager(RecordingGraphBackend([]), inputs, lambda d: None,
                     WholeForward(lambda d, md: x[:d.num_tokens] + 1))
    m.capture([full(4)])
    m.replay(full(4), None)
    x.set_(torch.zeros(8))  # same tensor object, new storage
    with pytest.raises(RuntimeError, match="x"):
        m.replay(full(4), None)


def test_rejects_eager_and_duplicate_descriptors():
    m = make_manager(Buffers(8, 1.0), [])
    with pytest.raises(ValueError):
        m.capture([BatchDescriptor(GraphMode.NONE, 3, 3, 1)])
    m.capture([full(2)])
    with pytest.raises(ValueError):
        m.capture([full(2)])


def test_same_class_serves_model_and_drafter_independently():
    model_log, drafter_log = [], []
    model_buf, drafter_buf = Buffers(8, 1.0), Buffers(8, 10.0)
    model = make_manager(model_buf, model_log)
    drafter = make_manager(drafter_buf, drafter_log)
    model.capture([full(4), full(2)])
    drafter.capture([full(1)])
    assert [e for e, _ in model_log].count("capture") == 2 and [e for e, _ in drafter_log].count("capture") == 1
    assert model.graph_backend.pools != drafter.graph_backend.pools
    assert not drafter.has(full(4)) and not model.has(full(1))

    model_buf.x.fill_(1.0)
    drafter_buf.x.fill_(2.0)
    assert model.replay(full(4), None).tolist() == [1.0] * 4
    assert drafter.replay(full(1), None).tolist() == [20.0]
    assert ("replay", full(1)) not in model_log and ("replay", full(4)) not in drafter_log
    drafter_buf.x = torch.zeros(8)  # moving the drafter's buffer does not concern the model
    assert model.replay(full(2), None).tolist() == [1.0, 1.0]
    with pytest.raises(RuntimeError):
        drafter.replay(full(1), None)


class SharedWorkspaceAttention:
    """Needs a workspace inside the graph: one, sized for the largest descriptor, shared by all graphs."""

    def __init__(self):
        self.workspace: torch.Tensor | None = None
        self.allocations = 0
        self.params: dict[BatchDescriptor, torch.Tensor] = {}

    def before_capture(self, desc):
        if self.workspace is None:  # the first descriptor is the largest: capture goes largest first
            self.workspace = torch.zeros(desc.num_tokens)
            self.allocations += 1
        assert self.workspace.numel() >= desc.num_tokens
        self.params[desc] = torch.ones(1)

    def after_capture(self, desc):
        pass  # the graph reads and writes the workspace at replay: nothing to drop

    def prepare_replay(self, desc, metadata):
        self.params[desc].fill_(metadata)

    def attend(self, desc, x):
        scratch = self.workspace[:desc.num_tokens]
        torch.mul(x, self.params[desc], out=scratch)
        return scratch + 0.0


@pytest.mark.parametrize("backend", [lambda: RecordingGraphBackend([]), EagerGraphBackend])
def test_shared_workspace_outlives_capture_and_serves_replay(backend):
    """Memory a graph reads at replay lives as long as the graph: shared, never freed after capture."""
    attn = SharedWorkspaceAttention()
    x = torch.arange(64, dtype=torch.float32)
    m = GraphManager(backend(), GraphInputs({"x": x}), lambda d: None,
                     WholeForward(lambda d, md: attn.attend(d, x[:d.num_tokens])), [attn])
    descs = [full(n) for n in (1, 2, 4, 8, 16, 32, 64)]
    m.capture(descs)
    workspace, ptr = weakref.ref(attn.workspace), attn.workspace.data_ptr()
    gc.collect()
    assert attn.allocations == 1 and attn.workspace.numel() == 64
    assert workspace() is attn.workspace and attn.workspace.data_ptr() == ptr
    assert m.replay(full(4), 2.0).tolist() == [0.0, 2.0, 4.0, 6.0]
    assert attn.workspace[:4].tolist() == [0.0, 2.0, 4.0, 6.0]  # replay ran in the shared workspace
    assert m.replay(full(64), 0.5).tolist() == (x * 0.5).tolist()
    assert torch.equal(attn.workspace, x * 0.5) and attn.workspace.data_ptr() == ptr


def test_capture_failure_names_the_descriptor_and_releases_hooks():
    log = []
    graphs = RecordingGraphBackend(log)
    attn = RecordingAttention(log, graphs)

    def forward(desc, metadata):
        if desc.num_tokens == 2:
            raise NotImplementedError("no kernel for this size")
        return torch.zeros(desc.num_tokens)

    m = GraphManager(graphs, GraphInputs({}), lambda d: None, WholeForward(forward), [attn])
    with pytest.raises(RuntimeError, match=r"num_tokens=2.*NotImplementedError: no kernel.*enforce_eager"):
        m.capture([full(4), full(2), full(1)])
    assert ("after", full(2)) in log  # the after-capture hook still ran
    assert m.descriptors == [full(4)]
