import logging
import shutil
from pathlib import Path

import pytest

from mrv2.loader import cache, cache_root, content_hash, converted_checkpoint, gguf_convert
from mrv2.loader.cache import file_sha256


def test_cache_root_precedence(monkeypatch, tmp_path):
    monkeypatch.delenv("MRV2_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert cache_root() == Path.home() / ".cache" / "mrv2"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "mrv2"
    monkeypatch.setenv("MRV2_CACHE_DIR", str(tmp_path / "explicit"))
    assert cache_root() == tmp_path / "explicit"


def test_content_hash_uses_side_index(tmp_cache, tmp_path, monkeypatch):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"some bytes")
    first = content_hash(model)
    assert first == file_sha256(model) and (tmp_cache / "hash_index.json").is_file()
    monkeypatch.setattr(cache, "file_sha256", lambda path: pytest.fail("rehashed an unchanged file"))
    assert content_hash(model) == first
    monkeypatch.undo()
    model.write_bytes(b"other bytes, other size")
    assert content_hash(model) != first


def test_converts_once_then_hits(tmp_cache, tmp_path, tiny_gguf, monkeypatch, caplog):
    tiny_gguf(tmp_path / "m.gguf")
    with caplog.at_level(logging.INFO, logger="mrv2"):
        folder = converted_checkpoint(tmp_path / "m.gguf")
    assert folder.parent == tmp_cache / "converted" and (folder / "model.safetensors").is_file()
    assert any("converting" in r.message and str(folder) in r.message for r in caplog.records)

    monkeypatch.setattr(gguf_convert, "convert_gguf_to_hf", lambda *a: pytest.fail("converted twice"))
    assert converted_checkpoint(tmp_path / "m.gguf") == folder
    shutil.copy(tmp_path / "m.gguf", tmp_path / "copy.gguf")  # same content elsewhere: same folder
    assert converted_checkpoint(tmp_path / "copy.gguf") == folder
    assert sorted(p.name for p in folder.parent.iterdir()) == [folder.name]


def test_uses_folder_another_process_finished(tmp_cache, tmp_path, tiny_gguf, monkeypatch):
    tiny_gguf(tmp_path / "m.gguf")
    real_convert = gguf_convert.convert_gguf_to_hf

    def lose_the_race(gguf_path, out_dir):
        real_convert(gguf_path, out_dir)  # the "other process"
        real_convert(gguf_path, out_dir)  # ours, which now finds the destination taken

    monkeypatch.setattr(gguf_convert, "convert_gguf_to_hf", lose_the_race)
    folder = converted_checkpoint(tmp_path / "m.gguf")
    assert (folder / "config.json").is_file()
    assert sorted(p.name for p in folder.parent.iterdir()) == [folder.name]


def test_folder_with_an_older_quantized_file_gets_the_current_one(tmp_cache, tmp_path, tiny_gguf):
    from mrv2.loader.cache import QUANT_FILE
    from mrv2.loader.gguf_quant import quantized_names

    tiny_gguf(tmp_path / "m.gguf")
    folder = converted_checkpoint(tmp_path / "m.gguf")
    current = folder / QUANT_FILE
    names = quantized_names(folder)
    assert names  # the tiny GGUF has Q8_0 tensors
    stale = current.parent / "gguf_blocks.safetensors"  # what version 1 wrote
    current.rename(stale)
    assert converted_checkpoint(tmp_path / "m.gguf") == folder
    assert current.is_file() and not stale.exists() and quantized_names(folder) == names
