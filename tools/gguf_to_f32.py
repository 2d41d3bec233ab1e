"""Write a GGUF file's weights dequantized to F32, its metadata as it is: the F32 GGUF of the same
model that llama.cpp's fp32 numbers are measured on (against `mrv2 --dtype float32`).

    python tools/gguf_to_f32.py IN.gguf OUT.gguf
"""

from __future__ import annotations

import argparse

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType
from gguf.quants import dequantize


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source")
    parser.add_argument("target")
    args = parser.parse_args()
    reader = GGUFReader(args.source)
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(args.target, arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in ("general.architecture", "general.file_type"):
            continue  # the writer's own header fields, and the file type it is given below
        kind = field.types[0]
        writer.add_key_value(field.name, field.contents(), kind,
                             sub_type=field.types[-1] if kind == GGUFValueType.ARRAY else None)
    writer.add_file_type(LlamaFileType.ALL_F32)
    for tensor in reader.tensors:
        if tensor.tensor_type == GGMLQuantizationType.F32:
            data = np.asarray(tensor.data)
        else:
            data = dequantize(tensor.data, tensor.tensor_type)
        # GGUF lists dimensions innermost first: numpy's shape is their reverse.
        writer.add_tensor(tensor.name, data.astype(np.float32).reshape(tuple(reversed(tensor.shape.tolist()))))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


if __name__ == "__main__":
    main()
