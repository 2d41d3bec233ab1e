"""Capture and replay of forwards per batch descriptor, over explicit persistent inputs.

The manager is built from what graphs need and nothing more: a graph backend, the
persistent tensors the graphs read, a metadata builder, a recorder (how one
descriptor's forward is recorded: whole, or in pieces with attention eager between
them) and the attention backends (for their capture hooks). It never holds a model
runner, so the same class serves the target model and a drafter, each over its own buffers.

What the captured forward may depend on at replay: the `GraphInputs` tensors (whose
addresses are checked), tensors in the capture-time metadata (kept alive here) that
the attention backends refresh in `prepare_replay`, and state the backends keep
themselves. Anything `build_metadata` derives outside the captured callable is
frozen at capture.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import torch

from mrv2.platforms.graphs import CapturedGraph, GraphBackend
from mrv2.runner.graphs.descriptor import BatchDescriptor, GraphMode

logger = logging.getLogger("mrv2")


class CaptureHooks(Protocol):
    """The graph hooks of an attention backend (see `mrv2.attention.backend`): memory a captured
    graph reads or writes lives as long as the graph; `after_capture` drops only what replay never reads."""

    def before_capture(self, descriptor: Any) -> None: ...

    def after_capture(self, descriptor: Any) -> None: ...

    def prepare_replay(self, descriptor: Any, metadata: Any) -> None: ...


class _AttrView(Mapping[str, torch.Tensor]):
    """Live name -> tensor view of an object's attributes, so reassignments are seen."""

    def __init__(self, source: object, names: Sequence[str]) -> None:
        self._source, self._names = source, tuple(names)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._names:
            raise KeyError(name)
        return getattr(self._source, name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


@dataclass
class GraphInputs:
    """The persistent tensors captured graphs read, by name.

    `tensors` may be a plain dict or a live view (`of`); either way the manager
    records every address at the first capture and refuses to replay once one moved.
    """

    tensors: Mapping[str, torch.Tensor]

    @classmethod
    def of(cls, source: object, names: Sequence[str]) -> GraphInputs:
        """Attributes `names` of `source` (e.g. InputBuffers), read live at every check."""
        return cls(_AttrView(source, names))

    def addresses(self) -> dict[str, int]:
        return {name: t.data_ptr() for name, t in self.tensors.items()}


class Recording(Protocol):
    """What one descriptor's capture produced; `replay` returns the output (see `CapturedGraph.replay`)."""

    def replay(self, metadata: Any) -> Any: ...


class Recorder(Protocol):
    """How a descriptor's forward is recorded into graphs of a backend."""

    def record(self, graph_backend: GraphBackend, pool: Any, desc: BatchDescriptor, metadata: Any) -> Recording: ...


class _WholeRecording:
    def __init__(self, graph: CapturedGraph) -> None:
        self.graph = graph

    def replay(self, metadata: Any) -> Any:
        return self.graph.replay()


@dataclass(frozen=True)
class WholeForward:
    """Records `forward(desc, metadata)` as one graph (FULL mode: attention inside)."""

    forward: Callable[[BatchDescriptor, Any], Any]

    def record(self, graph_backend: GraphBackend, pool: Any, desc: BatchDescriptor, metadata: Any) -> Recording:
        return _WholeRecording(graph_backend.capture(partial(self.forward, desc, metadata), pool))


@dataclass
class _Entry:
    recording: Recording
    metadata: Any  # capture-time metadata: the graph may read its tensors


class GraphManager:
    """Records `build_metadata(desc)`'s forward per descriptor through `recorder` and replays it."""

    def __init__(self, graph_backend: GraphBackend, inputs: GraphInputs,
                 build_metadata: Callable[[BatchDescriptor], Any], recorder: Recorder,
                 attention_backends: Sequence[CaptureHooks] = (), pool: Any = None) -> None:
        self.graph_backend = graph_backend
        self.inputs = inputs
        self.build_metadata = build_metadata
        self.recorder = recorder
        self.attention_backends = tuple(attention_backends)
        self.pool = graph_backend.new_pool() if pool is None else pool
        self._entries: dict[BatchDescriptor, _Entry] = {}
        self._addresses: dict[str, int] | None = None

    @property
    def descriptors(self) -> list[BatchDescriptor]:
        """Captured descriptors, in capture order."""
        return list(self._entries)

    def capture(self, descriptors: Iterable[BatchDescriptor]) -> None:
        """Capture every descriptor, largest first, so smaller graphs reuse the pool's memory."""
        todo = sorted(descriptors, key=lambda d: (d.num_tokens, d.num_reqs, d.max_seq_len), reverse=True)
        for desc in todo:
            if desc.mode is GraphMode.NONE:
                raise ValueError(f"{desc} is eager and cannot be captured")
            if desc in self._entries:
                raise ValueError(f"{desc} is already captured")
        if self._addresses is None:
            self._addresses = self.inputs.addresses()
        start = time.perf_counter()
        for desc in todo:
            self._check_inputs()
            for backend in self.attention_backends:
                backend.before_capture(desc)
            try:
                metadata = self.build_metadata(desc)
                recording = self.recorder.record(self.graph_backend, self.pool, desc, metadata)
            except Exception as e:
                raise RuntimeError(f"graph capture of {desc} failed ({type(e).__name__}: {e}); run with "
                                   f"enforce_eager=True or another graph_mode") from e
            finally:
                for backend in self.attention_backends:
                    backend.after_capture(desc)
            self._entries[desc] = _Entry(recording, metadata)
        if todo:
            logger.info("Captured %d graphs (%d to %d tokens) in %.2f s", len(todo), todo[-1].num_tokens,
                        todo[0].num_tokens, time.perf_counter() - start)

    def has(self, desc: BatchDescriptor) -> bool:
        return desc in self._entries

    def captured_metadata(self, desc: BatchDescriptor) -> Any:
        """The metadata `desc` was captured with (what its graph reads besides the inputs)."""
        return self._entries[desc].metadata

    def replay(self, desc: BatchDescriptor, metadata: Any) -> Any:
        """Replay `desc` over the current contents of the inputs; returns its output.

        `metadata` is the step's own metadata, handed to each backend's `prepare_replay`
        and to the recording (piecewise recordings attend with it). The output is valid
        until the next replay of `desc` (a device graph's lives at fixed addresses and is
        overwritten then); its rows past the step's real sizes are padding.
        """
        entry = self._entries[desc]
        self._check_inputs()
        for backend in self.attention_backends:
            backend.prepare_replay(desc, metadata)
        return entry.recording.replay(metadata)

    def _check_inputs(self) -> None:
        now = self.inputs.addresses()
        if now != self._addresses:
            moved = sorted({name for name, _ in set(now.items()) ^ set(self._addresses.items())})
            raise RuntimeError(f"graph input buffers changed address since capture: {moved}")
