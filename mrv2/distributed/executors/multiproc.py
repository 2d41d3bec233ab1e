"""Ranks 1.. as worker processes on this machine (the default executor for more than one rank)."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import weakref

from mrv2.distributed.executors.base import RunnerSpec
from mrv2.distributed.executors.distributed import DistributedExecutor


class MultiprocExecutor(DistributedExecutor):
    """One `python -m mrv2.distributed.executors.worker` process per rank beyond the driver.

    Workers are fresh interpreters (the user's script is never re-imported); they exit when
    the engine shuts down, when it is collected, and when its process dies.
    """

    def _start_workers(self, spec: RunnerSpec, host: str, port: int) -> None:
        self._procs: list[subprocess.Popen] = []
        for rank in range(1, self.world):
            proc = subprocess.Popen([sys.executable, "-m", "mrv2.distributed.executors.worker"], stdin=subprocess.PIPE)
            proc.stdin.write(pickle.dumps((spec, rank, self.world, host, port, os.getpid())))
            proc.stdin.close()
            self._procs.append(proc)
        weakref.finalize(self, _kill, list(self._procs))

    def _dead_workers(self) -> list[str]:
        return [f"rank {rank} exited with code {p.returncode}"
                for rank, p in enumerate(self._procs, start=1) if p.poll() is not None]

    def _stop_workers(self, timeout: float) -> None:
        for proc in self._procs:
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        _kill(self._procs)


def _kill(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
