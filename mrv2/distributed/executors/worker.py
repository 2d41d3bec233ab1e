"""One rank beyond the driver: build its runner, then run the driver's broadcast calls until shutdown.

The same loop serves worker processes (`python -m mrv2.distributed.executors.worker`, the
multiprocess executor) and Ray actors. Calls arrive over the control group in the order the
driver made them, one message per engine step. Each message also says how many launched
steps' outputs the driver has waited for since the previous one: the worker waits for as
many of its own first, so every rank's host state moves in step with the driver's.
"""

from __future__ import annotations

import logging
import os
import pickle
import socket
import sys
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from mrv2.distributed.executors.base import RunnerSpec, load_runner
from mrv2.distributed.parallel import TensorParallel, broadcast_object, new_process_group
from mrv2.distributed.shm_exchange import ShmExchange
from mrv2.platforms import Platform, get_platform

logger = logging.getLogger("mrv2")

SHUTDOWN = "shutdown"
STEP = "step"  # execute_model(sched), then sample_tokens() unless the step is empty or samples later
SAMPLE = "sample"  # sample_tokens(grammar) of a step whose sampling waited for structured output's bitmasks
CONNECT_TIMEOUT = timedelta(minutes=5)
# A collective that waits longer than this for a live peer fails the engine.
STEP_TIMEOUT = timedelta(minutes=30)
# The control group waits for the driver's next call, however long the engine idles.
IDLE_TIMEOUT = timedelta(days=365)


@dataclass
class RankGroups:
    """A rank's process groups: `tp` for the model's collectives, `control` for the driver's calls,
    and `local` for the model's collectives through shared memory when every rank is on this host."""

    store: dist.Store
    tp: Any
    control: Any
    local: ShmExchange | None

    def tensor_parallel(self, rank: int, world: int) -> TensorParallel:
        return TensorParallel(rank, world, self.tp, self.local)

    def close(self) -> None:
        if self.local is not None:
            self.local.close()


def join_groups(platform: Platform, store: dist.Store, rank: int, world: int, spec: RunnerSpec) -> RankGroups:
    """Join the engine's groups at the driver's store (every rank calls this; it returns once all have)."""
    tp = new_process_group(platform.dist_backend, store, "tp", rank, world, STEP_TIMEOUT)
    control = new_process_group("gloo", store, "control", rank, world, IDLE_TIMEOUT)
    return RankGroups(store, tp, control, _join_shm(platform, store, rank, world, spec))


def _slot_bytes(spec: RunnerSpec) -> int:
    """The largest tensor a collective exchanges: a step's hidden states, or its logits' vocabulary slice."""
    c, hf = spec.config, spec.hf_config
    drafts = c.speculative.num_speculative_tokens if c.speculative is not None else 0
    rows = c.scheduler.max_num_seqs * (1 + drafts)
    world = c.parallel.tensor_parallel_size
    return 4 * max(c.scheduler.max_num_batched_tokens * hf.hidden_size, rows * -(-hf.vocab_size // world))


def _join_shm(platform: Platform, store: dist.Store, rank: int, world: int, spec: RunnerSpec) -> ShmExchange | None:
    """Rank 0 offers a shared-memory segment; it is used only if every rank is on its host and attached."""
    if rank == 0:
        local = ShmExchange(None, 0, world, _slot_bytes(spec)) if platform.shm_collectives else None
        store.set("shm/name", local.name if local is not None else "")
        store.set("shm/host", socket.gethostname())
        answers = [store.get(f"shm/{r}").decode() for r in range(1, world)]
        agreed = local is not None and all(a == "ok" for a in answers)
        store.set("shm/agreed", "1" if agreed else "0")
        if local is not None and not agreed:
            local.close()
        return local if agreed else None
    name, host = store.get("shm/name").decode(), store.get("shm/host").decode()
    local = None
    if name and host == socket.gethostname() and platform.shm_collectives:
        try:
            local = ShmExchange(name, rank, world, _slot_bytes(spec))
        except OSError:
            local = None
    store.set(f"shm/{rank}", "ok" if local is not None else "no")
    if store.get("shm/agreed").decode() == "1":
        return local
    if local is not None:
        local.close()
    return None


class RankWorker:
    """Rank `rank` of `world`: its runner and the loop that serves the driver's calls."""

    def __init__(self, spec: RunnerSpec, rank: int, world: int, host: str, port: int) -> None:
        self.spec, self.rank, self.world = spec, rank, world
        self.host, self.port = host, port
        self.runner = None
        self.groups: RankGroups | None = None

    def start(self) -> None:
        """Connect and load this rank's slice of the model; report readiness (or the error) to the driver."""
        platform = get_platform(self.spec.config.device)
        platform.bind_rank(self.rank, self.world)
        platform.configure_threads(host_only=bool(self.spec.config.async_scheduling))
        store = dist.TCPStore(self.host, self.port, self.world, is_master=False, timeout=CONNECT_TIMEOUT)
        self.groups = join_groups(platform, store, self.rank, self.world, self.spec)
        try:
            self.runner = load_runner(self.spec, platform, self.groups.tensor_parallel(self.rank, self.world))
        except BaseException as exc:
            self.groups.store.set(f"ready/{self.rank}", f"error: {type(exc).__name__}: {exc}")
            raise
        self.groups.store.set(f"ready/{self.rank}", "ok")

    def serve(self) -> None:
        """Run the driver's calls until it says shut down."""
        outputs: deque = deque()
        while True:
            method, args, waited = broadcast_object(self.groups.control, None, self.rank)
            for _ in range(waited):
                outputs.popleft().get()
            if method == SHUTDOWN:
                break
            if method == STEP:
                sched, sample_now = args
                self.runner.execute_model(sched)
                if sample_now and not sched.is_empty:
                    outputs.append(self.runner.sample_tokens())
            elif method == SAMPLE:
                outputs.append(self.runner.sample_tokens(*args))
            else:
                getattr(self.runner, method)(*args)
        self.runner.close()
        self.groups.close()


def _exit_with_parent(parent_pid: int) -> None:
    """A worker outlives no engine: once the driver's process is gone, exit."""
    while True:
        time.sleep(0.5)
        if os.getppid() != parent_pid:
            os._exit(1)


def main() -> None:
    """Worker process entry: the driver writes (spec, rank, world, host, port, parent pid) on stdin."""
    spec, rank, world, host, port, parent_pid = pickle.load(sys.stdin.buffer)
    logging.basicConfig(level=logging.WARNING, format=f"mrv2 rank {rank}: %(message)s")
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    worker = RankWorker(spec, rank, world, host, port)
    try:
        worker.start()
        worker.serve()
    except BaseException:  # noqa: BLE001 - the driver sees the exit and names this rank
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)


if __name__ == "__main__":
    main()
