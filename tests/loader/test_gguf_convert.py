import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors import safe_open

from mrv2.loader import (
    CorruptCheckpointError,
    UnsupportedArchitectureError,
    convert_gguf_to_hf,
    default_gguf_path,
    iter_safetensors_weights,
)


def converted(tmp_path: Path, tiny_gguf, arch: str = "llama", **kwargs) -> tuple[Path, dict[str, np.ndarray]]:
    expected = tiny_gguf(tmp_path / f"{arch}.gguf", arch, **kwargs)
    convert_gguf_to_hf(tmp_path / f"{arch}.gguf", tmp_path / "hf")
    return tmp_path / "hf", expected


@pytest.mark.parametrize(
    "arch, kwargs",
    [("llama", {}), ("llama", {"untied": True, "bias": True}), ("qwen2", {"bias": True}), ("qwen3", {})],
)
def test_weights_match_source(tmp_path, tiny_gguf, arch, kwargs):
    # The fixture stores q/k permuted the way llama.cpp does, so equality checks the un-permutation too.
    folder, expected = converted(tmp_path, tiny_gguf, arch, **kwargs)
    got = dict(iter_safetensors_weights(folder))
    assert got.keys() == expected.keys()
    for name, want in expected.items():
        assert got[name].dtype == torch.float32
        torch.testing.assert_close(got[name], torch.from_numpy(want), rtol=0, atol=0, msg=name)


def test_config_and_generation_config(tmp_path, tiny_gguf):
    folder, _ = converted(tmp_path, tiny_gguf, "qwen3")
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["model_type"] == "qwen3"
    assert (config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]) == (64, 4, 2)
    assert config["head_dim"] == 32  # from attention.key_length, not hidden_size // heads
    assert config["rms_norm_eps"] == 1e-6 and config["max_position_embeddings"] == 256
    assert config["tie_word_embeddings"] is True and config["torch_dtype"] == "float32"
    assert json.loads((folder / "generation_config.json").read_text()) == {"bos_token_id": 1, "eos_token_id": 2}


def test_loads_in_transformers(tmp_path, tiny_gguf):
    from transformers import AutoModelForCausalLM

    folder, _ = converted(tmp_path, tiny_gguf, "llama", untied=True)
    model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not any(info.values()), info
    assert type(model).__name__ == "LlamaForCausalLM" and not model.config.tie_word_embeddings


def test_tiny_tokenizer(tmp_path, tiny_gguf):
    from transformers import AutoTokenizer

    folder, _ = converted(tmp_path, tiny_gguf)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = tokenizer("the <|im_end|> t")["input_ids"]
    assert ids[-2:] == [2, tokenizer.convert_tokens_to_ids("Ġt")]
    assert tokenizer.decode(ids) == "the <|im_end|> t"
    saved = json.loads((folder / "tokenizer_config.json").read_text())
    assert saved["chat_template"].startswith("{% for m in messages %}") and saved["add_bos_token"] is False


def test_unsupported_architecture(tmp_path, tiny_gguf):
    tiny_gguf(tmp_path / "phi.gguf", "phi3")
    with pytest.raises(UnsupportedArchitectureError, match="phi3.*supported: llama, qwen2, qwen3"):
        convert_gguf_to_hf(tmp_path / "phi.gguf", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("keep", [0.0, 0.001, 0.5, 0.999])
def test_truncated_gguf(tmp_path, tiny_gguf, keep):
    tiny_gguf(tmp_path / "full.gguf")
    data = (tmp_path / "full.gguf").read_bytes()
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(CorruptCheckpointError, match="cut.gguf"):
        convert_gguf_to_hf(bad, tmp_path / "hf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cut.gguf", "full.gguf"]  # nothing left behind


def test_truncated_default_model_copy(tmp_path):
    source = default_gguf_path()
    with open(source, "rb") as f:
        (tmp_path / "half.gguf").write_bytes(f.read(source.stat().st_size // 2))
    with pytest.raises(CorruptCheckpointError, match="half.gguf"):
        convert_gguf_to_hf(tmp_path / "half.gguf", tmp_path / "hf")


def test_garbage_gguf(tmp_path):
    (tmp_path / "junk.gguf").write_bytes(os.urandom(4096))
    with pytest.raises(CorruptCheckpointError, match="junk.gguf"):
        convert_gguf_to_hf(tmp_path / "junk.gguf", tmp_path / "hf")


def test_refuses_non_empty_destination(tmp_path, tiny_gguf):
    tiny_gguf(tmp_path / "m.gguf")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "keep").write_text("x")
    with pytest.raises(FileExistsError):
        convert_gguf_to_hf(tmp_path / "m.gguf", tmp_path / "hf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "m.gguf"]  # no temp folder left


def test_default_model_tensors_match_direct_dequantization(converted_default_model):
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    config = json.loads((converted_default_model / "config.json").read_text())
    reader = GGUFReader(default_gguf_path())
    source = {t.name: t for t in reader.tensors}
    wanted = {
        "model.layers.3.self_attn.q_proj.weight": ("blk.3.attn_q.weight", config["num_attention_heads"]),
        "model.layers.3.self_attn.k_proj.weight": ("blk.3.attn_k.weight", config["num_key_value_heads"]),
        "model.layers.3.mlp.down_proj.weight": ("blk.3.ffn_down.weight", None),
        "model.embed_tokens.weight": ("token_embd.weight", None),
    }
    unpermute = LlamaTensorProcessor()._reverse_permute_weights  # transformers' own inverse, as a reference
    with safe_open(converted_default_model / "model.safetensors", framework="pt") as weights:
        got = {name: weights.get_tensor(name) for name in wanted}
        assert "lm_head.weight" not in weights.keys() and config["tie_word_embeddings"] is True
    for name, (gguf_name, kv_heads) in wanted.items():
        tensor = source[gguf_name]
        want = dequantize(tensor.data, tensor.tensor_type)
        if kv_heads is not None:
            want = unpermute(want, config["num_attention_heads"], kv_heads)
        torch.testing.assert_close(got[name], torch.from_numpy(np.ascontiguousarray(want)), rtol=0, atol=0, msg=name)


def test_default_model_tokenizer(converted_default_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(converted_default_model)
    # Reference ids checked against transformers' tokenizer built straight from the GGUF.
    assert tokenizer("Hello world 123")["input_ids"] == [19556, 905, 216, 33, 34, 35]
    for text in ["Hello world!", "  spaces\tand\nnewlines", "héllo 日本語 🙂", "<|im_start|>user\nhi<|im_end|>"]:
        assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    assert tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [1, 2]
    specials = (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token)
    assert specials == ("<|im_start|>", "<|im_end|>", "<|im_end|>")
    chat = [{"role": "user", "content": "hi"}]
    prompt = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert prompt == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_f32_copy_of_a_quantized_file_converts_to_the_same_weights(tmp_path, tiny_gguf):
    # tools/gguf_to_f32.py writes the F32 GGUF llama.cpp's fp32 figures run on: every tensor its
    # source's dequantization, every metadata field as it was (the file type now F32).
    tiny_gguf(tmp_path / "q.gguf")
    tool = Path(__file__).resolve().parents[2] / "tools" / "gguf_to_f32.py"
    subprocess.run([sys.executable, str(tool), str(tmp_path / "q.gguf"), str(tmp_path / "f32.gguf")], check=True)
    source, copy = GGUFReader(tmp_path / "q.gguf"), GGUFReader(tmp_path / "f32.gguf")
    assert {t.name for t in copy.tensors} == {t.name for t in source.tensors}
    assert {t.tensor_type.name for t in copy.tensors} == {"F32"}
    assert any(t.tensor_type.name == "Q8_0" for t in source.tensors)
    kept = [name for name in source.fields if not name.startswith("GGUF.") and name != "general.file_type"]
    for name in kept:
        assert copy.fields[name].contents() == source.fields[name].contents(), name
    assert copy.fields["general.file_type"].contents() == 0  # LlamaFileType.ALL_F32
    convert_gguf_to_hf(tmp_path / "q.gguf", tmp_path / "hf_q")
    convert_gguf_to_hf(tmp_path / "f32.gguf", tmp_path / "hf_f32")
    want, got = dict(iter_safetensors_weights(tmp_path / "hf_q")), dict(iter_safetensors_weights(tmp_path / "hf_f32"))
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)
