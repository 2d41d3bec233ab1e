"""Quantized GGUF tensors kept as codes and scales: written beside the converted checkpoint, read back exact."""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import dequantize, quantize

from mrv2.loader.cache import QUANT_FILE
from mrv2.loader.gguf_quant import iter_quantized_weights, quantized_names, write_quantized_weights
from quant_helpers import random_q4_k, random_q6_k


def test_every_kept_type_round_trips_through_the_quantized_file(tmp_path):
    rng = np.random.default_rng(0)
    path = tmp_path / "t.gguf"
    writer = GGUFWriter(path, "llama")
    raws = {
        "a.weight": (GGMLQuantizationType.Q4_K, random_q4_k(32, 512, rng), (32, 512)),
        "b.weight": (GGMLQuantizationType.Q4_1, quantize(rng.standard_normal((16, 64)).astype(np.float32),
                                                         GGMLQuantizationType.Q4_1), (16, 64)),
        "c.weight": (GGMLQuantizationType.Q8_0, quantize(rng.standard_normal((16, 96)).astype(np.float32),
                                                         GGMLQuantizationType.Q8_0), (16, 96)),
        "d.weight": (GGMLQuantizationType.F32, rng.standard_normal((16, 64)).astype(np.float32), (16, 64)),
        "e.weight": (GGMLQuantizationType.Q6_K, random_q6_k(16, 512, rng), (16, 512)),
    }
    for name, (qtype, raw, _) in raws.items():
        writer.add_tensor(name, raw, raw_dtype=None if qtype == GGMLQuantizationType.F32 else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    tensors = {t.name: t for t in GGUFReader(path).tensors}
    (tmp_path / QUANT_FILE).parent.mkdir()
    write_quantized_weights([(n, shape, tensors[n]) for n, (_, _, shape) in raws.items()], tmp_path / QUANT_FILE,
                            lambda name, array: array)
    # F32 stays with the dense weights
    assert quantized_names(tmp_path) == {"a.weight", "b.weight", "c.weight", "e.weight"}
    for name, weight in iter_quantized_weights(tmp_path):
        qtype, raw, shape = raws[name]
        assert weight.qtype == qtype.name
        want = dequantize(raw, qtype).reshape(shape)
        assert torch.equal(weight.dequantize(torch.float32), torch.from_numpy(want)), name
    wholes = dict(iter_quantized_weights(tmp_path))
    for name, lazy in iter_quantized_weights(tmp_path, lazy=True):  # a tensor-parallel rank's rows or columns
        for part in ((0, 4, 8), (1, 32, 32)):
            assert torch.equal(lazy.read(part).dequantize(), wholes[name].narrow(*part).dequantize()), (name, part)


def test_a_gguf_without_quantized_tensors_keeps_none(tmp_path):
    path = tmp_path / "f32.gguf"
    writer = GGUFWriter(path, "llama")
    writer.add_tensor("d.weight", np.ones((16, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tensor = GGUFReader(path).tensors[0]
    (tmp_path / QUANT_FILE).parent.mkdir()
    write_quantized_weights([("d.weight", (16, 64), tensor)], tmp_path / QUANT_FILE, lambda name, array: array)
    assert quantized_names(tmp_path) == set() and list(iter_quantized_weights(tmp_path)) == []
