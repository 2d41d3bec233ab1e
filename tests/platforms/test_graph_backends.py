"""Graph backends: eager and compiled fixed-address outputs, and which backend each platform picks."""

from __future__ import annotations

import importlib.util
from dataclasses import replace
from functools import partial

import pytest
import torch

from mrv2.config import GraphConfig, GraphMode
from mrv2.platforms import CpuPlatform, CudaPlatform
from mrv2.platforms.graphs import CompiledGraphBackend, CudaGraphBackend, EagerGraphBackend, NpuGraphBackend


def test_eager_replays_compute_over_the_current_inputs():
    torch.manual_seed(0)
    x = torch.randn(8, 16)
    w = torch.randn(16, 16)
    backend = EagerGraphBackend()
    graph = backend.capture(lambda: torch.relu(x @ w), backend.new_pool())
    torch.testing.assert_close(graph.output, torch.relu(x @ w), rtol=0, atol=0)
    for _ in range(3):
        x.copy_(torch.randn(8, 16))  # new inputs in place, as a runner writes its persistent buffers
        torch.testing.assert_close(graph.replay(), torch.relu(x @ w), rtol=0, atol=0)


def test_eager_replays_take_inputs_and_return_structured_outputs():
    backend = EagerGraphBackend()
    graph = backend.capture(lambda a, b: (a + 1, {"h": a * b, "none": None}), None, (torch.zeros(4), torch.ones(4)))
    first, nested = graph.replay(torch.full((4,), 3.0), torch.full((4,), 2.0))
    assert first.tolist() == [4.0] * 4 and nested["h"].tolist() == [6.0] * 4 and nested["none"] is None


def test_eager_rejects_unsupported_outputs():
    with pytest.raises(TypeError):
        EagerGraphBackend().capture(lambda: 3, None)


def _linear_relu(linear, x):
    return torch.relu(linear(x))


def test_compiled_pieces_share_one_graph_per_shape_across_modules():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    backend = CompiledGraphBackend()
    lins = [torch.nn.Linear(16, 16) for _ in range(3)]
    x8, x4 = torch.randn(8, 16), torch.randn(4, 16)
    before = counters["stats"]["unique_graphs"]
    with torch.inference_mode():
        graphs = [backend.capture(partial(_linear_relu, lin, x), None) for x in (x8, x4) for lin in lins]
        assert counters["stats"]["unique_graphs"] - before == 2  # one per shape, not per module
        x8.copy_(torch.randn(8, 16))
        x4.copy_(torch.randn(4, 16))
        outputs = [g.replay() for g in graphs]
        want = [torch.relu(lin(x)) for x in (x8, x4) for lin in lins]
    for out, w in zip(outputs, want, strict=True):
        torch.testing.assert_close(out, w)


def test_compiled_replays_compute_over_the_inputs_given():
    """Inputs passed at capture are arguments: a replay runs the captured code on other tensors of their
    shapes, as a chain of pieces hands on each piece's result."""
    torch._dynamo.reset()
    backend = CompiledGraphBackend()
    lin = torch.nn.Linear(16, 16)
    with torch.inference_mode():
        captured = torch.randn(4, 16)
        graph = backend.capture(partial(_linear_relu, lin), None, (captured,))
        torch.testing.assert_close(graph.output, torch.relu(lin(captured)))
        for _ in range(2):
            x = torch.randn(4, 16)
            torch.testing.assert_close(graph.replay(x), torch.relu(lin(x)))


@pytest.mark.parametrize("cpp_wrapper", [True, False])
def test_compiled_wrapper_is_cpp_where_asked(cpp_wrapper):
    """The C++ wrapper calls the same kernels: replays equal eager, and the code made for the capture is a
    C++ entry (its Python stub hands tensors over as AOTI handles) or Inductor's Python `call`."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    backend = CompiledGraphBackend(cpp_wrapper=cpp_wrapper)
    lin = torch.nn.Linear(16, 16)
    with torch.inference_mode():
        graph, codes = run_and_get_code(lambda: backend.capture(partial(_linear_relu, lin), None, (torch.randn(4, 16),)))
        assert len(codes) == 1 and ("torch._C._aoti" in codes[0]) is cpp_wrapper
        for _ in range(2):
            x = torch.randn(4, 16)
            torch.testing.assert_close(graph.replay(x), torch.relu(lin(x)))


class _Shift(torch.nn.Module):
    def __init__(self, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.full((4,), 2.0, dtype=dtype), requires_grad=False)


def _scale_shift(module, x):
    return x * module.weight + module.eps


def test_compiled_pieces_of_other_constants_or_dtypes_never_share_code():
    """`replay_guards` drops guards on fixed module state, not those that tell modules apart."""
    torch._dynamo.reset()
    backend = CompiledGraphBackend()
    with torch.inference_mode():
        for eps, dtype in ((0.5, torch.float32), (0.25, torch.float32), (0.5, torch.bfloat16)):
            module, x = _Shift(eps, dtype), torch.ones(4, dtype=dtype)
            graph = backend.capture(partial(_scale_shift, module, x), None)
            out = graph.replay()
            assert out.dtype == dtype and torch.equal(out, torch.full((4,), 2 + eps, dtype=dtype))


def test_replay_guards_drop_only_guards_on_fixed_module_state():
    from types import SimpleNamespace

    from mrv2.platforms.graphs import replay_guards

    kinds = ["TENSOR_MATCH", "SHAPE_ENV", "CONSTANT_MATCH", "EQUALS_MATCH", "TYPE_MATCH", "GLOBAL_STATE",
             "EMPTY_NN_MODULE_HOOKS_DICT", "NOT_PRESENT_IN_GENERIC_DICT", "MODULE_MATCH", "BUILTIN_MATCH"]
    assert replay_guards([SimpleNamespace(guard_type=k) for k in kinds]) == [True] * 6 + [False] * 4


def test_platform_graph_backends():
    full, piecewise = GraphConfig(mode=GraphMode.FULL), GraphConfig(mode=GraphMode.PIECEWISE)
    assert isinstance(CpuPlatform().graph_backend(full), EagerGraphBackend)
    assert isinstance(CpuPlatform().graph_backend(piecewise), CompiledGraphBackend)
    assert isinstance(CpuPlatform().graph_backend(replace(piecewise, compile=False)), EagerGraphBackend)
    compiled_full = CpuPlatform().graph_backend(replace(full, compile=True))
    assert isinstance(compiled_full, CompiledGraphBackend) and compiled_full.options["cpp_wrapper"]
    assert not CpuPlatform().graph_backend(piecewise).options.get("cpp_wrapper")  # pieces keep Python's
    assert isinstance(CudaPlatform().graph_backend(full), CudaGraphBackend)  # constructing touches no device
    with pytest.raises(ValueError, match="compile"):
        CudaPlatform().graph_backend(replace(piecewise, compile=True))
    assert CudaGraphBackend.graph_class == "CUDAGraph" and NpuGraphBackend.graph_class == "NPUGraph"
    if importlib.util.find_spec("torch_npu") is None:
        with pytest.raises(ImportError):
            NpuGraphBackend()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_replays_over_fixed_inputs():
    backend = CudaPlatform().graph_backend(GraphConfig())
    x = torch.randn(8, 16, device="cuda")
    w = torch.randn(16, 16, device="cuda")
    graph = backend.capture(lambda a: torch.relu(a @ w), backend.new_pool(), (x,))
    ptr = graph.output.data_ptr()
    x.copy_(torch.randn(8, 16, device="cuda"))
    out = graph.replay(x)
    torch.cuda.synchronize()
    assert out is graph.output and out.data_ptr() == ptr
    torch.testing.assert_close(out, torch.relu(x @ w))
    y = torch.randn(8, 16, device="cuda")  # another tensor: copied into the captured input
    out = graph.replay(y)
    torch.cuda.synchronize()
    assert out.data_ptr() == ptr
    torch.testing.assert_close(out, torch.relu(y @ w))


def test_compiled_replays_call_the_captured_code_without_dynamo():
    """A replay runs the code compiled for its capture directly: with dynamo's caches cleared
    afterwards, replays compile nothing and still compute the function."""
    from torch._dynamo.utils import counters

    from mrv2.platforms.graphs import dynamo_entry

    torch._dynamo.reset()
    backend = CompiledGraphBackend()
    lin, x = torch.nn.Linear(16, 16), torch.randn(4, 16)
    with torch.inference_mode():
        graph = backend.capture(partial(_linear_relu, lin, x), None)
        assert dynamo_entry(_linear_relu, (lin, x), {}) is not None
        assert dynamo_entry(_linear_relu, (lin, torch.randn(5, 16)), {}) is None  # other shapes: no entry
        torch._dynamo.reset()
        compiles = counters["stats"]["unique_graphs"]
        x.copy_(torch.randn(4, 16))
        out = graph.replay()
        assert counters["stats"]["unique_graphs"] == compiles
        torch.testing.assert_close(out, torch.relu(lin(x)))


def _two_outputs(linear, x):
    y = linear(x)
    return torch.relu(y), y * 2


def test_direct_graph_calls_take_inputs_in_place_and_return_the_functions_results():
    """`graph_call` passes the arguments the frame gathered at capture, with a replay's inputs in place of
    the capture's (which it does not keep alive), and returns what the function returned, tuples included."""
    import gc
    import weakref

    from mrv2.platforms.graphs import graph_call

    torch._dynamo.reset()
    backend = CompiledGraphBackend()
    lin = torch.nn.Linear(16, 16)
    with torch.inference_mode():
        captured = torch.randn(4, 16)
        graph = backend.capture(partial(_two_outputs, lin), None, (captured,))
        assert graph_call(_two_outputs, (lin,), {}, (torch.randn(4, 16),)) is not None
        alive = weakref.ref(captured)
        del captured
        gc.collect()
        assert alive() is None
        x = torch.randn(4, 16)
        relu, doubled = graph.replay(x)
        torch.testing.assert_close(relu, torch.relu(lin(x)))
        torch.testing.assert_close(doubled, lin(x) * 2)


class _Remembering(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.last = None

    def forward(self, x):
        self.last = x * 2
        return self.last + 1


def test_frames_with_side_effects_run_whole_on_every_replay():
    """A traced frame that stores an attribute replays the store after its graph: no direct call skips it."""
    from mrv2.platforms.graphs import dynamo_entry, graph_call

    torch._dynamo.reset()
    backend = CompiledGraphBackend()
    module, x = _Remembering(), torch.ones(4)
    with torch.inference_mode():
        graph = backend.capture(partial(_Remembering.forward, module, x), None)
        assert dynamo_entry(_Remembering.forward, (module, x), {}) is not None
        assert graph_call(_Remembering.forward, (module, x), {}, ()) is None
        x.fill_(3.0)
        out = graph.replay()
        torch.testing.assert_close(out, torch.full((4,), 7.0))
        torch.testing.assert_close(module.last, torch.full((4,), 6.0))


def _scaled_sum(x: torch.Tensor) -> torch.Tensor:
    return (x * 3).sum(0)


def test_kernel_sources_are_part_of_the_compiled_code_cache_key(tmp_path, monkeypatch):
    # A graph compiled over the same code comes from Inductor's cache, unless a kernel source changed:
    # code cached before would call the kernels as they were.
    from torch._dynamo.utils import counters
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    source = tmp_path / "kernel.cpp"
    source.write_text("// version 1")

    def compile_once() -> tuple[int, int]:
        torch._dynamo.reset()
        counters.clear()
        with torch._inductor.config.patch(fx_graph_cache=True):
            backend = CompiledGraphBackend(kernel_sources=(source,))
            x = torch.arange(6.0).view(2, 3)
            assert backend.capture(_scaled_sum, None, (x,)).output.tolist() == [9.0, 15.0, 21.0]
        return counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]

    assert compile_once() == (0, 1)
    assert compile_once() == (1, 0)
    source.write_text("// version 2")
    assert compile_once() == (0, 1)
    torch._dynamo.reset()
