"""Graph backends: how a platform records a forward once and replays it.

A graph records `fn(*inputs)`; `replay(*inputs)` runs it again over new inputs of the
captured shapes and returns its result. Device backends wrap torch's stream-graph API
(CUDA graphs, NPU graphs): there the inputs are copied into the captured ones where they
are other tensors, and the result lives at fixed addresses, overwritten by the next
replay. Host backends call the function (eager, or the code torch.compile made for the
capture) on the inputs as they are and return new tensors: a chain of pieces passes
each piece's result to the next without copies.
"""

from __future__ import annotations

import dis
import functools
import hashlib
import importlib
import inspect
import logging
import types
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch._inductor.custom_graph_pass import CustomGraphPass

logger = logging.getLogger("mrv2")

GraphInput = torch.Tensor | None


class CapturedGraph(ABC):
    """One recorded `fn(*inputs)`; `output` is the capture run's result."""

    output: Any

    @abstractmethod
    def replay(self, *inputs: GraphInput) -> Any:
        """Run again over `inputs` (tensors shaped as the captured ones, or those themselves) and the
        current contents of whatever else the function reads; returns the result, valid until the
        next replay."""


class GraphBackend(ABC):
    """Records callables into replayable graphs that share a memory pool."""

    @abstractmethod
    def new_pool(self) -> Any:
        """A memory pool that several captures may share (None where pools do not exist)."""

    @abstractmethod
    def capture(self, fn: Callable[..., Any], pool: Any, inputs: tuple[GraphInput, ...] = ()) -> CapturedGraph:
        """Record `fn(*inputs)`; its return value becomes the graph's `output`."""


def _leaves(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for x in obj:
            yield from _leaves(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _leaves(x)
    elif obj is not None:
        raise TypeError(f"graph outputs must be tensors or tuples/lists/dicts of them, got {type(obj).__name__}")


class _HostGraph(CapturedGraph):
    """A capture run's `output`; each replay returns `replay_fn(*inputs)`, computed anew."""

    def __init__(self, output: Any, replay_fn: Callable[..., Any]) -> None:
        list(_leaves(output))  # rejects unsupported outputs at capture
        self.output = output
        self._fn = replay_fn

    def replay(self, *inputs: GraphInput) -> Any:
        return self._fn(*inputs)


class EagerGraphBackend(GraphBackend):
    """No graphs: replay re-runs the callable.

    The CPU's backend for FULL graphs that are not compiled, where padding to static shapes
    is all a replay changes (see `mrv2 bench decode`).
    """

    def new_pool(self) -> None:
        return None

    def capture(self, fn: Callable[..., Any], pool: Any, inputs: tuple[GraphInput, ...] = ()) -> CapturedGraph:
        return _HostGraph(fn(*inputs), fn)


# Guards on state a loaded model never changes: its modules' hook dicts, attributes absent
# from instance dicts, the modules and builtins the traced code looked up by name.
_FIXED_STATE_GUARDS = frozenset({"EMPTY_NN_MODULE_HOOKS_DICT", "NOT_PRESENT_IN_GENERIC_DICT", "MODULE_MATCH",
                                 "BUILTIN_MATCH"})


def replay_guards(entries: list[Any]) -> list[bool]:
    """A torch.compile `guard_filter_fn` for code compiled at start-up and called every step.

    Dynamo checks every guard on every call; the pieces of a decoder have hundreds, most of
    them on the fixed state above. Kept: guards on tensors (parameters included: shapes,
    strides and dtypes tell captured sizes and engines apart), shape relations, constants
    (a norm's eps, a branch taken while tracing), types and global state.
    """
    return [e.guard_type not in _FIXED_STATE_GUARDS for e in entries]


# The decode attention looks its entry up every step; a function's signature never changes.
_signature = functools.cache(inspect.signature)


def _entry_code(func: Callable[..., Any], args: tuple, kwargs: dict) -> types.CodeType | None:
    code = getattr(func, "__code__", None)
    if code is None or code.co_freevars:  # a closure's cells cannot be rebuilt from its code
        return None
    try:
        bound = _signature(func).bind(*args, **kwargs)
        bound.apply_defaults()
        frame_locals = dict(bound.arguments)
        for entry in torch._dynamo.eval_frame._debug_get_cache_entry_list(code):
            if entry.guard_manager.check(frame_locals):
                return entry.code
    except (AttributeError, TypeError, ValueError) as e:  # a dynamo without these internals: dispatch through it
        logger.debug("no direct entry for %s: %s", func.__name__, e)
    return None


def dynamo_entry(func: Callable[..., Any], args: tuple, kwargs: dict) -> Callable[..., Any] | None:
    """The code torch.compile made for `func(*args, **kwargs)`, as a plain function; None if there is none.

    Each of dynamo's cache entries for `func` is `func` rewritten to call one compiled graph,
    with guards saying which arguments it serves. The entry is found by checking the guards
    against these arguments once; calling it skips dynamo's frame hook and guard checks
    (hundreds a call, with the graph's own Python wrappers the larger part of a small piece's
    cost). Only for calls whose arguments pass the same guards: the same modules and tensors
    of the same shapes, strides and dtypes, as in a captured piece.
    """
    code = _entry_code(func, args, kwargs)
    return None if code is None else types.FunctionType(code, func.__globals__, func.__name__, func.__defaults__)


# A rewritten frame that does no more than gather the graph's arguments, call it and unpack its results
# calls nothing else but these, from dynamo's utilities (profiling marks, a tensor's size as an argument);
# one that replays side effects (attribute stores, list updates) calls more, or stores.
_PURE_UTILS = frozenset({"record_pregraph_bytecode_enter", "record_pregraph_bytecode_exit", "call_size"})
_STORES = frozenset({"STORE_ATTR", "STORE_SUBSCR", "STORE_GLOBAL", "DELETE_ATTR", "DELETE_SUBSCR", "DELETE_GLOBAL",
                     "LOAD_METHOD", "IMPORT_NAME"})


@functools.cache  # pieces of one shape share their code
def _only_calls_its_graph(code: types.CodeType, graph: str) -> bool:
    ins = list(dis.get_instructions(code))
    callables = 0
    for i, op in enumerate(ins):
        if op.opname in _STORES:
            return False
        if op.opname == "LOAD_GLOBAL":
            nxt = ins[i + 1] if i + 1 < len(ins) else None
            if op.argval != graph and not (nxt is not None and nxt.opname == "LOAD_ATTR" and nxt.argval in _PURE_UTILS):
                return False
            callables += 1
    return sum(op.opname == "CALL" for op in ins) == callables


def _positions(found: list[Any], among: tuple) -> list[int]:
    return [next((i for i, x in enumerate(among) if x is t), -1) for t in found]


def graph_call(func: Callable[..., Any], args: tuple, kwargs: dict,
               inputs: tuple[GraphInput, ...]) -> Callable[..., Any] | None:
    """`func(*args, *inputs, **kwargs)` as one call of the graph torch.compile made for it; None where it is not.

    The rewritten frame (`dynamo_entry`) reads every parameter and buffer the graph takes off
    the modules on each call (a decoder's FULL graph takes 431 arguments), then unpacks the
    graph's results. Where the frame calls one graph and nothing else, its arguments are
    recorded once, running it, and a replay passes the recorded list with `inputs` put in
    their places: the same tensors a call through the frame would read, as the modules and
    buffers of a captured piece never change. The call returns what `func` returns, its
    tensors found among the graph's results by identity (nested tuples of them kept).
    """
    code = _entry_code(func, args + inputs, kwargs)
    if code is None:
        return None
    graphs = [n for n in code.co_names if n.startswith("__compiled_fn")]
    if len(graphs) != 1 or not _only_calls_its_graph(code, graphs[0]):
        return None
    graph = func.__globals__[graphs[0]]
    seen: list[Any] = []

    def record(*flat: Any) -> Any:
        seen.append(flat)
        seen.append(graph(*flat))
        return seen[-1]

    probe = types.FunctionType(code, {**func.__globals__, graphs[0]: record}, func.__name__, func.__defaults__)
    leaves, spec = pytree.tree_flatten(probe(*args, *inputs, **kwargs))
    flat, outs = seen
    picks = _positions(leaves, tuple(outs))
    slots = _positions([x for x in inputs if x is not None], flat)
    if -1 in picks or -1 in slots or not all(isinstance(x, torch.Tensor) for x in leaves):
        return None
    template = list(flat)
    for i in slots:
        template[i] = None  # the capture's own inputs are not kept alive
    where = [j for j, x in enumerate(inputs) if x is not None]

    def call(*given: GraphInput) -> Any:
        flat_args = list(template)
        for i, j in zip(slots, where):
            flat_args[i] = given[j]
        out = graph(*flat_args)
        return pytree.tree_unflatten([out[i] for i in picks], spec)

    return call


# Inductor checks the size, stride and alignment of every input and every extern kernel's
# result on every call (about 600 checks a batch-1 decode step of the default model, 0.4 ms
# of 9). Pieces are compiled for shapes fixed at capture and replayed on the same buffers,
# and the kernels' fake implementations give their results' strides, so the checks never fire.
_COMPILE_OPTIONS = {"guard_filter_fn": replay_guards, "size_asserts": False, "alignment_asserts": False,
                    "scalar_asserts": False}


# Inductor's C++ wrapper, where asked: the code that calls a graph's kernels is compiled C++ rather
# than Python. Built apart from the kernels (at -O1, Inductor's level for wrappers): a whole
# decoder's wrapper is thousands of lines of calls, which g++ took 64 s to build with the kernels
# at -O3, against 12 s alone (7 s at -O0, whose steps measured slower).
_CPP_WRAPPER_OPTIONS = {"cpp_wrapper": True, "cpp_wrapper_build_separate": True}


class KernelSourcesKey(CustomGraphPass):
    """Leaves the graph as it is; puts the hash of `files` into Inductor's cache key.

    Inductor caches compiled graphs by their FX code, which names a custom op but not what it
    was built from: after the kernels' sources change (an argument added), a warm cache would
    hand back code that calls them the old way. Given as Inductor's `post_grad_custom_post_pass`.
    """

    def __init__(self, files: tuple[Path, ...]) -> None:
        digest = hashlib.sha256()
        for f in files:
            digest.update(Path(f).read_bytes())
        self._uuid = digest.hexdigest()

    def __call__(self, graph: torch.fx.graph.Graph) -> None:
        return None

    def uuid(self) -> str:
        return self._uuid


class CompiledGraphBackend(GraphBackend):
    """A torch.compile'd (Inductor) callable per captured shape; a replay runs it on the inputs it is given.

    The CPU's backend for PIECEWISE graphs, where fused pointwise kernels pay (see
    `mrv2 bench compile`). A `functools.partial` is compiled through its function, so
    pieces running one function over different modules (every layer's segment) share
    a compiled graph per input shape: compiles grow with capture sizes, not with layers.
    A replay calls the graph dynamo made for its capture directly, with the arguments its
    frame gathered at capture (`graph_call`): a captured piece runs over the same modules
    and tensors every time. `cpp_wrapper` calls the
    kernels from compiled C++ instead of Inductor's Python wrapper. `kernel_sources`: the files the
    platform's own kernels are built from, part of the compiled code's cache key.
    """

    def __init__(self, recompile_limit: int = 256, cpp_wrapper: bool = False,
                 kernel_sources: tuple[Path, ...] = ()) -> None:
        self.recompile_limit = recompile_limit
        self.options = {**_COMPILE_OPTIONS, **(_CPP_WRAPPER_OPTIONS if cpp_wrapper else {})}
        if kernel_sources:
            self.options["post_grad_custom_post_pass"] = KernelSourcesKey(kernel_sources)
        self._compiled: dict[Callable[..., Any], Callable[..., Any]] = {}

    def new_pool(self) -> None:
        return None

    def capture(self, fn: Callable[..., Any], pool: Any, inputs: tuple[GraphInput, ...] = ()) -> CapturedGraph:
        func, args, kwargs = (fn.func, fn.args, fn.keywords) if isinstance(fn, partial) else (fn, (), {})
        compiled = self._compiled.get(func)
        if compiled is None:
            compiled = self._compiled[func] = torch.compile(func, dynamic=False, options=self.options)
        call = partial(compiled, *args, **kwargs)
        # Every capture size is one more specialization of the same code: allow them all.
        limit = self.recompile_limit
        with torch._dynamo.config.patch(recompile_limit=limit, accumulated_recompile_limit=limit):
            output = call(*inputs)
        direct = graph_call(func, args, kwargs, inputs)
        return _HostGraph(output, call if direct is None else direct)


class _DeviceGraph(CapturedGraph):
    """A stream graph over the captured inputs: a replay copies other inputs into them first."""

    def __init__(self, graph: Any, inputs: tuple[GraphInput, ...], output: Any) -> None:
        self._graph = graph
        self._inputs = inputs
        self.output = output

    def replay(self, *inputs: GraphInput) -> Any:
        for captured, given in zip(self._inputs, inputs, strict=True):
            if given is not None and given.data_ptr() != captured.data_ptr():
                captured.copy_(given)
        self._graph.replay()
        return self.output


class StreamGraphBackend(GraphBackend):
    """torch's CUDA-style graph API on `torch.<module>`: warm up on a side stream, capture into a pool."""

    module_name: str
    graph_class: str

    def __init__(self, warmup_runs: int = 1) -> None:
        self.warmup_runs = warmup_runs

    @property
    def _mod(self) -> Any:
        return getattr(torch, self.module_name)

    def new_pool(self) -> Any:
        return self._mod.graph_pool_handle()

    def capture(self, fn: Callable[..., Any], pool: Any, inputs: tuple[GraphInput, ...] = ()) -> CapturedGraph:
        mod = self._mod
        # Warm-up on a side stream (lazy init, autotuning, allocator growth) stays out of the graph.
        stream = mod.Stream()
        stream.wait_stream(mod.current_stream())
        with mod.stream(stream):
            for _ in range(self.warmup_runs):
                fn(*inputs)
        mod.current_stream().wait_stream(stream)
        graph = getattr(mod, self.graph_class)()
        with mod.graph(graph, pool=pool):
            output = fn(*inputs)
        return _DeviceGraph(graph, inputs, output)


class CudaGraphBackend(StreamGraphBackend):
    """CUDA graphs (torch.cuda.CUDAGraph) sharing one graph_pool_handle()."""

    module_name = "cuda"
    graph_class = "CUDAGraph"


class NpuGraphBackend(StreamGraphBackend):
    """Ascend NPU graphs (torch.npu.NPUGraph); needs torch_npu."""

    module_name = "npu"
    graph_class = "NPUGraph"

    def __init__(self, warmup_runs: int = 1) -> None:
        importlib.import_module("torch_npu")  # registers torch.npu
        super().__init__(warmup_runs)
