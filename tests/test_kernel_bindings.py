"""kernels/bindings.py against the C side: each ctypes struct's size and field offsets equal what the built
library reports (csrc/layout.c), and each entry point of csrc/cobatch_kernels.h has a signature of the
same arity and types, so Python never passes a shifted field or a misread argument."""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import pytest

from cobatch.kernels import bindings
from cobatch.kernels.bindings import SIGNATURES, STRUCTS, load_kernels, struct_layouts

HEADER = Path(bindings.__file__).parent / "csrc" / "cobatch_kernels.h"
# An exported prototype: return type, name, parameters (none of them holds parentheses).
PROTOTYPE = re.compile(r"^(?!static|typedef|#)([A-Za-z_][\w ]*?\**)\s*\b(\w+)\(([^()]*)\);", re.MULTILINE)

LIB = load_kernels()
needs_library = pytest.mark.skipif(LIB is None, reason="the kernels library cannot be built here")


def _ctype_of(declaration: str) -> type | None:
    """The ctypes type bindings.py uses for a C parameter or return type (any pointer: a pointer type)."""
    if "*" in declaration:
        return ctypes.c_void_p
    words = declaration.split()
    kind = {"void": None, "int": ctypes.c_int, "int64_t": ctypes.c_int64, "float": ctypes.c_float}
    return kind[next(w for w in words if w in kind)]


def _as_declared(ctype: type | None) -> type | None:
    """Pointer types (c_void_p, c_char_p, POINTER(struct)) compare as one: C's prototypes say `T *`."""
    is_pointer = ctype is not None and (ctype in (ctypes.c_void_p, ctypes.c_char_p)
                                        or issubclass(ctype, ctypes._Pointer))
    return ctypes.c_void_p if is_pointer else ctype


def _header_prototypes() -> dict[str, tuple[type | None, list[type | None]]]:
    prototypes = {}
    for returns, name, params in PROTOTYPE.findall(HEADER.read_text()):
        params = " ".join(params.split())
        args = [] if params == "void" else [_ctype_of(p) for p in params.split(",")]
        prototypes[name] = (_ctype_of(returns), args)
    return prototypes


def test_every_entry_point_of_the_header_has_its_signature() -> None:
    prototypes = _header_prototypes()
    assert "decoder_forward" in prototypes and "gemm_bf16" in prototypes  # the parser sees them
    assert set(prototypes) == set(SIGNATURES)
    for name, (restype, argtypes) in SIGNATURES.items():
        declared = (_as_declared(restype), [_as_declared(t) for t in argtypes])
        assert declared == prototypes[name], name


@needs_library
def test_every_struct_has_the_c_layout() -> None:
    layouts = struct_layouts(LIB)
    assert set(layouts) == {struct.__name__ for struct in STRUCTS}
    for struct in STRUCTS:
        (_, _, size), *fields = layouts[struct.__name__]
        assert ctypes.sizeof(struct) == size, struct.__name__
        mirrored = [(name, getattr(struct, name).offset, getattr(struct, name).size) for name, _ in struct._fields_]
        assert mirrored == fields, struct.__name__


@needs_library
def test_the_library_exports_every_entry_point() -> None:
    assert bindings.bind(LIB) is LIB  # raises AttributeError on a missing symbol
    assert bindings.kernel_seconds(LIB) is None  # timers only in the -DKERNEL_TIMERS build
