"""`ShmConnector`: prefill/decode disaggregation between instances on one host, through shared memory.

The producer (prefill instance) saves a request's prompt KV layer by layer while its
prefill runs: right after attention call i writes the step's KV, the worker copies those
tokens' bytes of layer i, addressed through the cache's registered regions
(`KVCache.regions()`: offsets and block/token strides from the one raw allocation), into a
shared-memory segment of the transfer, one per rank. Its blocks are free once the
request ends; the finished request's output carries `kv_transfer_params` naming the
transfer. The consumer (decode instance), given those params with the same prompt,
counts the prompt's tokens but the last as computed elsewhere, allocates blocks for
them and copies them in before its first forward, recomputing only the last prompt
token (which samples the first output token, as in vLLM). It then removes the segment.
A transfer no consumer claims within `transfer_timeout_s` (an option, default 120)
is removed by the producer; a consumer that finds no valid transfer computes the
prompt itself.

Segment layout: a 4 KiB JSON header (token count, prompt hash, the byte width of every
layer's parts), then per layer and part, in region order, [num_tokens, token_bytes].
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import uuid
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory
from typing import Any

import torch

from mrv2.config import KVTransferConfig
from mrv2.distributed.kv_transfer.base import (KVConnectorMetadata, KVConnectorScheduler, KVConnectorWorker,
                                               TransferJob)
from mrv2.distributed.shm_exchange import unlink_segment
from mrv2.kv_spec import KVRegions

logger = logging.getLogger("mrv2")

HEADER_BYTES = 4096
DEFAULT_TIMEOUT_S = 120.0


def prompt_hash(token_ids: list[int]) -> str:
    return hashlib.sha256(torch.tensor(token_ids, dtype=torch.int64).numpy().tobytes()).hexdigest()[:32]


def segment_name(transfer_id: str, rank: int) -> str:
    return f"{transfer_id}-r{rank}"


def _attach(name: str, to_remove: bool = False) -> shared_memory.SharedMemory | None:
    """The segment `name`, or None. Attaching registers it with this process's resource tracker, which
    would remove it at exit: unless this process removes it (`to_remove`, then `unlink` unregisters), undo that."""
    try:
        shm = shared_memory.SharedMemory(name=name)
    except (FileNotFoundError, ValueError):
        return None
    if not to_remove:
        resource_tracker.unregister(shm._name, "shared_memory")
    return shm


def _read_header(shm: shared_memory.SharedMemory) -> dict[str, Any] | None:
    try:
        return json.loads(bytes(shm.buf[:HEADER_BYTES]).rstrip(b"\0"))
    except ValueError:
        return None


def remove_segment(name: str) -> bool:
    """Remove a transfer segment by name; False if it was already gone."""
    shm = _attach(name, to_remove=True)
    if shm is None:
        return False
    shm.close()
    return unlink_segment(shm)


class ShmConnectorScheduler(KVConnectorScheduler):
    """Which prompts to save (producer) or load (consumer), and the transfers' lifetimes."""

    def __init__(self, config: KVTransferConfig, world_size: int) -> None:
        self.config = config
        self.world = world_size
        self.timeout_s = float(config.kv_connector_extra_config.get("transfer_timeout_s", DEFAULT_TIMEOUT_S))
        self._saving: dict[str, tuple[str, int, str]] = {}  # req id -> (transfer id, tokens saved, prompt hash)
        self._loads: list[TransferJob] = []
        self._finished: list[str] = []
        self._timers: dict[str, threading.Timer] = {}
        self._lock = threading.Lock()

    # -- consumer --

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> int:
        params = request.sampling_params.kv_transfer_params or {}
        if not self.config.is_consumer or not params.get("do_remote_prefill"):
            return 0
        tid, n = params.get("transfer_id"), params.get("num_tokens")
        prompt = request.prompt_token_ids
        if not isinstance(tid, str) or not isinstance(n, int) or not 0 < n <= len(prompt):
            logger.warning("request %s: kv_transfer_params %r name no usable transfer; computing its prompt",
                           request.req_id, params)
            return 0
        expected = prompt_hash(prompt[:n])
        for rank in range(self.world):
            shm = _attach(segment_name(tid, rank))
            header = _read_header(shm) if shm is not None else None
            if shm is not None:
                shm.close()
            if header is None or header.get("num_tokens") != n or header.get("prompt_hash") != expected:
                logger.warning("request %s: transfer %s %s; computing its prompt", request.req_id, tid,
                               "is gone" if header is None else "holds another prompt")
                return 0
        # The last prompt token is recomputed: its forward samples the first output token.
        return max(0, min(n, len(prompt) - 1) - num_computed_tokens)

    def update_state_after_alloc(self, request: Any, num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        params = request.sampling_params.kv_transfer_params
        start = request.num_computed_tokens
        self._loads.append(TransferJob(params["transfer_id"], tuple(request.block_ids), start,
                                       start + num_external_tokens, params["num_tokens"],
                                       prompt_hash(request.prompt_token_ids[:params["num_tokens"]])))

    # -- producer --

    def build_connector_meta(self, scheduled: dict[str, int], requests: dict[str, Any]) -> KVConnectorMetadata:
        saves = []
        if self.config.is_producer:
            for req_id in scheduled:
                request = requests[req_id]
                params = request.sampling_params.kv_transfer_params or {}
                if not params.get("do_remote_decode"):
                    continue
                n = len(request.prompt_token_ids)
                tid, saved, h = self._saving.get(req_id) or (f"mrv2kv-{uuid.uuid4().hex[:20]}", 0,
                                                             prompt_hash(request.prompt_token_ids))
                end = min(request.num_computed_tokens, n)
                if end > saved:  # from 0 on the first step: prefix-cache hits are saved too
                    saves.append(TransferJob(tid, tuple(request.block_ids), saved, end, n, h))
                self._saving[req_id] = (tid, max(saved, end), h)
        meta = KVConnectorMetadata(tuple(saves), tuple(self._loads), tuple(self._finished))
        self._loads, self._finished = [], []
        return meta

    def request_finished(self, request: Any) -> dict[str, Any] | None:
        entry = self._saving.pop(request.req_id, None)
        if entry is None:
            return None
        tid, saved, h = entry
        self._finished.append(tid)
        names = [segment_name(tid, r) for r in range(self.world)]
        if saved < len(request.prompt_token_ids):  # ended before its prompt was computed: nothing to hand on
            for name in names:
                remove_segment(name)
            return None
        timer = threading.Timer(self.timeout_s, self._expire, (tid, names, self.timeout_s))
        timer.daemon = True
        with self._lock:
            self._timers[tid] = timer
        timer.start()
        return {"do_remote_prefill": True, "transfer_id": tid, "num_tokens": saved, "prompt_hash": h}

    def _expire(self, tid: str, names: list[str], timeout_s: float) -> None:
        with self._lock:
            self._timers.pop(tid, None)
        if any([remove_segment(n) for n in names]):
            logger.warning("KV transfer %s was not claimed within %g s: removed", tid, timeout_s)

    def pending_transfers(self) -> list[str]:
        """Transfers handed on whose expiry is still to come (a consumer may have claimed them meanwhile)."""
        with self._lock:
            return list(self._timers)

    def shutdown(self) -> None:
        with self._lock:
            timers, self._timers = self._timers, {}
        for tid, timer in timers.items():
            timer.cancel()
            for rank in range(self.world):
                remove_segment(segment_name(tid, rank))
        for tid, _, _ in self._saving.values():
            for rank in range(self.world):
                remove_segment(segment_name(tid, rank))


@dataclass
class TransferStats:
    """Bytes a rank's worker side moved, per transfer and in total."""

    bytes_saved: dict[str, int]
    bytes_loaded: dict[str, int]


class ShmConnectorWorker(KVConnectorWorker):
    """Copies token rows between the paged cache (addressed through its regions) and transfer segments."""

    def __init__(self, config: KVTransferConfig, rank: int) -> None:
        self.config = config
        self.rank = rank
        self.stats = TransferStats({}, {})
        self._segments: dict[str, shared_memory.SharedMemory] = {}  # transfers this rank is saving
        self._rows: list[torch.Tensor] = []  # per (layer, part): [num_blocks, block_size, token_bytes] views
        self._layer_parts: list[list[int]] = []  # layer -> indices into _rows
        self._widths: list[int] = []
        self._block_size = 0
        self._step_saves: list[tuple[TransferJob, torch.Tensor, torch.Tensor]] = []

    def register_kv_caches(self, raw: torch.Tensor, regions: KVRegions) -> None:
        self._block_size = regions.block_size
        base = regions.base - raw.data_ptr()
        num_layers = 1 + max(p.layer for p in regions.parts)
        self._layer_parts = [[] for _ in range(num_layers)]
        for i, p in enumerate(regions.parts):
            self._rows.append(raw.as_strided((regions.num_blocks, regions.block_size, p.token_bytes),
                                             (p.block_stride, p.token_stride, 1), base + p.offset))
            self._layer_parts[p.layer].append(i)
            self._widths.append(p.token_bytes)

    def _slots(self, job: TransferJob) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.arange(job.start, job.end)
        blocks = torch.tensor(job.block_ids, dtype=torch.int64)[tokens // self._block_size]
        return blocks, tokens % self._block_size

    def _staging(self, shm: shared_memory.SharedMemory, num_tokens: int, part: int) -> torch.Tensor:
        offset = HEADER_BYTES + num_tokens * sum(self._widths[:part])
        return torch.frombuffer(shm.buf, dtype=torch.uint8, offset=offset,
                                count=num_tokens * self._widths[part]).view(num_tokens, self._widths[part])

    def _header(self, job: TransferJob) -> bytes:
        return json.dumps({"num_tokens": job.num_tokens, "prompt_hash": job.prompt_hash,
                           "widths": self._widths}).encode()

    def start_load_kv(self, metadata: KVConnectorMetadata | None) -> None:
        self._step_saves = []
        if metadata is None:
            return
        for tid in metadata.finished_saves:
            if (shm := self._segments.pop(tid, None)) is not None:
                shm.close()  # the segment stays for its consumer (or the producer's expiry)
        for job in metadata.loads:
            self._load(job)
        for job in metadata.saves:
            if job.transfer_id not in self._segments:
                size = HEADER_BYTES + job.num_tokens * sum(self._widths)
                shm = shared_memory.SharedMemory(segment_name(job.transfer_id, self.rank), create=True, size=size)
                resource_tracker.unregister(shm._name, "shared_memory")  # outlives this process if need be
                header = self._header(job)
                shm.buf[:len(header)] = header
                self._segments[job.transfer_id] = shm
            self._step_saves.append((job, *self._slots(job)))

    def _load(self, job: TransferJob) -> None:
        name = segment_name(job.transfer_id, self.rank)
        shm = _attach(name, to_remove=True)
        if shm is None:
            raise RuntimeError(f"KV transfer {job.transfer_id} disappeared before rank {self.rank} loaded it")
        try:
            header = _read_header(shm)
            if header != json.loads(self._header(job)):
                raise RuntimeError(f"KV transfer {job.transfer_id} does not fit this cache (header {header})")
            blocks, offsets = self._slots(job)
            for part, rows in enumerate(self._rows):
                rows[blocks, offsets] = self._staging(shm, job.num_tokens, part)[job.start:job.end]
            self.stats.bytes_loaded[job.transfer_id] = (job.end - job.start) * sum(self._widths)
        finally:
            shm.close()
            unlink_segment(shm)

    def save_kv_layer(self, layer: int) -> None:
        for job, blocks, offsets in self._step_saves:
            shm = self._segments[job.transfer_id]
            for part in self._layer_parts[layer]:
                self._staging(shm, job.num_tokens, part)[job.start:job.end] = self._rows[part][blocks, offsets]
            self.stats.bytes_saved[job.transfer_id] = self.stats.bytes_saved.get(job.transfer_id, 0) + \
                (job.end - job.start) * sum(self._widths[p] for p in self._layer_parts[layer])

    def wait_for_save(self) -> None:
        self._step_saves = []  # copies are synchronous: every save is complete

    def close(self) -> None:
        for shm in self._segments.values():
            shm.close()
        self._segments = {}
