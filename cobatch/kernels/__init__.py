"""The native kernels wing: C sources (csrc/, one header), built into one library at first use (build.py),
declared to ctypes in one place (bindings.py), wrapped for torch tensors by one small module per kernel:
attention.py (paged attention, K/V writes), linear.py (packed bf16 GEMM), fused_ops.py (norm, RoPE, SiLU,
argmax), decoder.py (the C layer loop); hugepages.py places the tensors they stream, cpu.py reads the CPU's
features. It imports no other cobatch module: models and the runner build on it.
"""
