"""Ranks 1.. as Ray actors, one per placement-group bundle (`distributed_executor_backend="ray"`).

The engine joins the Ray cluster of `RAY_ADDRESS` (or starts a local one); each worker
rank is an actor pinned to its bundle that runs the same loop as a worker process
(`worker.RankWorker`). Rank 0 stays in the engine's process, as with the multiprocess executor.
"""

from __future__ import annotations

from typing import Any

from mrv2.distributed.executors.base import RunnerSpec
from mrv2.distributed.executors.distributed import DistributedExecutor
from mrv2.distributed.executors.worker import RankWorker


class _RankActor:
    """One rank inside a Ray actor: `run` connects, loads and serves until the driver shuts it down."""

    def __init__(self, spec: RunnerSpec, rank: int, world: int, host: str, port: int) -> None:
        self.worker = RankWorker(spec, rank, world, host, port)

    def run(self) -> None:
        self.worker.start()
        self.worker.serve()


class RayExecutor(DistributedExecutor):
    """Worker ranks as Ray actors placed by a placement group (one bundle per rank, packed)."""

    def _store_host(self) -> str:
        import ray.util

        return ray.util.get_node_ip_address()

    def _start_workers(self, spec: RunnerSpec, host: str, port: int) -> None:
        ray = _import_ray()
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if not ray.is_initialized():
            ray.init()
        resource = self.platform.ray_resource
        bundles = [{resource: 1.0}] * (self.world - 1)
        # Ray names its two built-in resources in actor options; any other (an NPU) is custom.
        options = {"num_cpus": 0.0, "num_gpus": 0.0, "resources": {}}
        options[{"CPU": "num_cpus", "GPU": "num_gpus"}.get(resource, "resources")] = \
            1.0 if resource in ("CPU", "GPU") else {resource: 1.0}
        self._pg = placement_group(bundles, strategy="PACK")
        if not self._pg.wait(timeout_seconds=60):
            remove_placement_group(self._pg)
            raise ValueError(f"the Ray cluster cannot place {self.world - 1} worker ranks of one {resource} each "
                             f"(available: {ray.available_resources()})")
        actor_cls = ray.remote(_RankActor)
        self._actors: list[Any] = []
        self._runs: list[Any] = []
        for rank in range(1, self.world):
            actor = actor_cls.options(
                **options, scheduling_strategy=PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=rank - 1),
            ).remote(spec, rank, self.world, host, port)
            self._actors.append(actor)
            self._runs.append(actor.run.remote())

    def _dead_workers(self) -> list[str]:
        ray = _import_ray()
        done, _ = ray.wait(self._runs, num_returns=len(self._runs), timeout=0)
        dead = []
        for rank, run in enumerate(self._runs, start=1):
            if run in done:
                try:
                    ray.get(run)
                    dead.append(f"rank {rank} (Ray actor) stopped")
                except Exception as exc:  # noqa: BLE001 - reported as the rank's death
                    dead.append(f"rank {rank} (Ray actor) failed: {str(exc).splitlines()[0][:300]}")
        return dead

    def _stop_workers(self, timeout: float) -> None:
        ray = _import_ray()
        from ray.util.placement_group import remove_placement_group

        if timeout:
            ray.wait(self._runs, num_returns=len(self._runs), timeout=timeout)
        for actor in self._actors:
            ray.kill(actor)
        remove_placement_group(self._pg)


def _import_ray():
    try:
        import ray
    except ImportError:
        raise ValueError("distributed_executor_backend='ray' needs Ray: pip install 'ray[default]'") from None
    return ray
