"""This CPU's compute peaks on one thread: int8 multiply-adds (AVX-512 VNNI's vpdpbusd), fp32 FMAs (AVX-512F)
and, where the CPU has AVX512-BF16, bf16 pair dot products (vdpbf16ps), and where it has AMX-BF16, bf16
tile products (tdpbf16ps, which cobatch's bf16 kernel uses there). On a CPU with AVX2 + FMA but no
AVX-512 VNNI: int8 as vpmaddubsw (32 u8 x s8 products into int16 pair sums, what both cobatch's and
llama.cpp's AVX2 dot products are built on) with a vpaddw each, 6 accumulators and their own operands in
a function of their own (13 of AVX2's 16 registers; with 12, as the AVX-512 loop has, gcc kept them on the
stack and a Zen 3 measured a third of its rate); the vpmaddwd that widens the sums is left out, so the
ceiling is generous. fp32 as 8-lane FMAs.

What a batch's ceiling is made of: at batch 16 a decode step is compute-bound, so no engine serves a
batch faster than its multiply-adds over the peak rate of the instruction it needs: int8 dot products
for Q8_0 / Q4_0 weights against int8-quantized activations; for bf16 weights, where the CPU has bf16
instructions, the fastest of them and of fp32 FMAs on widened bf16, else fp32 FMAs (both cobatch and
llama.cpp then widen bf16 to fp32). Measured by a C loop of 12 independent accumulators (AMX: 4 tiles;
no loads, nothing but the instruction), compiled here with the system's C compiler, timed for ~0.5 s
each, the best of 5 runs.

    .venv/bin/python -m benchmarks.cpu_peak
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from cobatch.kernels.cpu import cpu_flags

_SOURCE = r"""
#define _DEFAULT_SOURCE
#include <immintrin.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
int main(void) {
    const long reps = 100000000;
    __m512i a[12], b = _mm512_set1_epi8(1), c = _mm512_set1_epi8(1);
    for (int i = 0; i < 12; i++) a[i] = _mm512_setzero_si512();
    double t = now();
    for (long r = 0; r < reps; r++) {
#pragma GCC unroll 12
        for (int i = 0; i < 12; i++) a[i] = _mm512_dpbusd_epi32(a[i], b, c);
        __asm__ volatile("" : "+v"(b));
    }
    const double int8_s = now() - t;
    __m512 f[12], x = _mm512_set1_ps(0.5f), y = _mm512_set1_ps(0.25f);
    for (int i = 0; i < 12; i++) f[i] = _mm512_setzero_ps();
    t = now();
    for (long r = 0; r < reps; r++) {
#pragma GCC unroll 12
        for (int i = 0; i < 12; i++) f[i] = _mm512_fmadd_ps(f[i], x, y);
        __asm__ volatile("" : "+v"(x));
    }
    const double fp32_s = now() - t;
    double bf16_rate = 0.0; /* 0: no AVX512-BF16 */
#ifdef __AVX512BF16__
    __m512 h[12];
    __m512i p = _mm512_set1_epi16(0x3f00), q = _mm512_set1_epi16(0x3e80); /* bf16 0.5, 0.25 */
    for (int i = 0; i < 12; i++) h[i] = _mm512_setzero_ps();
    t = now();
    for (long r = 0; r < reps; r++) {
#pragma GCC unroll 12
        for (int i = 0; i < 12; i++) h[i] = _mm512_dpbf16_ps(h[i], (__m512bh)p, (__m512bh)q);
        __asm__ volatile("" : "+v"(p));
    }
    bf16_rate = reps * 12.0 * 32 / (now() - t);
    for (int i = 0; i < 12; i++) f[i] = _mm512_add_ps(f[i], h[i]);
#endif
    double amx_rate = 0.0; /* 0: no AMX-BF16, or Linux does not grant the tile state */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (syscall(SYS_arch_prctl, 0x1023, 18) == 0) { /* ARCH_REQ_XCOMP_PERM, XTILEDATA */
        struct { unsigned char palette, start, reserved[14]; unsigned short colsb[16]; unsigned char rows[16]; } cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.palette = 1;
        for (int i = 0; i < 6; i++) cfg.rows[i] = 16, cfg.colsb[i] = 64;
        _tile_loadconfig(&cfg);
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        _tile_zero(4);
        _tile_zero(5);
        const long tiles = reps / 8;
        t = now();
        for (long r = 0; r < tiles; r++) { /* 4 independent sums: 16 x 16 x 32 multiply-adds each */
            _tile_dpbf16ps(0, 4, 5);
            _tile_dpbf16ps(1, 4, 5);
            _tile_dpbf16ps(2, 4, 5);
            _tile_dpbf16ps(3, 4, 5);
        }
        amx_rate = tiles * 4.0 * 16 * 16 * 32 / (now() - t);
        _tile_release();
    }
#endif
    __m512i sa = a[0];
    __m512 sf = f[0];
    for (int i = 1; i < 12; i++) sa = _mm512_add_epi32(sa, a[i]), sf = _mm512_add_ps(sf, f[i]);
    printf("%.6e %.6e %.6e %.6e %d %f\n", reps * 12.0 * 64 / int8_s, reps * 12.0 * 16 / fp32_s, bf16_rate,
           amx_rate, _mm512_reduce_add_epi32(sa), _mm512_reduce_add_ps(sf));
    return 0;
}
"""


# The same loops on 256-bit registers (AVX2 + FMA, no AVX-512): int8 as vpmaddubsw, fp32 as 8-lane FMAs.
_SOURCE_AVX2 = r"""
#include <immintrin.h>
#include <stdio.h>
#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
/* In a function of its own, so that its registers are its own: in main, gcc kept the sums on the stack (the
 * fp32 loop below wants every register) and timed the store-to-load latency of each add instead. */
static __attribute__((noinline)) __m256i int8_loop(long reps) {
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, b = _mm256_set1_epi8(1);
    __m256i c0 = _mm256_set1_epi8(2), c1 = _mm256_set1_epi8(3), c2 = _mm256_set1_epi8(4), c3 = _mm256_set1_epi8(5),
            c4 = _mm256_set1_epi8(6), c5 = _mm256_set1_epi8(7);
    for (long r = 0; r < reps; r++) { /* the pair sums added up in int16, as gemm_quant.c's AVX2 path does */
        a0 = _mm256_add_epi16(a0, _mm256_maddubs_epi16(b, c0));
        a1 = _mm256_add_epi16(a1, _mm256_maddubs_epi16(b, c1));
        a2 = _mm256_add_epi16(a2, _mm256_maddubs_epi16(b, c2));
        a3 = _mm256_add_epi16(a3, _mm256_maddubs_epi16(b, c3));
        a4 = _mm256_add_epi16(a4, _mm256_maddubs_epi16(b, c4));
        a5 = _mm256_add_epi16(a5, _mm256_maddubs_epi16(b, c5));
        __asm__ volatile("" : "+x"(b));
    }
    return _mm256_add_epi16(_mm256_add_epi16(_mm256_add_epi16(a0, a1), _mm256_add_epi16(a2, a3)),
                            _mm256_add_epi16(a4, a5));
}
int main(void) {
    const long reps = 100000000;
    double t = now();
    const __m256i sa = int8_loop(2 * reps); /* 6 vpmaddubsw an iteration: 12 x reps in all */
    const double int8_s = now() - t;
    __m256 f[12], x = _mm256_set1_ps(0.5f), y = _mm256_set1_ps(0.25f);
    for (int i = 0; i < 12; i++) f[i] = _mm256_setzero_ps();
    t = now();
    for (long r = 0; r < reps; r++) {
#pragma GCC unroll 12
        for (int i = 0; i < 12; i++) f[i] = _mm256_fmadd_ps(f[i], x, y);
        __asm__ volatile("" : "+x"(x));
    }
    const double fp32_s = now() - t;
    __m256 sf = f[0];
    for (int i = 1; i < 12; i++) sf = _mm256_add_ps(sf, f[i]);
    int out[8];
    float outf[8];
    _mm256_storeu_si256((__m256i *)out, sa);
    _mm256_storeu_ps(outf, sf);
    printf("%.6e %.6e 0 0 %d %f\n", reps * 12.0 * 32 / int8_s, reps * 12.0 * 8 / fp32_s, out[0], outf[0]);
    return 0;
}
"""

_RUNS = 5  # ~0.7 s each


@dataclass(frozen=True, slots=True)
class ComputePeaks:
    """Multiply-adds per second on one thread."""

    int8_macs_per_s: float
    fp32_macs_per_s: float
    bf16_macs_per_s: float | None = None  # None: no AVX512-BF16
    amx_bf16_macs_per_s: float | None = None  # None: no AMX-BF16

    @property
    def bf16_math_macs_per_s(self) -> float | None:
        """The rate of bf16 multiply-adds where the CPU has a bf16 instruction: the fastest way to do them,
        its bf16 instructions' or fp32 FMAs on widened bf16 (exact products; on some Intel cores vdpbf16ps
        runs at half the FMA rate); None where it has no bf16 instruction."""
        if not (self.bf16_macs_per_s or self.amx_bf16_macs_per_s):
            return None
        return max(r for r in (self.bf16_macs_per_s, self.amx_bf16_macs_per_s, self.fp32_macs_per_s) if r)


def _has_avx512_vnni() -> bool:
    """Whether the AVX-512 probe (_SOURCE) runs here; else the AVX2 one."""
    return {"avx512f", "avx512_vnni"} <= cpu_flags()


def measure() -> ComputePeaks | None:
    """Both peaks (the best of _RUNS runs: a peak, on a shared host), or None where there is neither AVX-512
    VNNI nor AVX2 + FMA, or no C compiler."""
    compiler, avx512 = shutil.which("cc") or shutil.which("gcc"), _has_avx512_vnni()
    if compiler is None or not (avx512 or {"avx2", "fma"} <= cpu_flags()):
        return None
    with tempfile.TemporaryDirectory() as tmp:
        source, binary = Path(tmp) / "peak.c", Path(tmp) / "peak"
        source.write_text(_SOURCE if avx512 else _SOURCE_AVX2)
        subprocess.run([compiler, "-O2", "-march=native", str(source), "-o", str(binary)], check=True,
                       capture_output=True, timeout=120)
        runs = [subprocess.run([str(binary)], check=True, capture_output=True, text=True, timeout=120).stdout.split()
                for _ in range(_RUNS)]
    bf16, amx = (max(float(r[i]) for r in runs) for i in (2, 3))
    return ComputePeaks(max(float(r[0]) for r in runs), max(float(r[1]) for r in runs), bf16 or None, amx or None)


def main() -> int:
    peaks = measure()
    if peaks is None:
        print("needs AVX-512 VNNI or AVX2 + FMA, and a C compiler", file=sys.stderr)
        return 1
    bf16 = f", bf16 {peaks.bf16_macs_per_s / 1e9:.1f} GMAC/s (vdpbf16ps)" if peaks.bf16_macs_per_s else ""
    if peaks.amx_bf16_macs_per_s:
        bf16 += f", bf16 {peaks.amx_bf16_macs_per_s / 1e9:.1f} GMAC/s (AMX tdpbf16ps)"
    avx512 = _has_avx512_vnni()
    print(f"one thread: int8 {peaks.int8_macs_per_s / 1e9:.1f} GMAC/s ({'vpdpbusd' if avx512 else 'vpmaddubsw'}), "
          f"fp32 {peaks.fp32_macs_per_s / 1e9:.1f} GFMA/s (vfmadd, {16 if avx512 else 8} lanes){bf16}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
