"""Write a dense (bf16 or fp32) copy of a GGUF file: every quantized tensor dequantized, all metadata kept.

Why: the default model ships as Q4_1; cobatch dequantizes it at load and serves dense bf16, so a fair
comparison with llama.cpp's `llama-server` gives it the same dense weights (docs/BENCHMARKS.md, Peers).

    .venv/bin/python scripts/dense_gguf.py OUT.gguf [--dtype bf16|f32] [--model IN.gguf]
"""
from __future__ import annotations

import argparse

import gguf
import numpy as np

from cobatch.model_paths import resolve_model_path

_TYPES = {"bf16": (gguf.GGMLQuantizationType.BF16, gguf.LlamaFileType.MOSTLY_BF16),
          "f32": (gguf.GGMLQuantizationType.F32, gguf.LlamaFileType.ALL_F32)}


def copy_metadata(reader: gguf.GGUFReader, writer: gguf.GGUFWriter, file_type: int) -> None:
    """Every key but the ones GGUFWriter writes itself; general.file_type says the new tensor type."""
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        value = file_type if field.name == gguf.Keys.General.FILE_TYPE else field.contents()
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, field.types[0], sub_type=sub_type)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--dtype", choices=sorted(_TYPES), default="bf16")
    parser.add_argument("--model", default=None, help="input GGUF (default: the built-in model)")
    args = parser.parse_args()
    reader = gguf.GGUFReader(str(resolve_model_path(args.model)))
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(args.out, arch)
    tensor_type, file_type = _TYPES[args.dtype]
    copy_metadata(reader, writer, int(file_type))
    for tensor in reader.tensors:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)  # numpy order: ne reversed
        values = np.ascontiguousarray(values.reshape(tuple(reversed(tensor.shape.tolist()))), dtype=np.float32)
        if values.ndim == 1:  # norms stay fp32, as llama.cpp's converter keeps them
            writer.add_tensor(tensor.name, values)
            continue
        writer.add_tensor(tensor.name, gguf.quants.quantize(values, tensor_type), raw_dtype=tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    print(f"wrote {args.out} ({args.dtype}, {len(reader.tensors)} tensors)")


if __name__ == "__main__":
    main()
