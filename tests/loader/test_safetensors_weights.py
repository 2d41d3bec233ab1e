import json

import pytest
import torch
from safetensors.torch import save_file

from mrv2.loader import CorruptCheckpointError, ModelLoadError, iter_safetensors_weights

TENSORS = {f"model.layers.{i}.w": torch.arange(6, dtype=torch.float32).reshape(2, 3) + i for i in range(4)}


def assert_all(folder):
    got = dict(iter_safetensors_weights(folder))
    assert got.keys() == TENSORS.keys()
    for name, tensor in TENSORS.items():
        assert torch.equal(got[name], tensor)


def test_single_file(tmp_path):
    save_file(TENSORS, tmp_path / "model.safetensors")
    assert_all(tmp_path)


def test_sharded_with_index(tmp_path):
    names = list(TENSORS)
    shards = {"model-00001-of-00002.safetensors": names[:3], "model-00002-of-00002.safetensors": names[3:]}
    for shard, keys in shards.items():
        save_file({k: TENSORS[k] for k in keys}, tmp_path / shard)
    (tmp_path / "stray.safetensors").write_bytes(b"not read: the index decides")
    weight_map = {k: shard for shard, keys in shards.items() for k in keys}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert_all(tmp_path)


def test_any_safetensors_without_index(tmp_path):
    save_file(dict(list(TENSORS.items())[:2]), tmp_path / "a.safetensors")
    save_file(dict(list(TENSORS.items())[2:]), tmp_path / "b.safetensors")
    assert_all(tmp_path)


def test_missing_shard(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "gone.safetensors"}}))
    with pytest.raises(CorruptCheckpointError, match="gone.safetensors"):
        list(iter_safetensors_weights(tmp_path))


def test_no_weights(tmp_path):
    with pytest.raises(ModelLoadError, match="no safetensors weights"):
        list(iter_safetensors_weights(tmp_path))


@pytest.mark.parametrize("cut", [4, 100, -1])
def test_truncated_file(tmp_path, cut):
    save_file(TENSORS, tmp_path / "model.safetensors")
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[:cut])
    with pytest.raises(CorruptCheckpointError, match="model.safetensors"):
        list(iter_safetensors_weights(tmp_path))


def test_garbage_file(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage garbage}")
    with pytest.raises(CorruptCheckpointError, match="model.safetensors"):
        list(iter_safetensors_weights(tmp_path))
