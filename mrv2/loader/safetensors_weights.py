"""Iterate the tensors of an HF checkpoint folder's safetensors files."""

from __future__ import annotations

import json
import os
from collections.abc import Collection, Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from mrv2.loader.errors import CorruptCheckpointError, ModelLoadError

INDEX_FILE = "model.safetensors.index.json"


def indexed_files(folder: Path, index_name: str) -> list[Path] | None:
    """The shard files a weights index (`index_name` in `folder`) names, in shard order; None without one."""
    index = folder / index_name
    if not index.is_file():
        return None
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        names = list(dict.fromkeys(weight_map.values()))  # shard order, deduplicated
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CorruptCheckpointError(index, f"not a valid weights index ({exc})") from exc
    files = [folder / name for name in names]
    for file in files:
        if not file.is_file():
            raise CorruptCheckpointError(file, f"listed in {index_name} but missing")
    return files


def safetensors_files(folder: str | os.PathLike) -> list[Path]:
    """The folder's weight files: the shards its index names, else model.safetensors, else any *.safetensors."""
    folder = Path(folder)
    if (files := indexed_files(folder, INDEX_FILE)) is not None:
        return files
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no safetensors weights in {folder} (expected model.safetensors or {INDEX_FILE})")
    return files


class LazyTensor:
    """A checkpoint tensor not read yet: its shape, and `read` of all of it or of one slice, so that
    a rank holding part of a layer never reads the rest. Valid until the iterator moves on."""

    def __init__(self, file: Path, handle, name: str) -> None:
        self._file, self._name = file, name
        self._slice = handle.get_slice(name)
        self.shape = torch.Size(self._slice.get_shape())

    def read(self, part: tuple[int, int, int] | None = None) -> torch.Tensor:
        """The tensor, or its `part` (dim, start, length)."""
        index = (slice(None),) if part is None else \
            (slice(None),) * part[0] + (slice(part[1], part[1] + part[2]),)
        try:
            return self._slice[index]
        except SafetensorError as exc:
            raise CorruptCheckpointError(self._file, f"tensor {self._name}: {exc}") from exc


def iter_safetensors_weights(folder: str | os.PathLike, skip: Collection[str] = (),
                             lazy: bool = False) -> Iterator[tuple[str, torch.Tensor | LazyTensor]]:
    """Yield `(name, tensor)` for every tensor of the checkpoint but those in `skip`, one file at a time;
    `lazy`: as `LazyTensor`s, read when (and as far as) the consumer asks."""
    for file in safetensors_files(folder):
        try:
            handle = safe_open(file, framework="pt")
        except (SafetensorError, OSError) as exc:
            raise CorruptCheckpointError(file, str(exc)) from exc
        with handle:
            for name in handle.keys():
                if name in skip:
                    continue
                try:
                    tensor = LazyTensor(file, handle, name) if lazy else handle.get_tensor(name)
                except SafetensorError as exc:
                    raise CorruptCheckpointError(file, f"tensor {name}: {exc}") from exc
                yield name, tensor
