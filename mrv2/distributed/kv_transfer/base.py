"""The KV-connector interface, in vLLM V1's shape.

A connector has two halves. The scheduler side decides: how many of a new request's
prompt tokens another instance already computed (`get_num_new_matched_tokens`), what to
do once blocks are allocated for them (`update_state_after_alloc`), what the workers do
this step (`build_connector_meta`, carried to every rank inside the scheduler output),
and what a finished request hands on (`request_finished`: the `kv_transfer_params` a
decode instance needs). The worker side (one per rank) moves bytes: it registers the KV
cache's regions, loads before the forward (`start_load_kv`, `wait_for_layer_load`),
saves each layer as soon as its attention wrote it (`save_kv_layer`) and finishes the
step's saves (`wait_for_save`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from mrv2.kv_spec import KVRegions


@dataclass(frozen=True)
class TransferJob:
    """Tokens [start, end) of a request's prompt, held in `block_ids`, to save into or load from a transfer."""

    transfer_id: str
    block_ids: tuple[int, ...]
    start: int
    end: int
    num_tokens: int  # the transfer's whole length (the producer's prompt)
    prompt_hash: str


@dataclass(frozen=True)
class KVConnectorMetadata:
    """One step's work for every rank's worker side."""

    saves: tuple[TransferJob, ...] = ()
    loads: tuple[TransferJob, ...] = ()
    finished_saves: tuple[str, ...] = ()  # transfers whose producer request ended: release them


class KVConnectorScheduler(ABC):
    """The scheduler's half (in the engine's process)."""

    @abstractmethod
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> int:
        """Prompt tokens past `num_computed_tokens` whose KV can be loaded from elsewhere (0: none)."""

    @abstractmethod
    def update_state_after_alloc(self, request: Any, num_external_tokens: int) -> None:
        """Blocks were allocated for the request, `num_external_tokens` of them to be loaded."""

    @abstractmethod
    def build_connector_meta(self, scheduled: dict[str, int], requests: dict[str, Any]) -> KVConnectorMetadata:
        """This step's saves and loads; `scheduled` maps request ids to this step's token counts
        (their `num_computed_tokens` already include them)."""

    @abstractmethod
    def request_finished(self, request: Any) -> dict[str, Any] | None:
        """The request ended: the `kv_transfer_params` its output carries (for a decode instance), or None."""

    def shutdown(self) -> None:
        """Release whatever transfers are still held."""


class KVConnectorWorker(ABC):
    """A rank's half (inside its model runner)."""

    @abstractmethod
    def register_kv_caches(self, raw: torch.Tensor, regions: KVRegions) -> None:
        """The KV cache as a transfer engine sees it: the raw allocation and its regions."""

    @abstractmethod
    def start_load_kv(self, metadata: KVConnectorMetadata | None) -> None:
        """Before the forward: start this step's loads and take its saves."""

    def wait_for_layer_load(self, layer: int) -> None:
        """Before attention call `layer` reads the cache (loads that run layer by layer wait here)."""

    @abstractmethod
    def save_kv_layer(self, layer: int) -> None:
        """Attention call `layer` has written this step's KV: save what the step's jobs need of it."""

    @abstractmethod
    def wait_for_save(self) -> None:
        """After the forward: every save of the step is complete."""

    def close(self) -> None:
        """Release held resources."""
