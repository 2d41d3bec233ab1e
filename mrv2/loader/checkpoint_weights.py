"""Iterate the tensors of a checkpoint folder: safetensors files, else PyTorch `.bin` files.

Draft heads (Eagle, Eagle-3) are often published as `pytorch_model.bin` only; models
read through `iter_safetensors_weights`, which this reuses whenever the folder has any
`*.safetensors` file.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Iterator
from pathlib import Path

import torch

from mrv2.loader.errors import CorruptCheckpointError, ModelLoadError
from mrv2.loader.safetensors_weights import INDEX_FILE, indexed_files, iter_safetensors_weights

BIN_INDEX_FILE = "pytorch_model.bin.index.json"


def bin_files(folder: str | os.PathLike) -> list[Path]:
    """The folder's PyTorch weight files: the shards its index names, else every pytorch_model*.bin."""
    folder = Path(folder)
    files = indexed_files(folder, BIN_INDEX_FILE)
    return files if files is not None else sorted(folder.glob("pytorch_model*.bin"))


def iter_checkpoint_weights(path: str | os.PathLike) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(name, tensor)` for every tensor of the checkpoint folder `path`, one file at a time.

    Reads `*.safetensors` (see `iter_safetensors_weights`) where the folder has any, else
    `pytorch_model*.bin` (loaded with `weights_only=True` onto the CPU). Raises ValueError
    (`ModelLoadError`) naming the folder when it has neither.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise ModelLoadError(f"checkpoint folder {folder} does not exist or is not a folder")
    if (folder / INDEX_FILE).is_file() or any(folder.glob("*.safetensors")):
        yield from iter_safetensors_weights(folder)
        return
    files = bin_files(folder)
    if not files:
        raise ModelLoadError(f"no weights in {folder}: expected *.safetensors or pytorch_model*.bin files")
    for file in files:
        try:
            # Storages stay on the host whatever device saved them (the loader then places them).
            state = torch.load(file, map_location=lambda storage, _location: storage, weights_only=True)
        except (RuntimeError, OSError, EOFError, pickle.UnpicklingError) as exc:
            raise CorruptCheckpointError(file, str(exc)) from exc
        if not isinstance(state, dict):
            raise CorruptCheckpointError(file, f"holds a {type(state).__name__}, not a dict of tensors")
        for name, tensor in state.items():
            if not isinstance(tensor, torch.Tensor):
                raise CorruptCheckpointError(file, f"entry {name!r} is a {type(tensor).__name__}, not a tensor")
            yield name, tensor
        del state
