"""Where a step's device work runs, so that the host never waits on it inside the step.

The runner splits each step into host work (scheduling bookkeeping, numpy mirrors,
staging buffers), done on the caller's thread, and device work (staged writes,
gathers, forward, sampling, post-update), handed to a `DeviceQueue` in launch order.

- Accelerators launch kernels asynchronously on their current stream, so device work
  runs inline: `launch` returns as soon as the kernels are queued.
- The CPU executes ops synchronously. With async scheduling one worker thread plays
  the stream: device work runs on it in launch order (torch releases the GIL inside
  its ops), and the host prepares the next step meanwhile. Without it, work runs
  inline and the CPU path is the plain serial loop.

Results reach the host through `HostCopy`: a non-blocking copy into a host buffer
plus an event where the device has events; `wait()` is the only place the host
blocks on the device.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Generic, TypeVar

import torch

T = TypeVar("T")


class Pending(ABC, Generic[T]):
    """The result of launched device work; `result()` waits for the work (not for the device)."""

    @abstractmethod
    def result(self) -> T: ...


class _Done(Pending[T]):
    def __init__(self, value: T) -> None:
        self._value = value

    def result(self) -> T:
        return self._value


class _Future(Pending[T]):
    def __init__(self, future: Future) -> None:
        self._future = future

    def result(self) -> T:
        return self._future.result()


class DeviceQueue(ABC):
    """Runs device work in launch order.

    `synchronous`: the work has finished when `launch` returns (the CPU without async
    scheduling), so the caller's thread spends that time on device work.
    """

    synchronous: bool = False

    @abstractmethod
    def launch(self, work: Callable[[], T]) -> Pending[T]:
        """Queue `work` behind everything launched before it."""

    def close(self) -> None:
        """Finish queued work and release resources (idempotent)."""


class InlineQueue(DeviceQueue):
    """Runs work on the caller's thread: kernel launches on accelerators, the serial loop on the CPU."""

    def __init__(self, synchronous: bool = False) -> None:
        self.synchronous = synchronous

    def launch(self, work: Callable[[], T]) -> Pending[T]:
        return _Done(_inference(work))


class WorkerThreadQueue(DeviceQueue):
    """One worker thread is the device stream: work runs on it, in launch order.

    Thread-local torch state does not follow work across threads, so the worker is
    set up by `thread_init` (threads, denormals) and every item runs under
    `torch.inference_mode`.
    """

    def __init__(self, thread_init: Callable[[], None] | None = None) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mrv2-device",
                                            initializer=thread_init)
        self._lock = threading.Lock()
        self._closed = False

    def launch(self, work: Callable[[], T]) -> Pending[T]:
        with self._lock:
            if self._closed:
                raise RuntimeError("the device queue is closed")
            return _Future(self._executor.submit(_inference, work))

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._executor.shutdown(wait=True)


def _inference(work: Callable[[], T]) -> T:
    with torch.inference_mode():
        return work()


class HostCopy:
    """A device tensor on its way into a host buffer; `wait()` returns the host view.

    `start` is called as device work: a non-blocking copy, then an event recorded
    behind it where the device has events. On the CPU the copy is an ordinary one and
    the queue's own completion is the event.
    """

    def __init__(self, host: torch.Tensor, event: Any | None) -> None:
        self._host = host
        self._event = event

    @classmethod
    def start(cls, src: torch.Tensor, host: torch.Tensor, event: Any | None) -> "HostCopy":
        out = host[:src.numel()].view(src.shape)
        out.copy_(src, non_blocking=event is not None)
        if event is not None:
            event.record()
        return cls(out, event)

    def wait(self) -> torch.Tensor:
        if self._event is not None:
            self._event.synchronize()
        return self._host
