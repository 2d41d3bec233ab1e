"""Convert a llama.cpp GGUF file into an HF checkpoint folder.

The folder holds config.json, generation_config.json, an fp32 model.safetensors
and the tokenizer files, so everything downstream only ever reads HF format; beside
them, the quantized tensors' codes and scales (`mrv2.loader.gguf_quant`), for the
engines that run them quantized.
Weights are dequantized one tensor at a time and streamed into the safetensors
file, so peak memory is one tensor, not the whole fp32 model.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import tempfile
from pathlib import Path
from collections.abc import Callable
from typing import Any

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

from mrv2.loader.gguf_quant import QUANT_FILE, write_quantized_weights
from mrv2.loader.errors import CorruptCheckpointError, ModelLoadError, ModelNotFoundError, UnsupportedArchitectureError

# GGUF `general.architecture` -> (HF model_type, HF architecture)
GGUF_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
}

_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TENSOR_NAME = re.compile(r"(?:blk\.(\d+)\.)?(\w+)\.(weight|bias)")


def convert_gguf_to_hf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike) -> None:
    """Write the HF checkpoint equivalent of `gguf_path` to `out_dir`, atomically.

    Raises FileExistsError if `out_dir` already holds something (for example
    another process finished the same conversion first).
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if not gguf_path.is_file():
        raise ModelNotFoundError(gguf_path)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"{out_dir} already exists and is not empty")
    reader = _open_gguf(gguf_path)
    meta = _Metadata(reader, gguf_path)
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedArchitectureError(f"{arch} (GGUF {gguf_path})", GGUF_ARCHITECTURES)
    config = _hf_config(meta, arch, reader)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    try:
        entries = _entries(reader, gguf_path)
        _write_weights(entries, gguf_path, config, arch, tmp / "model.safetensors")
        (tmp / QUANT_FILE).parent.mkdir()
        write_quantized_weights(entries, tmp / QUANT_FILE, _row_permutation(config, arch))
        _write_json(tmp / "config.json", config)
        _write_json(tmp / "generation_config.json", {k: config[k] for k in ("bos_token_id", "eos_token_id")})
        _write_tokenizer(gguf_path, config["max_position_embeddings"], tmp)
        try:
            os.rename(tmp, out_dir)  # atomic; only replaces an empty directory
        except OSError as exc:
            if out_dir.exists():
                raise FileExistsError(f"{out_dir} appeared while converting {gguf_path}") from exc
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def ensure_quantized_weights(gguf_path: str | os.PathLike, folder: str | os.PathLike) -> None:
    """Add the quantized weights to a folder converted before they were kept (atomically)."""
    gguf_path, folder = Path(gguf_path), Path(folder)
    if (folder / QUANT_FILE).is_file():
        return
    reader = _open_gguf(gguf_path)
    config = json.loads((folder / "config.json").read_text())
    arch = _Metadata(reader, gguf_path).get("general.architecture")
    (folder / QUANT_FILE).parent.mkdir(exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".gguf_blocks.", dir=(folder / QUANT_FILE).parent)
    os.close(fd)
    try:
        write_quantized_weights(_entries(reader, gguf_path), Path(tmp), _row_permutation(config, arch))
        os.replace(tmp, folder / QUANT_FILE)
        for stale in (folder / QUANT_FILE).parent.glob("gguf_blocks*.safetensors"):  # an older version's
            if stale.name != Path(QUANT_FILE).name:
                stale.unlink()
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _open_gguf(path: Path) -> GGUFReader:
    try:
        reader = GGUFReader(path)
    except Exception as exc:  # the reader fails with whatever numpy or struct raises first
        raise CorruptCheckpointError(path, f"not a readable GGUF file ({type(exc).__name__}: {exc})") from exc
    for tensor in reader.tensors:
        if tensor.data.nbytes != int(tensor.n_bytes):
            raise CorruptCheckpointError(path, f"tensor {tensor.name} is cut short")
    return reader


class _Metadata:
    """Typed access to a GGUF file's key/value metadata."""

    def __init__(self, reader: GGUFReader, path: Path) -> None:
        self.fields, self.path = reader.fields, path

    def get(self, key: str, default: Any = None) -> Any:
        field = self.fields.get(key)
        return default if field is None else field.contents()

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise CorruptCheckpointError(self.path, f"GGUF metadata key {key!r} is missing")
        return value


def _f32(value: float) -> float:
    # GGUF stores float32: 1e-5 comes back as 9.99999974e-06. The shortest decimal that
    # rounds to the same float32 is the value the original config had.
    return float(str(np.float32(value)))


def _hf_config(meta: _Metadata, arch: str, reader: GGUFReader) -> dict[str, Any]:
    model_type, architecture = GGUF_ARCHITECTURES[arch]
    names = {tensor.name for tensor in reader.tensors}
    if "rope_freqs.weight" in names:
        raise ModelLoadError(f"{meta.path}: per-dimension RoPE frequency factors (Llama 3.1 style) are not supported")
    if meta.get(f"{arch}.rope.scaling.type", "none") not in ("none", "linear"):
        raise ModelLoadError(f"{meta.path}: RoPE scaling {meta.get(f'{arch}.rope.scaling.type')!r} is not supported")
    if "token_embd.weight" not in names:
        raise CorruptCheckpointError(meta.path, "no token_embd.weight tensor")

    hidden = meta.require(f"{arch}.embedding_length")
    heads = meta.require(f"{arch}.attention.head_count")
    vocab_size = int(next(t for t in reader.tensors if t.name == "token_embd.weight").shape[-1])
    config: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": meta.require(f"{arch}.feed_forward_length"),
        "num_hidden_layers": meta.require(f"{arch}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": meta.get(f"{arch}.attention.head_count_kv", heads),
        "head_dim": meta.get(f"{arch}.attention.key_length", hidden // heads),
        "hidden_act": "silu",
        "rms_norm_eps": _f32(meta.require(f"{arch}.attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": meta.require(f"{arch}.context_length"),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
    }
    if meta.get(f"{arch}.rope.scaling.type") == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": _f32(meta.require(f"{arch}.rope.scaling.factor"))}
    if arch == "llama":
        config["attention_bias"] = "blk.0.attn_q.bias" in names
        if config["attention_bias"] != ("blk.0.attn_output.bias" in names):
            raise ModelLoadError(f"{meta.path}: HF llama needs biases on all of q/k/v/o or on none")
    return config


def _hf_name(gguf_name: str, path: Path) -> str:
    match = _TENSOR_NAME.fullmatch(gguf_name)
    table = _LAYER_TENSORS if match and match[1] is not None else _GLOBAL_TENSORS
    if match is None or match[2] not in table:
        raise ModelLoadError(f"{path}: GGUF tensor {gguf_name!r} has no HF counterpart")
    prefix = f"model.layers.{match[1]}." if match[1] is not None else ""
    return f"{prefix}{table[match[2]]}.{match[3]}"


def _unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    # llama.cpp's convert_hf_to_gguf interleaves each head's rotary halves for q/k
    # (rows (half, pair) -> (pair, half)); this is its inverse, as in transformers' GGUF loader.
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _entries(reader: GGUFReader, path: Path) -> list[tuple[str, tuple[int, ...], Any]]:
    """(HF name, HF shape, GGUF tensor) of every tensor."""
    entries = []
    for tensor in reader.tensors:
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))  # GGUF lists dims fastest-first
        entries.append((_hf_name(tensor.name, path), shape, tensor))
    return entries


def _row_permutation(config: dict[str, Any], arch: str) -> Callable[[str, np.ndarray], np.ndarray]:
    """Undo llama.cpp's rotary row order on q/k weights (any array with one row per output row)."""
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}

    def permute(name: str, rows: np.ndarray) -> np.ndarray:
        proj = name.split(".")[-2]
        return _unpermute_rope_rows(rows, heads[proj]) if arch == "llama" and proj in heads else rows

    return permute


def _write_weights(entries: list[tuple[str, tuple[int, ...], Any]], path: Path, config: dict[str, Any], arch: str,
                   out: Path) -> None:
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape, _ in entries:
        nbytes = 4 * int(np.prod(shape))
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)

    permute = _row_permutation(config, arch)
    with open(out, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for name, shape, tensor in entries:
            try:
                w = dequantize(tensor.data, tensor.tensor_type).reshape(shape)
            except NotImplementedError as exc:
                raise ModelLoadError(f"{path}: cannot dequantize {tensor.name} ({tensor.tensor_type.name})") from exc
            except ValueError as exc:
                raise CorruptCheckpointError(path, f"tensor {tensor.name}: {exc}") from exc
            f.write(np.ascontiguousarray(permute(name, w), dtype=np.float32).data)


def _write_tokenizer(gguf_path: Path, max_length: int, out: Path) -> None:
    # transformers builds the fast tokenizer from the GGUF vocabulary, merges and token
    # types without touching the tensors; we only save what it builds.
    from transformers import TokenizersBackend
    from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer

    try:
        arch, tokenizer_dict, tokenizer_config = get_gguf_tokenizer(str(gguf_path))
        backend, extra = convert_gguf_tokenizer(arch, tokenizer_dict)
    except (KeyError, ValueError) as exc:
        raise ModelLoadError(f"{gguf_path}: cannot build a tokenizer from its metadata ({exc})") from exc
    tokenizer = TokenizersBackend(
        tokenizer_object=backend, model_max_length=max_length, **{**tokenizer_config, **extra}
    )
    tokenizer.save_pretrained(out)
    # save_pretrained drops defaults and moves the template to chat_template.jinja; keep
    # them in tokenizer_config.json too, where every reader looks.
    config_path = out / "tokenizer_config.json"
    saved = json.loads(config_path.read_text())
    for key in ("chat_template", "add_bos_token", "add_eos_token"):
        if tokenizer_config.get(key) is not None:
            saved[key] = tokenizer_config[key]
    _write_json(config_path, saved)


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")
