"""KV connectors for prefill/decode disaggregation: the interface and the connectors, by name."""

from __future__ import annotations

from mrv2.config import KVTransferConfig
from mrv2.distributed.kv_transfer.base import (KVConnectorMetadata, KVConnectorScheduler, KVConnectorWorker,
                                               TransferJob)
from mrv2.distributed.kv_transfer.shm_connector import ShmConnectorScheduler, ShmConnectorWorker

CONNECTORS: dict[str, tuple[type[KVConnectorScheduler], type[KVConnectorWorker]]] = {
    "ShmConnector": (ShmConnectorScheduler, ShmConnectorWorker),
}


def _halves(config: KVTransferConfig) -> tuple[type[KVConnectorScheduler], type[KVConnectorWorker]]:
    if config.kv_connector not in CONNECTORS:
        raise ValueError(f"unknown kv_connector {config.kv_connector!r} (available: {', '.join(CONNECTORS)})")
    return CONNECTORS[config.kv_connector]


def build_connector_scheduler(config: KVTransferConfig, world_size: int) -> KVConnectorScheduler:
    return _halves(config)[0](config, world_size)


def build_connector_worker(config: KVTransferConfig, rank: int) -> KVConnectorWorker:
    return _halves(config)[1](config, rank)


__all__ = ["CONNECTORS", "KVConnectorMetadata", "KVConnectorScheduler", "KVConnectorWorker", "TransferJob",
           "build_connector_scheduler", "build_connector_worker"]
