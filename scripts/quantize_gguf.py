"""Write a GGUF copy of a model with its matrices in Q8_0, Q4_0, Q4_1, Q5_1 or Q4_K, all metadata kept.

Why: the default model ships as Q4_1 (which cobatch serves dense: it is the project's reference); these
files are the quantized kernels' end-to-end test inputs (tests/test_quantized_model.py) and the llama.cpp
comparison's quantized weights (docs/BENCHMARKS.md, Quantized weights). Every 2-D tensor is requantized
from its dequantized values: the 32-weight formats with gguf-py's reference quantizer, Q4_K with
models/quantization.py's plain one. As llama-quantize does, a matrix whose rows do not split into Q4_K's
256-weight super-blocks falls back to a 32-block format (here Q4_0; llama.cpp picks Q5_0); 1-D tensors
(norms) stay F32. `--tensor-type REGEX=TYPE` (as llama-quantize's) writes the matrices whose GGUF name
matches REGEX in TYPE instead, also in q5_0, q5_k, q6_k or tq2_0 (the last three: K a multiple of 256), or in a
type the kernel serves only through models/requantize.py, which gguf-py quantizes (tq1_0, K a multiple of
256, and mxfp4) or models/iq2_grid.py and models/iq1_trit.py do (iq2_xxs and iq1_s, K a multiple of 256): the
mixed files that
llama-quantize's Q4_K_M and the like are.

    .venv/bin/python scripts/quantize_gguf.py OUT.gguf --type q8_0|q4_0|q4_1|q5_1|q4_k [--model IN.gguf] \
        [--tensor-type 'blk\.0\.attn_v=q5_0' ...]
"""
from __future__ import annotations

import argparse
import re

import gguf
import numpy as np
import torch
from dense_gguf import copy_metadata

from cobatch.model_paths import resolve_model_path
from cobatch.models import iq1_trit, iq2_grid
from cobatch.models.quantization import GGUF_TYPES, quantize

_FILE_TYPES = {"q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
               "q4_1": gguf.LlamaFileType.MOSTLY_Q4_1, "q5_1": gguf.LlamaFileType.MOSTLY_Q5_1,
               "q4_k": gguf.LlamaFileType.MOSTLY_Q4_K_S}
_FALLBACK = "q4_0"  # for a Q4_K file's matrices with K % 256 != 0
# For --tensor-type, types the kernel does not serve as they are that gguf-py quantizes.
_OTHER_TYPES = {"tq1_0": gguf.GGMLQuantizationType.TQ1_0, "mxfp4": gguf.GGMLQuantizationType.MXFP4}


def _blocks(values: np.ndarray, fmt: str) -> tuple[np.ndarray, gguf.GGMLQuantizationType]:
    if fmt == "iq2_xxs":  # gguf-py has no IQ2_XXS quantizer: the plain one of models/iq2_grid.py
        return iq2_grid.quantize_iq2_xxs(values), gguf.GGMLQuantizationType.IQ2_XXS
    if fmt == "iq1_s":  # nor an IQ1_S one: models/iq1_trit.py's
        return iq1_trit.quantize_iq1_s(values), gguf.GGMLQuantizationType.IQ1_S
    if fmt in _OTHER_TYPES:
        return gguf.quants.quantize(values, _OTHER_TYPES[fmt]), _OTHER_TYPES[fmt]
    return quantize(torch.from_numpy(values), fmt).numpy().reshape(values.shape[0], -1), GGUF_TYPES[fmt]


def _override(name: str, overrides: list[tuple[re.Pattern, str]]) -> str | None:
    return next((fmt for pattern, fmt in overrides if pattern.search(name)), None)


def _parse_override(text: str) -> tuple[re.Pattern, str]:
    pattern, _, fmt = text.rpartition("=")
    if fmt not in {*GGUF_TYPES, *_OTHER_TYPES, "iq2_xxs", "iq1_s"}:
        raise argparse.ArgumentTypeError(f"unknown type {fmt!r} in {text!r}")
    return re.compile(pattern), fmt


def tensor_format(shape: tuple[int, ...], name: str) -> str | None:
    """The format a tensor of numpy shape [rows, K] is written in (None: F32)."""
    if len(shape) != 2:
        return None
    return _FALLBACK if name == "q4_k" and shape[1] % 256 else name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--type", choices=sorted(_FILE_TYPES), required=True)
    parser.add_argument("--model", default=None, help="input GGUF (default: the built-in model)")
    parser.add_argument("--tensor-type", type=_parse_override, action="append", default=[],
                        help="REGEX=TYPE: matrices whose name matches REGEX in TYPE")
    args = parser.parse_args()
    reader = gguf.GGUFReader(str(resolve_model_path(args.model)))
    writer = gguf.GGUFWriter(args.out, reader.fields[gguf.Keys.General.ARCHITECTURE].contents())
    copy_metadata(reader, writer, int(_FILE_TYPES[args.type]))
    for tensor in reader.tensors:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)  # numpy order: ne reversed
        values = np.ascontiguousarray(values.reshape(tuple(reversed(tensor.shape.tolist()))), dtype=np.float32)
        fmt = tensor_format(values.shape, args.type)
        if fmt is None:
            writer.add_tensor(tensor.name, values)
            continue
        blocks, raw_dtype = _blocks(values, _override(tensor.name, args.tensor_type) or fmt)
        writer.add_tensor(tensor.name, blocks, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    print(f"wrote {args.out} ({args.type}, {len(reader.tensors)} tensors)")


if __name__ == "__main__":
    main()
