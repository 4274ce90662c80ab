/* GEMM on GGUF-quantized weights: y[M, N] = x[M, K] @ W[N, K]^T (+ bias[N]), W kept in its 2.06 to 8.5 bits per
 * weight (Q8_0, Q4_0, Q4_1, Q2_K, Q3_K, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, IQ4_NL, IQ4_XS, IQ4_TAB, IQ4_TAB16,
 * IQ2_GRID, IQ1_TRIT, IQ3_TAB16, TQ2_0), x fp32 or bf16, fp32 accumulation.
 *
 * Why: decode at small batch streams every weight from DRAM once per step, so its time is the weights'
 * bytes over the memory bandwidth: Q8_0 reads 1.06 bytes a weight against bf16's 2 and fp32's 4, Q6_K 0.82,
 * Q5_0 and Q5_K 0.69, Q4_0 and Q4_K 0.56. Dequantizing at load would give that back.
 *
 * Activations: each row of x is quantized on the fly to int8 (scale dx = max|x| / 127, q =
 * round-to-nearest-even(x / dx)) per block of 32, or per 256 for the K-quants (llama.cpp's Q8_0 / Q8_K
 * activations), and the sum of each 32-block's q kept (and of each half, for Q6_K). A weight block's dot
 * with it is then one integer sum
 * (Q6_K: one per 16 weights), taken 4 products at a time by
 * AVX-512 VNNI's vpdpbusd (u8 x s8): the weight side is the unsigned operand, as a code c = w / a + o in
 * 0..255 with a per-block offset o, so sum(w x) = dx * a * (sum(c q) - o sum(q)):
 *     Q8_0: c = w + 128 (its int8 with the sign bit flipped, done once at packing), a = d, o = 128;
 *     Q4_0: c = the 4-bit code 0..15, a = d, o = 8;
 *     Q5_0: c = the 5-bit code 0..31 (4 low bits as Q4_0's, the fifth from qh), a = d, o = 16;
 *     Q4_1, Q5_1: c = Q4_0's / Q5_0's code, w = d c + m with a min m per block, o = 0: sum(w x) =
 *           dx (d sum(c q) + m sum(q)), the min's part one more FMA per block (llama.cpp's way too);
 *     Q4_K: c = the 4-bit code, per 32-weight sub-block i w = d scale_i c - dmin min_i, so over a
 *           256-block sum(w x) = dx (d sum_i scale_i sum(c q) - dmin sum_i min_i sum(q)) (Numerics);
 *     Q5_K: as Q4_K, c the 5-bit code 0..31 (4 low bits as Q4_K's, the fifth from qh);
 *     Q6_K: c = the 6-bit code 0..63, per 16-weight sub-block a = d * scale (int8), o = 32: each half
 *           of a 32-block has its own integer sum, times its scale (Numerics), and a = d;
 *     Q3_K: c = the 3-bit code 0..7, per 16-weight sub-block a = d * scale (6 bits, - 32), o = 4: as Q6_K;
 *     Q2_K: c = the 2-bit code 0..3, per 16-weight sub-block w = d scale c - dmin min (4 bits each): Q6_K's
 *           two sums a 32-block, and Q4_K's mins (times x's 16-block sums);
 *     IQ4_NL: c = the 4-bit index's value in llama.cpp's non-linear table (int8) + 128, looked up by a
 *           byte shuffle (vpshufb), a = d, o = 128;
 *     IQ4_XS: c as IQ4_NL's, o = 128, per 32-weight sub-block a = d * scale (6 bits, - 32): as Q6_K, the
 *           sub-block's integer sum times its scale;
 *     IQ4_TAB: IQ4_XS with its own table of 16 values in each block, in eighths (a = d * scale / 8): the
 *           i-quants whose grids hold at most 16 values (IQ2_XXS, IQ1_S, IQ3_XXS, IQ3_S:
 *           models/requantize.py) in IQ4_XS's terms, exactly;
 *     IQ4_TAB16: IQ4_TAB's codes and table with Q6_K's d and int8 scale per 16 weights (two integer sums a
 *           32-block, as Q6_K): IQ2_XS, IQ2_S, IQ1_M;
 *     IQ2_GRID: IQ4_TAB's a, o and c (value + 128), the value looked up from IQ2_XXS's own grid index and
 *           sign bits (iq2_codes): IQ2_XXS at 2.25 bits a weight where the CPU has AVX-512 VBMI;
 *     IQ1_TRIT: c = IQ1_S's grid value + 1 (0..2, a 2-bit code), per 32-weight sub-block w = d s c - d / 8 min
 *           with s = 2 ls + 1 and min = s (8 -+ 1) (IQ1_S's delta of +-1/8 folded in): Q4_K's sums with Q2_K's
 *           codes, IQ1_S at 2.19 bits a weight (models/iq1_trit.py);
 *     IQ3_TAB16: IQ4_TAB16's scales, table, a and o, the index 3 bits in Q3_K's code layout: IQ2_XS, IQ2_S and
 *           IQ1_M (6 values each) at 3.69 bits a weight against IQ4_TAB16's 4.75;
 *     TQ2_0: c = the 2-bit code 0..3, a = d, o = 1, no sub-block scale (w = d (c - 1)): a K-quant whose 256-block
 *           sums need no multiply, ternary files (TQ2_0 as it is, TQ1_0 as TQ2_0) at 2.06 bits a weight.
 *
 * Layout (kernels/quant_linear.py packs it once at load from GGUF's blocks; the same bytes, reordered): the
 * weight is cut into panels of 16 output rows, and each panel into its blocks along K (32 weights, K-quants:
 * 256), one after another; in a panel block each row's bytes of a kind sit side by side, so a 64-byte line
 * holds one group of 4 K of all 16 rows: the vpdpbusd operand whose 16 lanes are the panel's 16 outputs
 * (no horizontal sums, as gemm_bf16.c). With l a row of the panel (0..15):
 *     Q8_0 (544 bytes): d[16] fp16 | codes[8][16][4]: codes[g][l][t] = w[l][4 g + t] + 128
 *     Q4_0 (288 bytes): d[16] fp16 | qs[4][16][4]: GGUF's qs bytes 4 g .. 4 g + 3 of row l (low nibbles: K
 *                       4 g + t, high: 16 + 4 g + t)
 *     Q5_0 (352 bytes): d[16] fp16 | hb[16][4]: bit g of byte t of row l is the fifth bit of K 4 g + t
 *                       (GGUF's qh bit 4 g + t, regrouped at packing) | qs[4][16][4] as Q4_0's
 *     Q4_1 (320 bytes): d[16] | m[16] fp16 | qs[4][16][4] as Q4_0's
 *     Q5_1 (384 bytes): d[16] | m[16] fp16 | hb[16][4] as Q5_0's | qs[4][16][4] as Q4_0's
 *     Q4_K (2304 bytes): d[16] | dmin[16] fp16 | scales[3][16][4]: GGUF's 12 scale bytes of row l, 4 at a
 *                       time | qs[4][8][16][4]: GGUF's qs bytes 32 c + 4 g .. + 3 (low nibbles: K 64 c +
 *                       4 g + t, sub-block 2 c; high: 64 c + 32 + 4 g + t, sub-block 2 c + 1)
 *     Q5_K (2816 bytes): Q4_K's header | then per pair c of 32-blocks (0..3): hb0[16][4] | qs[8][16][4] as
 *                       Q4_K's qs[c] | hb1[16][4] (hb_h: bit g of byte t of row l is the fifth bit of K
 *                       32 (2 c + h) + 4 g + t, as Q5_0's; from GGUF's qh at packing, pack_q5_k)
 *     Q3_K (1760 bytes): d[16] fp16 | scales[3][16][4]: GGUF's 12 scale bytes of row l, 4 at a time | then
 *                       per 32-block c (0..7): low[2][16][4] (bits 2 (g % 4), + 1 of byte t of row l in
 *                       vector g / 4: the low bits of the code of K 32 c + 4 g + t) | hb[16][4] (bit g:
 *                       its third bit), regrouped from GGUF's qs / hmask at packing
 *     Q2_K (1344 bytes): d[16] | dmin[16] fp16 | scales[4][16][4]: GGUF's 16 scale bytes of row l, 4 at a
 *                       time (scale: the low nibble, min: the high) | then per 32-block c: low[2][16][4] as
 *                       Q3_K's (from GGUF's qs)
 *     IQ4_NL (576 bytes): two 32-blocks, each as Q4_0's (d[16] | qs[4][16][4]): a panel size of its own
 *     IQ4_XS (2176 bytes): d[16] fp16 | scales_h[16] u16 | scales_l[16][4]: GGUF's of row l (sub-block i's
 *                       scale: nibble i of the 4 bytes, bits 2 i, 2 i + 1 of scales_h on top) | then per
 *                       32-block c (0..7): qs[4][16][4] as Q4_0's (GGUF's qs bytes 16 c + 4 g .. + 3)
 *     IQ4_TAB (2240 bytes): IQ4_XS's | table[16][4]: row l's 4 bytes of the 16 codes' values + 128 (bytes
 *                       4 (l % 4) ..: the line holds the table 4 times, once per 128-bit lane for vpshufb)
 *     IQ4_TAB16 (2432 bytes): d[16] fp16 | scales[16][16] int8 as Q6_K's | 32 unused | per 32-block c:
 *                       qs[4][16][4] as IQ4_XS's | table[16][4] as IQ4_TAB's
 *     IQ2_GRID (1152 bytes): IQ4_XS's d and scales | per 32-block c: idx[16][4] | neg[8][8] (IQ2_CODES)
 *     IQ1_TRIT (1120 bytes): d[16] fp16 | scales[16][4]: row l's 4 bytes, byte b's low nibble sub-block b's
 *                       (ls | 8 where its delta is negative), its high nibble sub-block 4 + b's | then per
 *                       32-block c: low[2][16][4] as Q2_K's
 *     IQ3_TAB16 (1888 bytes): d[16] fp16 | scales[16][16] int8 as Q6_K's | per 32-block c: low[2][16][4] |
 *                       hb[16][4] as Q3_K's (the table index) | table[16][4] as IQ4_TAB's
 *     TQ2_0 (1056 bytes): d[16] fp16 | per 32-block c: low[2][16][4] as Q2_K's (from GGUF's qs, Q2_K's order)
 *     Q6_K (3360 bytes): d[16] fp16 | scales[16][16] int8 (sub-block s of lane l at 16 s + l) | then per
 *                       32-block c (0..7) of the super-block, per half h: v[3][16][4]: byte (r, l, t) =
 *                       the code of K 32 c + 16 h + 4 r + t in bits 0..5, and bits 2 r, 2 r + 1 of the
 *                       code of K 32 c + 16 h + 12 + t in bits 6, 7 (regrouped from GGUF's ql / qh at
 *                       packing: three of each four code vectors are then one AND away, the fourth is
 *                       gathered from the three top bit pairs)
 * In every format, 32-block j's codes are 8 vectors of 16 lanes x 4 K, vector g holding K 32 j + 4 g ..:
 * the loop below is one for all; only how a vector is fetched and a block's (a, o) differ.
 *
 * Work split: tasks are (group of NZ panels, chunk of MC rows); each OpenMP thread takes one contiguous
 * run of them (at decode sizes: its part of the weight, streamed in order). A micro-tile of MR rows x NZ
 * panels keeps 2 MR NZ vectors (the block's integer sums and the fp32 results) in registers. A task's first
 * micro-tile reads its panels from memory, the others from L2, and those bring the next task's panels
 * into L2 as they go (ahead_slice). Calls of one or two rows can instead take one panel per task, one stream
 * per thread (single-stream mode; the VNNI path prefetches it further ahead, or not), chosen per CPU and
 * format at load (gemm_quant_set_single_stream_for), and the VNNI path micro-tiles of 8 rows with the fp32
 * results in L1 (wide tiles), chosen per CPU (gemm_quant_set_wide_tiles). A task of two full 4-row
 * micro-tiles or more (every format but Q8_0) turns its loops around (decoded_tiles): 8 32-blocks of its
 * panels at a time are decoded into a 12 KB buffer in L1, then every micro-tile takes them from it, where
 * each would otherwise decode them again. Decoding a task's whole panels at once ran slower (twice the bytes
 * from L2 a code vector: a Zen 4, 2048 x 8192 at 16 rows, Q4_0 0.85x, Q4_K 0.67x). Where the CPU has AMX-INT8,
 * a task of 32 or 48 rows or more (TQ2_0: 16; amx_min_rows) takes its full 16-row groups' integer sums from the
 * tile unit instead: a K-quant's a 256-block at a time (amx_k_decode), Q4_0's, Q5_0's and IQ4_NL's a 32-block at
 * a time (amx_q_decode), through one pipeline (amx_tiles_of).
 *
 * Numerics: the integer sums are exact; each block adds its scaled sum to an fp32 total in K order, so a
 * row's result does not depend on M, the tiling or the thread count. Q6_K's two half sums are multiplied by
 * their int8 scales and added as integers (|sum| <= 2 x 128 x 16 x 32 x 127 < 2^24: exact in fp32 too), so
 * its block is scaled once, by d dx, as the others are. The K-quants go further: a 256-block's sub-block
 * sums times their scales, and its mins times x's 32-block sums, are added up as integers (|sum| < 2^28),
 * then turned to fp32 once per 256-block: fewer conversions and FMAs a block, where one stream of a
 * K-quant is bound by them rather than by memory. Quantizing x costs what it costs
 * llama.cpp (about 0.4% of each block's largest value). Without AVX-512 VNNI the same arithmetic runs on the
 * same layout as AVX2 (each vpdpbusd as vpmaddubsw, whose int16 pair sums are added over up to 8 code
 * vectors before one vpmaddwd widens them: pairs_per_widen; a panel as two 8-lane halves), else (or with
 * -DQUANT_SCALAR) as plain C on 16-lane vectors.
 */
#define _DEFAULT_SOURCE /* syscall() under -std=c11: AMX's permission request (amx.h) */
#include "cobatch_kernels.h"
#include "parallel.h"

#include <math.h>
#include <omp.h>
#include <stdlib.h>

/* The path this build takes: AVX-512 VNNI; else AVX2 (-DQUANT_NO_VNNI picks it on a VNNI CPU, for tests);
 * else plain C on 16-lane vectors (-DQUANT_SCALAR anywhere). The VNNI path uses AMX-INT8 where the CPU has it
 * (-DQUANT_NO_AMX builds it without, for A/B runs of builds). */
#define QUANT_PLAIN 0
#define QUANT_AVX2 1
#define QUANT_AVX512_VNNI 2
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && !defined(QUANT_SCALAR) && \
    !defined(QUANT_NO_VNNI)
#define QUANT_PATH QUANT_AVX512_VNNI
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(QUANT_SCALAR)
#define QUANT_PATH QUANT_AVX2
#else
#define QUANT_PATH QUANT_PLAIN
#endif
#define QUANT_VNNI (QUANT_PATH == QUANT_AVX512_VNNI)
#if QUANT_PATH != QUANT_PLAIN
#include <immintrin.h>
#endif
#if QUANT_VNNI && defined(__AMX_TILE__) && defined(__AMX_INT8__) && !defined(QUANT_NO_AMX)
#include "amx.h"
#endif

#define QB 32   /* weights per activation block (and per Q8_0 / Q4_0 block, per Q4_K sub-block) */
#define NR 16   /* output rows per panel */
#ifndef MR
#define MR 4    /* input rows per micro-tile */
#endif
#define MR_WIDE 8 /* rows per VNNI micro-tile in wide-tile mode (gemm_quant_set_wide_tiles): results in L1 */
#ifndef NZ
#define NZ 3    /* panels per micro-tile: 4 x 3 keeps 28 of the 32 vector registers busy */
#endif
#ifndef MC
#define MC 128  /* input rows per task */
#endif
#define INLINE static inline __attribute__((always_inline))

/* Bytes of one panel block and weights per format block. */
static const int64_t PANEL_BYTES[QUANT_NUM_TYPES] = {NR * 34, NR * 18, NR * 144, NR * 22, NR * 210, NR * 176,
                                                     NR * 20, NR * 24, NR * 136, NR * 36, NR * 110, NR * 84,
                                                     NR * 140, NR * 152, NR * 72, NR * 70, NR * 118, NR * 66};
static const int64_t BLOCK_K[QUANT_NUM_TYPES] = {32, 32, 256, 32, 256, 256, 32, 32, 256, 64, 256, 256, 256, 256, 256,
                                                 256, 256, 256};
/* Every format, for the per-format tile copies (QTILE_FN) and their table by qtype: X(name, qtype). */
#define QUANT_FORMATS(X)                                                                                     \
    X(tile_q8_0, QUANT_Q8_0) X(tile_q4_0, QUANT_Q4_0) X(tile_q4_k, QUANT_Q4_K) X(tile_q5_0, QUANT_Q5_0)      \
    X(tile_q6_k, QUANT_Q6_K) X(tile_q5_k, QUANT_Q5_K) X(tile_q4_1, QUANT_Q4_1) X(tile_q5_1, QUANT_Q5_1)      \
    X(tile_iq4_xs, QUANT_IQ4_XS) X(tile_iq4_nl, QUANT_IQ4_NL) X(tile_q3_k, QUANT_Q3_K) X(tile_q2_k, QUANT_Q2_K)    \
    X(tile_iq4_tab, QUANT_IQ4_TAB) X(tile_iq4_tab16, QUANT_IQ4_TAB16) X(tile_iq2_grid, QUANT_IQ2_GRID)         \
    X(tile_iq1_trit, QUANT_IQ1_TRIT) X(tile_iq3_tab16, QUANT_IQ3_TAB16) X(tile_tq2_0, QUANT_TQ2_0)
#define QTILE_ENTRY(NAME, QT) [QT] = NAME,
/* Where the 4-bit codes of 32-block j (and of its pair's other half) start in a Q4_K / Q5_K panel block.
 * Q5_K's pair of 32-blocks keeps its first block's fifth bits (K5_HB) before the codes and its second's
 * after them, so that each line is first read in address order: with the fifth bits last, as GGUF has
 * them, a 256-block's first 32-block read the block's end before its middle, and one stream ran at about
 * half its bytes' rate (the prefetchers lost it); with both before the codes, one row ran 0.92-0.97x. */
#define K_PAIR(qtype) ((qtype) == QUANT_Q5_K ? 640 : 512)
#define K_CODES(qtype, j) (256 + K_PAIR(qtype) * ((j) % 8 / 2) + ((qtype) == QUANT_Q5_K ? 64 : 0))
/* Where Q5_K's fifth bits of 32-block j start: bit g of each byte for code vector g, so that the AVX-512
 * tile moves it to bit 4 with a shift by a constant and one bit select, as Q5_0's (against GGUF's bit j of
 * each byte, tested per code vector: 16 rows of Q5_K 1.08-1.11x, scripts/quant_builds_microbench.py) */
#define K5_HB(j) (256 + 640 * ((j) % 8 / 2) + 576 * ((j) % 2))
#define Q6_CODES 288 /* where a Q6_K panel block's codes start (after d and the scales) */
#define Q6_BLOCK 384 /* a Q6_K panel's bytes of codes per 32-block: two halves of 3 vectors */

/* Q3_K and Q2_K: 2-bit codes regrouped alike (Q3_K's third bit apart), 16 scales a 256-block unpacked at once. */
#define IS_LOW2(qtype) ((qtype) == QUANT_Q3_K || (qtype) == QUANT_Q2_K)
/* The formats whose codes are Q2_K's 2-bit vectors alone (IQ1_TRIT's with 8 scales a 256-block, TQ2_0's with none). */
#define IS_CODE2(qtype) ((qtype) == QUANT_Q2_K || (qtype) == QUANT_IQ1_TRIT || (qtype) == QUANT_TQ2_0)
/* The formats with Q2_K's 2-bit code vectors (Q3_K's the low bits of its codes). */
#define HAS_LOW2(qtype) (IS_LOW2(qtype) || IS_CODE2(qtype))
/* Q2_K, Q3_K and IQ1_TRIT: a sub-block's integer sum fits in 16 bits (|sum| <= 32 x 3 x 127; Q3_K's 16 x 4 x 127),
 * and their unpacked scales (kscale) have a zero top half, so a scale multiplies it in one vpmaddwd. */
#define SUMS_FIT_16(qtype) (IS_LOW2(qtype) || (qtype) == QUANT_IQ1_TRIT)
/* TQ2_0: a K-quant without sub-block scales (a scale of 1: its sums are not multiplied). */
#define UNIT_SCALE(qtype) ((qtype) == QUANT_TQ2_0)
/* Q3_K's 3-bit codes (the low 2 bits, then a vector of third bits): Q3_K's own and IQ3_TAB16's table indices. */
#define IS_CODE3(qtype) ((qtype) == QUANT_Q3_K || (qtype) == QUANT_IQ3_TAB16)
/* Where 32-block j's low 2 bits start in a panel block of those (HAS_LOW2, IS_CODE3). */
#define LOW2_AT(qtype, j)                                                                                     \
    ((qtype) == QUANT_Q3_K ? Q3_CODES + 192 * (j) : (qtype) == QUANT_IQ3_TAB16 ? T3_CODES + 192 * (j)         \
     : (qtype) == QUANT_Q2_K ? Q2_CODES + 128 * (j) : (qtype) == QUANT_TQ2_0 ? TQ2_CODES + 128 * (j)         \
     : T1_CODES + 128 * (j))
/* Integer sums per 32-block: 2 for Q6_K, Q3_K, Q2_K (one per 16-weight sub-block, each with its own scale),
 * else 1. */
/* Q6_K's int8 scale per 16 weights at 32 + 16 s + l (q6_scales) */
#define Q6_SCALES(qtype) ((qtype) == QUANT_Q6_K || (qtype) == QUANT_IQ4_TAB16 || (qtype) == QUANT_IQ3_TAB16)
static inline int sums_per_block(int qtype) { return Q6_SCALES(qtype) || IS_LOW2(qtype) ? 2 : 1; }

/* The formats with a min per sub-block (w = a c - b): Q4_K and Q5_K, which share their scales' layout. A
 * macro: a plain expression of the literal qtype folds before the tile's loops are unrolled (as an inline
 * function it did not, and Q4_K's tile ran 1.9x slower). */
#define HAS_MINS(qtype) ((qtype) == QUANT_Q4_K || (qtype) == QUANT_Q5_K)
/* Q4_1, Q5_1: a min per 32-block, added (w = d c + m): m dx sum(q) once per block, after d dx sum(c q). */
#define HAS_BLOCK_MIN(qtype) ((qtype) == QUANT_Q4_1 || (qtype) == QUANT_Q5_1)
/* The 32-weight formats of 4-bit codes in Q4_0's order (Q4_0, Q4_1, Q5_0, Q5_1), those with a fifth bit
 * (hb) too, and where a panel block's hb and qs start: after d (and m), qs after hb. */
#define IS_NIBBLE_32(qtype) ((qtype) == QUANT_Q4_0 || (qtype) == QUANT_Q4_1 || IS_FIFTH_32(qtype))
#define IS_FIFTH_32(qtype) ((qtype) == QUANT_Q5_0 || (qtype) == QUANT_Q5_1)
#define FIFTH_AT(qtype) (HAS_BLOCK_MIN(qtype) ? 64 : 32)
#define NIBBLES_AT(qtype) (FIFTH_AT(qtype) + (IS_FIFTH_32(qtype) ? 64 : 0))

#define IQ4_CODES 128  /* where an IQ4_XS panel block's codes start (after d and the scales) */
#define TAB_AT 2176    /* where an IQ4_TAB panel block's table line starts (after IQ4_XS's bytes) */
/* IQ4_XS's d and scales: IQ4_XS, IQ4_TAB (its 16 code values in its block rather than IQ4_XS's table) and
 * IQ2_GRID (IQ2_XXS's grid indices instead of 4-bit ones) */
#define IS_XS(qtype) ((qtype) == QUANT_IQ4_XS || (qtype) == QUANT_IQ4_TAB || (qtype) == QUANT_IQ2_GRID)
/* IQ4_TAB16: IQ4_TAB's codes and table with Q6_K's d and int8 scale per 16 weights (two sums a 32-block) */
#define TAB16_CODES 320  /* where an IQ4_TAB16 panel block's codes start (after d, the scales and a gap) */
#define TAB16_AT 2368    /* where its table line starts */
#define XS_CODES(qtype) ((IS_XS(qtype) && (qtype) != QUANT_IQ2_GRID) || (qtype) == QUANT_IQ4_TAB16)
#define CODES_AT(qtype) ((qtype) == QUANT_IQ4_TAB16 ? TAB16_CODES : IQ4_CODES)
/* What a block's fp16 d is multiplied by: IQ4_TAB's table is in eighths (w = d scale c / 8), so that the
 * grids' d stays the file's fp16 d (d / 8 is often no fp16) and their values stay integers. */
#define D_UNIT(qtype)                                                                                         \
    ((qtype) == QUANT_IQ4_TAB || (qtype) == QUANT_IQ4_TAB16 || (qtype) == QUANT_IQ2_GRID ||                   \
     (qtype) == QUANT_IQ3_TAB16 ? 0.125f : 1.0f)
#define Q3_CODES 224   /* where a Q3_K panel block's codes start (after d and the scales), 192 bytes a 32-block */
#define Q2_CODES 320   /* where a Q2_K panel block's codes start (after d, dmin, the scales), 128 bytes a 32-block */
#define T1_CODES 96    /* where an IQ1_TRIT panel block's codes start (after d and the scales), as Q2_K's */
#define TQ2_CODES 32   /* where a TQ2_0 panel block's codes start (after d), as Q2_K's */
#define T3_CODES 288   /* where an IQ3_TAB16 panel block's codes start (after d and the scales), as Q3_K's */
#define T3_TAB 1824    /* where its table line starts */
/* IQ1_TRIT's min of a scale nibble n (ls | 8 where IQ1_S's delta is -1/8): s (8 - delta 8), s = 2 ls + 1, in units
 * of d / 8 (w = d s c - d / 8 min, c = g + 1: d s (g + delta) exactly) */
static const uint8_t T1_MIN[16] = {7, 21, 35, 49, 63, 77, 91, 105, 9, 27, 45, 63, 81, 99, 117, 135};
/* IQ2_GRID: IQ2_XXS's weights kept as the file has them, a grid index per 8 weights (w = d s / 8 x sign x g, g in
 * {8, 25, 43}: llama.cpp's iq2xxs_grid), their signs a bit each (IQ2_XXS's 7 and the parity bit it leaves out),
 * 2.25 bits a weight against IQ4_TAB's 4.375. Per 32-block c (0..7), at IQ2_CODES + 128 c:
 *     idx[16][4]: byte 4 l + i: row l's grid index of K 32 c + 8 i .. + 7
 *     neg[8][8]: 8 bytes per code vector g, a 64-bit mask: bit 4 l + t set where K 32 c + 4 g + t of row l
 *                is negative (the vector's byte 4 l + t)
 * Code vector g = 2 i + h takes half h (weights 4 h .. 4 h + 3) of each row's grid entry i: IQ2_GRID_CODE
 * holds each entry's 8 values as 2-bit level numbers (weight k in bits 2 k, 2 k + 1), the code is 128 + the
 * level's value with the weight's sign (o = 128, as IQ4_TAB's). */
#define IQ2_CODES 128  /* where an IQ2_GRID panel block's 32-blocks start (after IQ4_XS's d and scales) */
static const uint8_t IQ2_LEVEL[4] = {8, 25, 43, 0};
/* llama.cpp's iq2xxs_grid (also gguf-py's IQ2_XXS.grid, which the tests hold it to), entry e's weight k as bits
 * 2 k, 2 k + 1: its level in IQ2_LEVEL; [0]: weights 0..3 of each entry, [1]: 4..7 (a 256-byte table each, as the
 * VBMI lookup wants them). */
static const uint8_t IQ2_GRID_CODE[2][256] __attribute__((aligned(64))) = {
{
    0x00, 0x02, 0x05, 0x08, 0x0a, 0x11, 0x14, 0x20, 0x22, 0x28, 0x2a, 0x41, 0x44, 0x50, 0x58, 0x61,
    0x64, 0x80, 0x82, 0x8a, 0xa2, 0x01, 0x04, 0x10, 0x15, 0x40, 0x84, 0x98, 0x00, 0x02, 0x22, 0x82,
    0x01, 0x04, 0x10, 0x21, 0x24, 0x40, 0x42, 0x48, 0x60, 0x81, 0x84, 0x90, 0xa4, 0x00, 0x02, 0x08,
    0x20, 0x46, 0x69, 0x80, 0x91, 0x09, 0x10, 0x40, 0x84, 0xa4, 0x00, 0x05, 0x08, 0x14, 0x28, 0x41,
    0x44, 0x50, 0x52, 0x88, 0x04, 0x40, 0x02, 0x14, 0x01, 0x04, 0x10, 0x21, 0x40, 0x60, 0x84, 0x90,
    0x95, 0x00, 0x08, 0x20, 0x50, 0x5a, 0x80, 0x24, 0x45, 0x00, 0x08, 0x20, 0x25, 0x49, 0x80, 0x18,
    0x62, 0x00, 0x16, 0x01, 0x04, 0x10, 0x40, 0x81, 0x00, 0x05, 0xa0, 0x51, 0x00, 0x02, 0x0a, 0x44,
    0x61, 0x80, 0x82, 0x29, 0x48, 0x00, 0x02, 0x01, 0x04, 0x10, 0x40, 0x56, 0x00, 0x41, 0x64, 0x90,
    0x08, 0x20, 0x94, 0x44, 0x01, 0x04, 0x10, 0x18, 0x21, 0x24, 0x40, 0x48, 0x56, 0x60, 0x81, 0x84,
    0x90, 0x00, 0x20, 0x61, 0x80, 0x85, 0x01, 0x10, 0x48, 0x56, 0x68, 0x00, 0x08, 0x20, 0x80, 0x99,
    0x12, 0x24, 0x00, 0x01, 0x04, 0x10, 0x40, 0x45, 0x00, 0x58, 0x61, 0x82, 0x45, 0x90, 0x00, 0x08,
    0x11, 0x19, 0x20, 0x80, 0x88, 0x04, 0x42, 0xa4, 0x91, 0x90, 0x92, 0x0a, 0x01, 0x54, 0x00, 0x11,
    0x19, 0x64, 0x40, 0x08, 0x04, 0x10, 0x40, 0x68, 0x00, 0x55, 0x18, 0x60, 0x00, 0x05, 0x10, 0x12,
    0x84, 0x42, 0x00, 0x02, 0x0a, 0x41, 0x82, 0x04, 0x18, 0x40, 0x11, 0x01, 0x04, 0x10, 0x15, 0x40,
    0x60, 0x00, 0x46, 0x94, 0x09, 0x40, 0x60, 0x02, 0x04, 0x11, 0x04, 0x10, 0x24, 0x40, 0xa1, 0x16,
    0x80, 0x45, 0x00, 0x22, 0x44, 0x51, 0x81, 0x20, 0x02, 0x50, 0x85, 0x09, 0x00, 0x18, 0x50, 0x04,
},
{
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
    0x00, 0x00, 0x00, 0x00, 0x00, 0x01, 0x01, 0x01, 0x01, 0x01, 0x01, 0x01, 0x02, 0x02, 0x02, 0x02,
    0x04, 0x04, 0x04, 0x04, 0x04, 0x04, 0x04, 0x04, 0x04, 0x04, 0x04, 0x04, 0x04, 0x05, 0x05, 0x05,
    0x05, 0x05, 0x05, 0x05, 0x05, 0x06, 0x06, 0x06, 0x06, 0x06, 0x08, 0x08, 0x08, 0x08, 0x08, 0x08,
    0x08, 0x08, 0x08, 0x08, 0x09, 0x09, 0x0a, 0x0a, 0x10, 0x10, 0x10, 0x10, 0x10, 0x10, 0x10, 0x10,
    0x10, 0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x12, 0x12, 0x14, 0x14, 0x14, 0x14, 0x14, 0x14, 0x15,
    0x15, 0x16, 0x16, 0x18, 0x18, 0x18, 0x18, 0x18, 0x19, 0x19, 0x19, 0x1a, 0x20, 0x20, 0x20, 0x20,
    0x20, 0x20, 0x20, 0x21, 0x21, 0x22, 0x22, 0x24, 0x24, 0x24, 0x24, 0x24, 0x25, 0x25, 0x25, 0x26,
    0x28, 0x28, 0x28, 0x2a, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40,
    0x40, 0x41, 0x41, 0x41, 0x41, 0x41, 0x42, 0x42, 0x42, 0x42, 0x42, 0x44, 0x44, 0x44, 0x44, 0x44,
    0x45, 0x45, 0x46, 0x48, 0x48, 0x48, 0x48, 0x48, 0x49, 0x49, 0x49, 0x49, 0x4a, 0x4a, 0x50, 0x50,
    0x50, 0x50, 0x50, 0x50, 0x50, 0x51, 0x51, 0x51, 0x52, 0x54, 0x54, 0x55, 0x56, 0x56, 0x58, 0x58,
    0x58, 0x58, 0x59, 0x5a, 0x60, 0x60, 0x60, 0x60, 0x61, 0x61, 0x62, 0x62, 0x64, 0x64, 0x65, 0x65,
    0x65, 0x68, 0x80, 0x80, 0x80, 0x80, 0x80, 0x81, 0x81, 0x81, 0x82, 0x84, 0x84, 0x84, 0x84, 0x84,
    0x84, 0x85, 0x85, 0x85, 0x86, 0x86, 0x86, 0x88, 0x89, 0x8a, 0x90, 0x90, 0x90, 0x90, 0x90, 0x91,
    0x91, 0x92, 0x94, 0x94, 0x94, 0x95, 0x98, 0x99, 0xa0, 0xa0, 0xa0, 0xa1, 0xa2, 0xa4, 0xa8, 0xa9,
},
};

/* IQ4_XS: llama.cpp's table of the 16 weight values (kvalues_iq4nl), + 128: the kernel's unsigned codes. */
static const uint8_t IQ4_CODE[16] = {1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241};

/* The 16 codes (value + 128) that IQ4_XS's, IQ4_NL's, IQ4_TAB's or IQ4_TAB16's 4-bit indices stand for; blk:
 * the panel block (the 256-block), whose table line holds its table once per 16 bytes. */
static inline const uint8_t *code_table(int qtype, const uint8_t *blk) {
    return qtype == QUANT_IQ4_TAB ? blk + TAB_AT : qtype == QUANT_IQ4_TAB16 ? blk + TAB16_AT
           : qtype == QUANT_IQ3_TAB16 ? blk + T3_TAB : IQ4_CODE;
}

/* Q6_K: the 16 lanes' int8 scales of half hf of 32-block j, in the panel block at blk. */
static inline const uint8_t *q6_scales(const uint8_t *blk, int64_t j, int hf) {
    return blk + 32 + 16 * (2 * (j % 8) + hf);
}

/* The K-quants (256-weight blocks whose sub-blocks carry integer scales): x is quantized per 256 for them,
 * so a whole block's integer sums add up as integers before one fp32 step (llama.cpp's Q8_K). */
#define IS_K_QUANT(qtype) (HAS_MINS(qtype) || Q6_SCALES(qtype) || IS_XS(qtype) || HAS_LOW2(qtype))
/* The K-quants whose sub-block scales are unpacked once per 256-block (kscale), rather than read per 32. */
#define HAS_KSCALE(qtype) (HAS_MINS(qtype) || IS_XS(qtype) || (HAS_LOW2(qtype) && !UNIT_SCALE(qtype)))
/* The K-quants with a min per sub-block, subtracted once per 256-block as dmin dx sum_i min_i sum(q of i). */
#define HAS_KMIN(qtype) (HAS_MINS(qtype) || (qtype) == QUANT_Q2_K || (qtype) == QUANT_IQ1_TRIT)
/* Codes that are a signed int8 + 128 (Q8_0, IQ4_NL, IQ4_XS's, IQ2_GRID's): the AVX2 path multiplies |w| by x with
 * w's sign. */
#define SIGNED_CODES(qtype)                                                                                   \
    ((qtype) == QUANT_Q8_0 || (qtype) == QUANT_IQ4_NL || XS_CODES(qtype) || (qtype) == QUANT_IQ2_GRID ||      \
     (qtype) == QUANT_IQ3_TAB16)
#define KB 256  /* weights per K-quant block, and per x scale for them */

/* x quantized: codes [M, K] int8, a scale per `span` values (32, or KB for the K-quants) [M, K / span],
 * the sum of each 32-block's codes [M, K / 32] and of each 16-block's [M, K / 16] (Q6_K's sub-blocks);
 * int16 (|sum| <= 32 x 127), so two neighbours are one vpdpwssd operand. */
typedef struct {
    int8_t *q;
    float *d;
    int16_t *s;
    int16_t *s16;
    int64_t K, span;
    int8_t *qt;  /* AMX's 32-weight formats (amx_q_products), or NULL: q again, 16-row group by 32-block */
} QuantRows;

/* Where row m's 32-block j starts in x->qt: each 16-row group's 32-block is one tile of 512 contiguous bytes. */
#define AMX_TILE_AT(x, m, j) (((m) / 16 * ((x)->K / QB) + (j)) * 512 + (m) % 16 * QB)

/* Where the scale of row `row`'s 32-block j is in x->d: a macro, so that the kernels' span is a literal
 * (a shift, not a 64-bit division in the epilogue of every block). */
#define X_SPAN(qtype) (IS_K_QUANT(qtype) ? KB : QB)
#define X_SCALE_AT(qtype, x, row, j) ((row) * ((x)->K / X_SPAN(qtype)) + (j) * QB / X_SPAN(qtype))

static float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) bits = sign | 0x7f800000u | (man << 13);
    else if (exp != 0) bits = sign | ((exp + 112) << 23) | (man << 13);
    else {
        float f = (float)man * (1.0f / 16777216.0f); /* subnormal: man * 2^-24 */
        return sign ? -f : f;
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t load_u16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }

/* ------------------------------------------------------------------------ activation quantization */

/* Codes and sums of the 32 values of x at `at` (x's dtype) with the inverse scale id. */
#if QUANT_VNNI
INLINE __m512 load_x16(const void *x, int is_bf16, int64_t at) {
    return is_bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(
                         _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)x + at))), 16))
                   : _mm512_loadu_ps((const float *)x + at);
}

static float span_amax(const void *x, int is_bf16, int64_t at, int64_t span) {
    const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    __m512 amax = _mm512_setzero_ps();
    for (int64_t k = 0; k < span; k += 16)
        amax = _mm512_max_ps(amax, _mm512_and_ps(load_x16(x, is_bf16, at + k), sign));
    return _mm512_reduce_max_ps(amax);
}

/* (16-lane vectors; vcvtps2dq rounds to nearest even, as nearbyintf does by default) */
static void quantize_block(const void *x, int is_bf16, int64_t at, float id, QuantRows *r) {
    for (int h = 0; h < 2; h++) {
        __m512i c = _mm512_cvtps_epi32(_mm512_mul_ps(load_x16(x, is_bf16, at + 16 * h), _mm512_set1_ps(id)));
        c = _mm512_max_epi32(_mm512_min_epi32(c, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
        _mm_storeu_si128((__m128i *)(r->q + at + 16 * h), _mm512_cvtepi32_epi8(c));
        r->s16[at / 16 + h] = (int16_t)_mm512_reduce_add_epi32(c);
    }
    r->s[at / QB] = (int16_t)(r->s16[at / 16] + r->s16[at / 16 + 1]);
}
#elif QUANT_PATH == QUANT_AVX2
/* The same codes 8 lanes at a time: scalar, this took ~8% of a Q4_0 prefill step on Zen 3 (perf). */
INLINE __m256 load_x8(const void *x, int is_bf16, int64_t at) {
    return is_bf16 ? _mm256_castsi256_ps(_mm256_slli_epi32(
                         _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)x + at))), 16))
                   : _mm256_loadu_ps((const float *)x + at);
}

static float span_amax(const void *x, int is_bf16, int64_t at, int64_t span) {
    const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 amax = _mm256_setzero_ps();
    for (int64_t k = 0; k < span; k += 8)  /* |x| first: vmaxps returns its second operand for a NaN */
        amax = _mm256_max_ps(_mm256_and_ps(load_x8(x, is_bf16, at + k), sign), amax);
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

INLINE int32_t sum_lanes_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1))));
}

/* (vcvtps2dq rounds to nearest even, as nearbyintf does by default; the packs keep 128-bit lanes apart, the
 * permute puts the 32 codes back in order) */
static void quantize_block(const void *x, int is_bf16, int64_t at, float id, QuantRows *r) {
    __m256i c[4];
    for (int i = 0; i < 4; i++) {
        c[i] = _mm256_cvtps_epi32(_mm256_mul_ps(load_x8(x, is_bf16, at + 8 * i), _mm256_set1_ps(id)));
        c[i] = _mm256_max_epi32(_mm256_min_epi32(c[i], _mm256_set1_epi32(127)), _mm256_set1_epi32(-127));
    }
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
    _mm256_storeu_si256((__m256i *)(r->q + at),
                        _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    for (int h = 0; h < 2; h++)
        r->s16[at / 16 + h] = (int16_t)sum_lanes_epi32(_mm256_add_epi32(c[2 * h], c[2 * h + 1]));
    r->s[at / QB] = (int16_t)(r->s16[at / 16] + r->s16[at / 16 + 1]);
}
#else
static float span_amax(const void *x, int is_bf16, int64_t at, int64_t span) {
    float amax = 0.0f;
    for (int64_t k = at; k < at + span; k++) {
        const float v = is_bf16 ? bf16_to_f32(((const uint16_t *)x)[k]) : ((const float *)x)[k];
        amax = fabsf(v) > amax ? fabsf(v) : amax;
    }
    return amax;
}

static void quantize_block(const void *x, int is_bf16, int64_t at, float id, QuantRows *r) {
    int32_t half[2] = {0, 0};
    for (int t = 0; t < QB; t++) {
        const float v = is_bf16 ? bf16_to_f32(((const uint16_t *)x)[at + t]) : ((const float *)x)[at + t];
        float c = nearbyintf(v * id);
        c = c > 127.0f ? 127.0f : c < -127.0f ? -127.0f : c;
        r->q[at + t] = (int8_t)c;
        half[t / 16] += (int32_t)c;
    }
    r->s16[at / 16] = (int16_t)half[0], r->s16[at / 16 + 1] = (int16_t)half[1];
    r->s[at / QB] = (int16_t)(half[0] + half[1]);
}
#endif

/* Row `row` of x into r: per span, its scale dx = max|x| / 127, then its 32-blocks' codes q = round-half-
 * even(x / dx) and sums. */
static void quantize_row(const void *x, int is_bf16, int64_t row, QuantRows *r) {
    for (int64_t at = row * r->K; at < (row + 1) * r->K; at += r->span) {
        const float d = span_amax(x, is_bf16, at, r->span) / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        for (int64_t k = 0; k < r->span; k += QB) quantize_block(x, is_bf16, at + k, id, r);
        r->d[at / r->span] = d;
    }
}

/* Row m of x's codes again in qt (AMX_TILE_AT) where the call has it (amx_q_products): full 16-row groups' rows. */
static void tile_row(QuantRows *r, int64_t m, int64_t M) {
    if (r->qt == NULL || m >= M / 16 * 16) return;
    for (int64_t j = 0; j < r->K / QB; j++) memcpy(r->qt + AMX_TILE_AT(r, m, j), r->q + m * r->K + j * QB, QB);
}

/* ----------------------------------------------------------------------------- per-block scales */

/* Q4_K: sub-block j's 6-bit scale and min from a row's 12 scale bytes (GGUF's get_scale_min_k4). */
static inline void k4_scale_min(const uint8_t *q, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = q[j] & 63, *mn = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4);
        *mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* o: the code of a zero weight in the formats without mins (w = a (c - o)); 0 in those with a min per block. */
static inline float code_offset(int qtype) {
    switch (qtype) {
    case QUANT_Q8_0: case QUANT_IQ4_NL: case QUANT_IQ4_XS: case QUANT_IQ4_TAB: case QUANT_IQ4_TAB16:
    case QUANT_IQ2_GRID: case QUANT_IQ3_TAB16: return 128.0f;
    case QUANT_Q6_K: return 32.0f;
    case QUANT_Q3_K: return 4.0f;
    case QUANT_TQ2_0: return 1.0f;
    case QUANT_Q5_0: return 16.0f;
    case QUANT_Q4_1: case QUANT_Q5_1: case QUANT_Q2_K: case QUANT_IQ1_TRIT: return 0.0f;
    default: return 8.0f;
    }
}

/* IQ4_XS: sub-block i's (0..7) scale of row lane, -32..31. */
static inline int iq4_scale(const uint8_t *blk, int lane, int i) {
    const int low = (blk[64 + 4 * lane + i / 2] >> (4 * (i % 2))) & 0xf;
    return (low | (((load_u16(blk + 32 + 2 * lane) >> (2 * i)) & 3) << 4)) - 32;
}

/* Q3_K: sub-block s's (0..15) scale of row lane, -32..31: GGUF's 12 bytes as 3 words a0 a1 a2, the low 4 bits
 * from byte s % 4 of a0 (s < 4, >> 4 for 8..11) or a1 (4..7, >> 4 for 12..15), the top 2 from a2. */
static inline int q3_scale(const uint8_t *blk, int lane, int s) {
    uint32_t a[3];
    for (int i = 0; i < 3; i++) memcpy(&a[i], blk + 32 + 64 * i + 4 * lane, 4);
    const int word = s / 4, byte = s % 4;
    const int low = (int)((a[word % 2] >> (4 * (word / 2) + 8 * byte)) & 0xf);
    return (low | (int)(((a[2] >> (2 * word + 8 * byte)) & 3) << 4)) - 32;
}

/* Q2_K: sub-block s's (0..15) scale and min of row lane, 0..15 each: the nibbles of its scale byte. */
static inline void q2_scale_min(const uint8_t *blk, int lane, int s, int *sc, int *mn) {
    const uint8_t byte = blk[64 + 64 * (s / 4) + 4 * lane + s % 4];
    *sc = byte & 0xf, *mn = byte >> 4;
}

/* IQ1_TRIT: sub-block i's (0..7) scale nibble of row lane, ls | 8 where its delta is negative. */
static inline int t1_nibble(const uint8_t *blk, int lane, int i) {
    return (blk[32 + 4 * lane + i % 4] >> (4 * (i / 4))) & 0xf;
}

/* The weight w = a c - b at K index k (0..31) of 32-block j (of the panel block at blk) for row lane. */
static void block_ab(int qtype, const uint8_t *blk, int lane, int j, int k, float *a, float *b) {
    if (qtype == QUANT_IQ1_TRIT) {
        const int n = t1_nibble(blk, lane, j % 8);
        const float d = f16_to_f32(load_u16(blk + 2 * lane));
        *a = d * (float)(2 * (n & 7) + 1);
        *b = d * 0.125f * (float)T1_MIN[n];
        return;
    }
    if (Q6_SCALES(qtype)) {
        const int8_t sc = (int8_t)q6_scales(blk, j, k / 16)[lane];
        *a = f16_to_f32(load_u16(blk + 2 * lane)) * D_UNIT(qtype) * (float)sc;
        *b = *a * code_offset(qtype);
        return;
    }
    if (qtype == QUANT_Q3_K) {
        *a = f16_to_f32(load_u16(blk + 2 * lane)) * (float)q3_scale(blk, lane, 2 * (j % 8) + k / 16);
        *b = *a * 4.0f;
        return;
    }
    if (qtype == QUANT_Q2_K) {
        int sc, mn;
        q2_scale_min(blk, lane, 2 * (j % 8) + k / 16, &sc, &mn);
        *a = f16_to_f32(load_u16(blk + 2 * lane)) * (float)sc;
        *b = f16_to_f32(load_u16(blk + 32 + 2 * lane)) * (float)mn;
        return;
    }
    (void)k;
    if (IS_XS(qtype)) {
        *a = f16_to_f32(load_u16(blk + 2 * lane)) * D_UNIT(qtype) * (float)iq4_scale(blk, lane, j % 8);
        *b = *a * 128.0f;
        return;
    }
    if (HAS_MINS(qtype)) {
        uint8_t q[12];
        for (int i = 0; i < 3; i++) memcpy(q + 4 * i, blk + 64 + 64 * i + 4 * lane, 4);
        int sc, mn;
        k4_scale_min(q, j % 8, &sc, &mn);
        *a = f16_to_f32(load_u16(blk + 2 * lane)) * (float)sc;
        *b = f16_to_f32(load_u16(blk + 32 + 2 * lane)) * (float)mn;
        return;
    }
    *a = f16_to_f32(load_u16(blk + 2 * lane));
    *b = HAS_BLOCK_MIN(qtype) ? -f16_to_f32(load_u16(blk + 32 + 2 * lane)) : *a * code_offset(qtype);
}

/* Code (0..255) of K index k (0..31) of 32-block j, row lane, in the panel block at blk. */
static inline int code_at(int qtype, const uint8_t *blk, int lane, int j, int k) {
    const int g = k / 4, t = k % 4;
    if (qtype == QUANT_Q8_0) return blk[32 + 64 * g + 4 * lane + t];
    if (qtype == QUANT_IQ2_GRID) {
        const uint8_t *v = blk + IQ2_CODES + 128 * (j % 8);
        const int level = IQ2_LEVEL[(IQ2_GRID_CODE[g % 2][v[4 * lane + g / 2]] >> (2 * t)) & 3];
        return (v[64 + 8 * g + lane / 2] >> (4 * (lane % 2) + t)) & 1 ? 128 - level : 128 + level;
    }
    if (qtype == QUANT_Q6_K) {
        const uint8_t *v = blk + Q6_CODES + Q6_BLOCK * (j % 8) + 192 * (g / 4) + 4 * lane + t;
        if (g % 4 < 3) return v[64 * (g % 4)] & 63;
        return (v[0] >> 6) | ((v[64] >> 6) << 2) | ((v[128] >> 6) << 4);
    }
    if (XS_CODES(qtype) || qtype == QUANT_IQ4_NL) {
        const uint8_t *v = blk + (XS_CODES(qtype) ? CODES_AT(qtype) + 256 * (j % 8) : 32) + 64 * (g % 4) + 4 * lane + t;
        return code_table(qtype, blk)[(*v >> (g < 4 ? 0 : 4)) & 0xf];
    }
    if (IS_CODE3(qtype)) {
        const uint8_t *v = blk + LOW2_AT(qtype, j % 8);
        const int low = (v[64 * (g / 4) + 4 * lane + t] >> (2 * (g % 4))) & 3;
        const int c = low | (((v[128 + 4 * lane + t] >> g) & 1) << 2);
        return qtype == QUANT_Q3_K ? c : code_table(qtype, blk)[c];
    }
    if (IS_CODE2(qtype))
        return (blk[LOW2_AT(qtype, j % 8) + 64 * (g / 4) + 4 * lane + t] >> (2 * (g % 4))) & 3;
    if (IS_NIBBLE_32(qtype)) {
        const int low = (blk[NIBBLES_AT(qtype) + 64 * (g % 4) + 4 * lane + t] >> (g < 4 ? 0 : 4)) & 0xf;
        return IS_FIFTH_32(qtype) ? low | (((blk[FIFTH_AT(qtype) + 4 * lane + t] >> g) & 1) << 4) : low;
    }
    const int low = (blk[K_CODES(qtype, j) + 64 * g + 4 * lane + t] >> (j % 2 ? 4 : 0)) & 0xf;
    if (qtype == QUANT_Q4_K) return low;
    return low | (((blk[K5_HB(j) + 4 * lane + t] >> g) & 1) << 4);  /* Q5_K */
}

/* IQ2_GRID's code vector g of 32-block j one code at a time (code_at), into out[64]: the paths without VBMI's
 * byte lookups, which exist for its correctness there (the loader holds IQ2_XXS as IQ4_TAB on them). */
static inline void iq2_code_bytes(const uint8_t *blk, int j, int g, uint8_t out[64]) {
    for (int lane = 0; lane < NR; lane++)
        for (int t = 0; t < 4; t++) out[4 * lane + t] = (uint8_t)code_at(QUANT_IQ2_GRID, blk, lane, j, 4 * g + t);
}

/* Where 32-block j of a panel is read from: the start of its packed block (the K-quants' 256-block), or for
 * IQ4_NL its own half of the pair (each half laid out as a 32-block format's panel block). */
static inline const uint8_t *panel_block(int qtype, const uint8_t *w, int64_t K, int64_t panel, int64_t j) {
    const int64_t blocks = K / BLOCK_K[qtype];
    if (qtype == QUANT_IQ4_NL) return w + panel * blocks * PANEL_BYTES[qtype] + j * (PANEL_BYTES[qtype] / 2);
    return w + (panel * blocks + j * QB / BLOCK_K[qtype]) * PANEL_BYTES[qtype];
}

/* ------------------------------------------------------------------------------ the plain C path */

#if QUANT_PATH == QUANT_PLAIN
/* A panel's 16 rows as one vector (GCC / Clang vector extensions): the compiler maps it to the CPU's own
 * registers (four SSE or NEON ones), so a CPU with neither AVX-512 VNNI nor AVX2 still takes 16 rows per
 * operation: 1.4-4.5x a loop over single weights (scripts/quant_builds_microbench.py, a Zen 3 built with
 * -DQUANT_SCALAR, 1 thread: Q4_0 one row 5.3 -> 3.6 ms, 16 rows 93 -> 39 ms), 13-48x slower than AVX2's. */
#pragma GCC diagnostic ignored "-Wpsabi"  /* 64-byte vectors in registers narrower: all inlined, no call ABI */
typedef uint32_t LaneWords __attribute__((vector_size(64)));
typedef int32_t LaneInts __attribute__((vector_size(64)));
typedef float LaneFloats __attribute__((vector_size(64)));

INLINE LaneWords load_lanes(const uint8_t *p) { LaneWords v; memcpy(&v, p, sizeof v); return v; }

/* Codes vector g of 32-block j as 16 lanes of 4 codes, one per byte (the VNNI path's operand). */
INLINE LaneWords code_words(int qtype, const uint8_t *blk, int j, int g) {
    if (qtype == QUANT_Q8_0) return load_lanes(blk + 32 + 64 * g);
    if (qtype == QUANT_IQ2_GRID) {
        uint8_t bytes[64];
        iq2_code_bytes(blk, j, g, bytes);
        return load_lanes(bytes);
    }
    if (IS_CODE3(qtype)) {
        const uint8_t *v = blk + LOW2_AT(qtype, j % 8);
        const LaneWords c = ((load_lanes(v + 64 * (g / 4)) >> (2 * (g % 4))) & 0x03030303u) |
                            (((load_lanes(v + 128) >> g) & 0x01010101u) << 2);
        if (qtype == QUANT_Q3_K) return c;
        const uint8_t *table = code_table(qtype, blk);
        LaneWords out = (LaneWords){0};
        for (int lane = 0; lane < NR; lane++)
            for (int t = 0; t < 4; t++) out[lane] |= (uint32_t)table[(c[lane] >> (8 * t)) & 0x7] << (8 * t);
        return out;
    }
    if (IS_CODE2(qtype))
        return (load_lanes(blk + LOW2_AT(qtype, j % 8) + 64 * (g / 4)) >> (2 * (g % 4))) & 0x03030303u;
    if (XS_CODES(qtype) || qtype == QUANT_IQ4_NL) {  /* each index through the table */
        const int at = XS_CODES(qtype) ? CODES_AT(qtype) + 256 * (j % 8) : 32;
        const LaneWords v = (load_lanes(blk + at + 64 * (g % 4)) >> (g < 4 ? 0 : 4)) & 0x0f0f0f0fu;
        const uint8_t *table = code_table(qtype, blk);
        LaneWords c = (LaneWords){0};
        for (int lane = 0; lane < NR; lane++)
            for (int t = 0; t < 4; t++) c[lane] |= (uint32_t)table[(v[lane] >> (8 * t)) & 0xf] << (8 * t);
        return c;
    }
    if (qtype == QUANT_Q6_K) {
        const uint8_t *v = blk + Q6_CODES + Q6_BLOCK * (j % 8) + 192 * (g / 4);
        if (g % 4 < 3) return load_lanes(v + 64 * (g % 4)) & 0x3f3f3f3fu;
        return ((load_lanes(v) >> 6) & 0x03030303u) | ((load_lanes(v + 64) >> 4) & 0x0c0c0c0cu) |
               ((load_lanes(v + 128) >> 2) & 0x30303030u);
    }
    if (HAS_MINS(qtype)) {
        const LaneWords v = load_lanes(blk + K_CODES(qtype, j) + 64 * g);
        const LaneWords lo = (v >> (j % 2 ? 4 : 0)) & 0x0f0f0f0fu;
        if (qtype == QUANT_Q4_K) return lo;
        return lo | (((load_lanes(blk + K5_HB(j)) >> g) & 0x01010101u) << 4);  /* Q5_K */
    }
    const LaneWords v = load_lanes(blk + NIBBLES_AT(qtype) + 64 * (g % 4));
    const LaneWords lo = (v >> (g < 4 ? 0 : 4)) & 0x0f0f0f0fu;
    if (!IS_FIFTH_32(qtype)) return lo;
    return lo | (((load_lanes(blk + FIFTH_AT(qtype)) >> g) & 0x01010101u) << 4);  /* Q5_0, Q5_1: the fifth bit */
}

/* The 32 codes of 32-block j of the panel block at blk: ct[k] holds K 32 j + k of the 16 rows. */
INLINE void block_codes(int qtype, const uint8_t *blk, int j, LaneInts ct[QB]) {
    for (int g = 0; g < 8; g++) {
        const LaneWords v = code_words(qtype, blk, j, g);
        for (int t = 0; t < 4; t++) ct[4 * g + t] = (LaneInts)((v >> (8 * t)) & 0xffu);
    }
}

/* The K-quants' integer scales of 32-block j, per lane: Q4_K / Q5_K / IQ1_TRIT its scale and min, Q6_K and Q3_K
 * each half's scale (sc[0], sc[1]), Q2_K each half's scale and min, IQ4_XS its scale, TQ2_0 1. */
INLINE void k_scales(int qtype, const uint8_t *blk, int j, LaneInts sc[2], LaneInts mn[2]) {
    for (int lane = 0; lane < NR; lane++) {
        if (UNIT_SCALE(qtype)) {
            sc[0][lane] = 1;
            continue;
        }
        if (qtype == QUANT_IQ1_TRIT) {
            const int n = t1_nibble(blk, lane, j % 8);
            sc[0][lane] = 2 * (n & 7) + 1, mn[0][lane] = T1_MIN[n];
            continue;
        }
        if (qtype == QUANT_Q2_K) {
            for (int hf = 0; hf < 2; hf++) {
                int s, m;
                q2_scale_min(blk, lane, 2 * (j % 8) + hf, &s, &m);
                sc[hf][lane] = s, mn[hf][lane] = m;
            }
            continue;
        }
        if (Q6_SCALES(qtype)) {
            for (int hf = 0; hf < 2; hf++) sc[hf][lane] = (int8_t)q6_scales(blk, j, hf)[lane];
            continue;
        }
        if (IS_XS(qtype)) {
            sc[0][lane] = iq4_scale(blk, lane, j % 8);
            continue;
        }
        if (qtype == QUANT_Q3_K) {
            for (int hf = 0; hf < 2; hf++) sc[hf][lane] = q3_scale(blk, lane, 2 * (j % 8) + hf);
            continue;
        }
        uint8_t q[12];
        for (int i = 0; i < 3; i++) memcpy(q + 4 * i, blk + 64 + 64 * i + 4 * lane, 4);
        int s, m;
        k4_scale_min(q, j % 8, &s, &m);
        sc[0][lane] = s, mn[0][lane] = m;
    }
}

INLINE LaneFloats fp16_lanes(const uint8_t *p) {
    LaneFloats v;
    for (int lane = 0; lane < NR; lane++) v[lane] = f16_to_f32(load_u16(p + 2 * lane));
    return v;
}

/* y rows m0 .. m0 + rows, columns of panels p0 .. p0 + nz, fp32 into out (ldo floats apart): each 32-block
 * of a panel decoded once for all rows, each row's result added up block by block in K order (the
 * K-quants: a 256-block's integer sums first, ksum and kmin). */
static void tile_rows(int qtype, const QuantRows *x, int64_t m0, int64_t rows, const uint8_t *w, int64_t K,
                      int64_t p0, int nz, float *out, int64_t ldo, const uint8_t *next, int64_t next_bytes,
                      int prefetch) {
    (void)next, (void)next_bytes, (void)prefetch;  /* no prefetching here */
    const int64_t nb = K / QB;
    const int32_t off = (int32_t)code_offset(qtype);
    const int halves = sums_per_block(qtype), span = QB / halves;
    static _Thread_local LaneInts ksum[MC], kmin[MC];  /* the K-quants' sums over their 256-block so far */
    for (int z = 0; z < nz; z++) {
        for (int64_t m = 0; m < rows; m++) memset(out + m * ldo + z * NR, 0, NR * sizeof(float));
        for (int64_t j = 0; j < nb; j++) {
            const uint8_t *blk = panel_block(qtype, w, K, p0 + z, j);
            LaneInts ct[QB], sc[2] = {{0}}, mn[2] = {{0}};
            block_codes(qtype, blk, (int)j, ct);
            if (IS_K_QUANT(qtype)) k_scales(qtype, blk, (int)j, sc, mn);
            for (int64_t m = 0; m < rows; m++) {
                const int8_t *xq = x->q + (m0 + m) * K + j * QB;
                const int64_t xb = (m0 + m) * nb + j;
                LaneInts sum = (LaneInts){0}, min_sum = (LaneInts){0};
                for (int hf = 0; hf < halves; hf++) {
                    /* the formats without mins start at -o sum(q), so the sum is sum(w q) / a already (as
                     * VNNI's) */
                    const int32_t xs = halves == 2 ? x->s16[2 * xb + hf] : x->s[xb];
                    LaneInts half = (LaneInts){0} + (HAS_KMIN(qtype) ? 0 : -off * xs);
                    for (int k = hf * span; k < (hf + 1) * span; k++) half += ct[k] * (int32_t)xq[k];
                    sum += IS_K_QUANT(qtype) ? half * sc[hf] : half;
                    min_sum += mn[hf] * xs;
                }
                const float dx = x->d[X_SCALE_AT(qtype, x, m0 + m, j)];
                LaneFloats y;
                memcpy(&y, out + m * ldo + z * NR, sizeof y);
                if (!IS_K_QUANT(qtype)) y += __builtin_convertvector(sum, LaneFloats) * (fp16_lanes(blk) * dx);
                if (HAS_BLOCK_MIN(qtype)) y += fp16_lanes(blk + 32) * (dx * (float)x->s[xb]);
                else {
                    ksum[m] = (j % 8 ? ksum[m] : (LaneInts){0}) + sum;
                    kmin[m] = (j % 8 ? kmin[m] : (LaneInts){0}) + min_sum;
                }
                if (IS_K_QUANT(qtype) && j % 8 == 7) {
                    y += __builtin_convertvector(ksum[m], LaneFloats) * (fp16_lanes(blk) * (D_UNIT(qtype) * dx));
                    if (HAS_KMIN(qtype))
                        y -= __builtin_convertvector(kmin[m], LaneFloats) *
                             ((qtype == QUANT_IQ1_TRIT ? fp16_lanes(blk) * 0.125f : fp16_lanes(blk + 32)) * dx);
                }
                memcpy(out + m * ldo + z * NR, &y, sizeof y);
            }
        }
    }
}
#elif QUANT_PATH == QUANT_AVX2
/* ------------------------------------------------------------------------------------ the AVX2 path */

/* A panel's 16 rows as two halves of 8 lanes (h = 0, 1), and vpdpbusd's sums of 4 u8 x s8 products as
 * vpmaddubsw (pairs, to int16), added up over pairs_per_widen code vectors, then vpmaddwd by 1 (to
 * int32). vpmaddubsw saturates past 32767: a 4- or 5-bit code times |q| <= 127 stays far below it,
 * Q8_0's code (w + 128) would not, so Q8_0 multiplies |w| by q carrying w's sign (llama.cpp's way) and
 * starts at 0 instead of -o sum(q). */
#define MR2 4  /* rows per micro-tile: 2 MR2 int32 sums kept in registers, 2 MR2 fp32 results beside them */

INLINE __m256i load256(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }

/* Bit g of each byte of v moved to bit `to` (the others 0): one 16-bit shift and a mask, where a shift down to bit
 * 0 and back took two (no bit crosses a byte: each lands where its own byte's bit was). Zen 3, 16 rows of 1536 x
 * 1536: Q5_0 / Q5_1 1.05x, Q5_K 1.06-1.07x. */
INLINE __m256i bit_to(__m256i v, int g, int to) {
    const __m256i moved = g < to ? _mm256_slli_epi16(v, to - g) : _mm256_srli_epi16(v, g - to);
    return _mm256_and_si256(moved, _mm256_set1_epi8((char)(1 << to)));
}

/* Half h of codes vector g (K 32 j + 4 g ..) of 32-block j in the panel block at blk. */
INLINE __m256i half_codes(int qtype, const uint8_t *blk, int j, int g, int h) {
    const __m256i low = _mm256_set1_epi8(0x0f);
    if (qtype == QUANT_Q8_0) return load256(blk + 32 + 64 * g + 32 * h);
    if (qtype == QUANT_IQ2_GRID) {
        uint8_t bytes[64];
        iq2_code_bytes(blk, j, g, bytes);
        return load256(bytes + 32 * h);
    }
    if (IS_CODE2(qtype)) {
        const __m256i v = load256(blk + LOW2_AT(qtype, j) + 64 * (g / 4) + 32 * h);
        return _mm256_and_si256(_mm256_srli_epi16(v, 2 * (g % 4)), _mm256_set1_epi8(3));
    }
    if (IS_CODE3(qtype)) {  /* the low bits, then the third as Q5_0's fifth; IQ3_TAB16's through its table */
        const uint8_t *v = blk + LOW2_AT(qtype, j) + 32 * h;
        const __m256i lo =
            _mm256_and_si256(_mm256_srli_epi16(load256(v + 64 * (g / 4)), 2 * (g % 4)), _mm256_set1_epi8(3));
        /* the third bit down to bit 0, then up (bit_to here ran Q3_K 0.81x at 16 rows on Zen 3) */
        const __m256i hb = _mm256_and_si256(_mm256_srli_epi16(load256(v + 128), g), _mm256_set1_epi8(1));
        const __m256i c = _mm256_or_si256(lo, _mm256_slli_epi16(hb, 2));
        if (qtype == QUANT_Q3_K) return c;
        const __m128i table = _mm_loadu_si128((const __m128i *)code_table(qtype, blk));
        return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(table), c);
    }
    if (XS_CODES(qtype) || qtype == QUANT_IQ4_NL) {  /* the indices through the table, a byte shuffle per 16 */
        const __m256i v = load256(blk + (XS_CODES(qtype) ? CODES_AT(qtype) + 256 * j : 32) + 64 * (g % 4) + 32 * h);
        const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)code_table(qtype, blk)));
        return _mm256_shuffle_epi8(table, _mm256_and_si256(g < 4 ? v : _mm256_srli_epi16(v, 4), low));
    }
    if (qtype == QUANT_Q6_K) {
        const uint8_t *v = blk + Q6_CODES + Q6_BLOCK * j + 192 * (g / 4) + 32 * h;
        if (g % 4 < 3) return _mm256_and_si256(load256(v + 64 * (g % 4)), _mm256_set1_epi8(0x3f));
        const __m256i p0 = _mm256_and_si256(_mm256_srli_epi16(load256(v), 6), _mm256_set1_epi8(0x03));
        const __m256i p1 = _mm256_and_si256(_mm256_srli_epi16(load256(v + 64), 4), _mm256_set1_epi8(0x0c));
        const __m256i p2 = _mm256_and_si256(_mm256_srli_epi16(load256(v + 128), 2), _mm256_set1_epi8(0x30));
        return _mm256_or_si256(_mm256_or_si256(p0, p1), p2);
    }
    if (HAS_MINS(qtype)) {
        const __m256i v = load256(blk + K_CODES(qtype, j) + 64 * g + 32 * h);
        const __m256i lo = _mm256_and_si256(j % 2 ? _mm256_srli_epi16(v, 4) : v, low);
        if (qtype == QUANT_Q4_K) return lo;
        return _mm256_or_si256(lo, bit_to(load256(blk + K5_HB(j) + 32 * h), g, 4));  /* Q5_K: as Q5_0's */
    }
    const __m256i v = load256(blk + NIBBLES_AT(qtype) + 64 * (g % 4) + 32 * h);
    const __m256i lo = _mm256_and_si256(g < 4 ? v : _mm256_srli_epi16(v, 4), low);
    if (!IS_FIFTH_32(qtype)) return lo;
    return _mm256_or_si256(lo, bit_to(load256(blk + FIFTH_AT(qtype) + 32 * h), g, 4));  /* Q5_0, Q5_1: the fifth */
}

/* Q4_K, Q5_K: half h of sub-block j's 6-bit scale and min, one per lane (GGUF's get_scale_min_k4). */
INLINE void k4_scale_min_half(const uint8_t *blk, int j, int h, __m256i *sc, __m256i *mn) {
    const __m256i d0 = load256(blk + 64 + 32 * h), d1 = load256(blk + 128 + 32 * h);
    const __m256i m6 = _mm256_set1_epi32(63), m4 = _mm256_set1_epi32(15), m2 = _mm256_set1_epi32(3);
    if (j < 4) {
        const __m128i sh = _mm_cvtsi32_si128(8 * j);
        *sc = _mm256_and_si256(_mm256_srl_epi32(d0, sh), m6);
        *mn = _mm256_and_si256(_mm256_srl_epi32(d1, sh), m6);
        return;
    }
    const __m256i d2 = load256(blk + 192 + 32 * h);
    const int i = j - 4;
    const __m128i lo = _mm_cvtsi32_si128(8 * i), hi4 = _mm_cvtsi32_si128(8 * i + 4), top = _mm_cvtsi32_si128(8 * i + 6);
    *sc = _mm256_or_si256(_mm256_and_si256(_mm256_srl_epi32(d2, lo), m4),
                          _mm256_slli_epi32(_mm256_and_si256(_mm256_srl_epi32(d0, top), m2), 4));
    *mn = _mm256_or_si256(_mm256_and_si256(_mm256_srl_epi32(d2, hi4), m4),
                          _mm256_slli_epi32(_mm256_and_si256(_mm256_srl_epi32(d1, top), m2), 4));
}

/* IQ4_XS: half h of sub-block j's scale, one per lane (iq4_scale). */
INLINE __m256i iq4_scale_half(const uint8_t *blk, int j, int h) {
    const __m256i low = _mm256_srl_epi32(load256(blk + 64 + 32 * h), _mm_cvtsi32_si128(4 * j));
    const __m256i high = _mm256_srl_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(blk + 32 + 16 * h))),
                                          _mm_cvtsi32_si128(2 * j));
    const __m256i ls = _mm256_or_si256(_mm256_and_si256(low, _mm256_set1_epi32(0xf)),
                                       _mm256_slli_epi32(_mm256_and_si256(high, _mm256_set1_epi32(3)), 4));
    return _mm256_sub_epi32(ls, _mm256_set1_epi32(32));
}

/* Q3_K: half h of sub-block s's scale, one per lane (q3_scale). */
INLINE __m256i q3_scale_half(const uint8_t *blk, int s, int h) {
    const int word = s / 4, byte = s % 4;
    const __m256i a = load256(blk + 32 + 64 * (word % 2) + 32 * h), a2 = load256(blk + 160 + 32 * h);
    const __m256i low = _mm256_and_si256(_mm256_srl_epi32(a, _mm_cvtsi32_si128(4 * (word / 2) + 8 * byte)),
                                         _mm256_set1_epi32(0xf));
    const __m256i high = _mm256_and_si256(_mm256_srl_epi32(a2, _mm_cvtsi32_si128(2 * word + 8 * byte)),
                                          _mm256_set1_epi32(3));
    return _mm256_sub_epi32(_mm256_or_si256(low, _mm256_slli_epi32(high, 4)), _mm256_set1_epi32(32));
}

/* Q2_K: half h of 32-block jj's two sub-blocks' scales and mins (q2_scale_min: a byte of scale | min << 4
 * each, bytes 2 (jj % 2) and 2 (jj % 2) + 1 of a lane's 32-bit word) as the tile's vpmaddwd operands, a byte
 * shuffle each: mult[hf] the pair (scale of sub-block hf, the same), mn_pair (min of 0, min of 1). Why: the
 * shifts and masks per sub-block, then int16_pair, took 14 instructions for these 8 (Zen 3, Q2_K 1536 x 1536
 * out of cache: 1.02-1.03x at 1 and 16 rows). */
INLINE void q2_scale_pairs_half(const uint8_t *blk, int jj, int h, __m256i mult[2][2], __m256i mn_pair[2]) {
    const __m256i v = load256(blk + 64 + 64 * (jj / 2) + 32 * h), low4 = _mm256_set1_epi16(0x0f);
    /* per 32-bit lane i of a 128-bit half: bytes (4 i + a, none, 4 i + c, none), + a | c << 16 */
    const __m256i lane = _mm256_setr_epi8(0, -128, 0, -128, 4, -128, 4, -128, 8, -128, 8, -128, 12, -128, 12, -128,
                                          0, -128, 0, -128, 4, -128, 4, -128, 8, -128, 8, -128, 12, -128, 12, -128);
    const int b = 2 * (jj % 2);
    for (int hf = 0; hf < 2; hf++)
        mult[hf][h] = _mm256_and_si256(
            _mm256_shuffle_epi8(v, _mm256_add_epi8(lane, _mm256_set1_epi32((b + hf) | (b + hf) << 16))), low4);
    const __m256i mins = _mm256_shuffle_epi8(v, _mm256_add_epi8(lane, _mm256_set1_epi32(b | (b + 1) << 16)));
    mn_pair[h] = _mm256_and_si256(_mm256_srli_epi16(mins, 4), low4);
}

/* IQ1_TRIT: half h of sub-block i's scale 2 ls + 1 and min s (8 -+ 1), one per lane (t1_nibble, T1_MIN). */
INLINE void t1_scale_min_half(const uint8_t *blk, int i, int h, __m256i *sc, __m256i *mn) {
    const __m256i n = _mm256_srl_epi32(load256(blk + 32 + 32 * h), _mm_cvtsi32_si128(8 * (i % 4) + 4 * (i / 4)));
    *sc = _mm256_add_epi32(_mm256_slli_epi32(_mm256_and_si256(n, _mm256_set1_epi32(7)), 1), _mm256_set1_epi32(1));
    const __m256i neg = _mm256_and_si256(_mm256_srli_epi32(n, 3), _mm256_set1_epi32(1));  /* 8 + 1, else 8 - 1 */
    *mn = _mm256_mullo_epi32(*sc, _mm256_add_epi32(_mm256_set1_epi32(7), _mm256_slli_epi32(neg, 1)));
}

INLINE int32_t load_i32(const int8_t *p) { int32_t v; memcpy(&v, p, 4); return v; }

/* The code vectors whose vpmaddubsw pair sums (int16) can be added before one vpmaddwd widens them: a pair
 * is at most 2 x c_max x 127, so 8 of them for 4-bit codes (30480 <= 32767), 4 for 5-bit, 2 for Q6_K's
 * 6-bit; Q8_0's |w| <= 128 leaves room for one. A third fewer instructions per 4-bit vector; the sums stay
 * exact integers, so the bits are the same. */
INLINE int pairs_per_widen(int qtype) {
    if (qtype == QUANT_Q4_0 || qtype == QUANT_Q4_1 || qtype == QUANT_Q4_K || qtype == QUANT_IQ1_TRIT ||
        qtype == QUANT_TQ2_0)
        return 8;
    if (IS_FIFTH_32(qtype) || qtype == QUANT_Q5_K || IS_LOW2(qtype)) return 4;  /* Q3_K, Q2_K: 4-vector halves */
    return qtype == QUANT_Q6_K ? 2 : 1;
}

/* sum + per 32-bit lane the sums of pairs (int16) added pairwise into int32. */
INLINE __m256i widen_add(__m256i sum, __m256i pairs) {
    return _mm256_add_epi32(sum, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

/* Per 32-bit lane the int16 pair (lo's low half, hi's low half): vpmaddwd against a pair (a, b) gives
 * lo a + hi b, exactly. Why: a K-quant's widening then multiplies by its sub-block scale (the pair (s, s))
 * and its mins by x's sums in the one vpmaddwd, where a vpmulld per sum came after it (Zen 3, 1536 x 1536
 * out of cache, 16 rows: Q2_K 1.13-1.17x, Q3_K 1.13x, Q6_K 1.14x, Q4_K 1.03-1.06x; one row within 1.1x). */
INLINE __m256i int16_pair(__m256i lo, __m256i hi) {
    return _mm256_blend_epi16(lo, _mm256_slli_epi32(hi, 16), 0xaa);
}

/* v c for a literal c: a shift where c is a power of two (Q3_K's o 4, Q6_K's 32). */
INLINE __m256i times_const(__m256i v, int32_t c) {
    if ((c & (c - 1)) == 0) return _mm256_slli_epi32(v, __builtin_ctz((unsigned)c));
    return _mm256_mullo_epi32(v, _mm256_set1_epi32(c));
}

/* x's code sums of row m's 32-block j as an int16 pair: its two 16-blocks' (halves == 2), else the
 * 32-block's and 0. */
INLINE __m256i x_sums_pair(const QuantRows *x, int64_t xb, int halves) {
    if (halves == 2) {
        int32_t both;
        memcpy(&both, x->s16 + 2 * xb, 4);
        return _mm256_set1_epi32(both);
    }
    return _mm256_set1_epi32((uint16_t)x->s[xb]);
}

#ifndef PREFETCH_J2
#define PREFETCH_J2 4
#endif

/* y[0..mr, 0..16) (fp32, ldo apart) = rows m0.. of x against panel p; `stream`: the first micro-tile of the
 * panel, which reads it from memory, asks for the 32-block PREFETCH_J2 ahead. The K-quants add up a
 * 256-block's integer sums (times their scales; mins times x's sums: kmin) before one fp32 step. */
INLINE void tile(int qtype, const QuantRows *x, int64_t m0, int mr, const uint8_t *w, int64_t K, int64_t p,
                 float *out, int64_t ldo, int stream) {
    __m256 acc[MR2][2];
    for (int m = 0; m < MR2; m++) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
    const int64_t nb = K / QB;
    const int32_t off = HAS_MINS(qtype) || SIGNED_CODES(qtype) ? 0 : (int32_t)code_offset(qtype);
    const int halves = sums_per_block(qtype), span = 8 / halves;  /* span: code vectors per integer sum */
    __m256i ksum[MR2][2] = {{_mm256_setzero_si256()}}, kmin[MR2][2] = {{_mm256_setzero_si256()}};
    for (int64_t j = 0; j < nb; j++) {
        const int jj = (int)(j % 8);
        const uint8_t *blk = panel_block(qtype, w, K, p, j);
        if (stream) {
            const int64_t step = PANEL_BYTES[qtype] * QB / BLOCK_K[qtype];  /* a 32-block's bytes */
            const uint8_t *ahead = panel_block(qtype, w, K, p, 0) + (j + PREFETCH_J2) * step;
            for (int64_t b = 0; b < step; b += 64) _mm_prefetch((const char *)ahead + b, _MM_HINT_T0);
        }
        /* the K-quants' scales and mins per half of the lanes ([hf][h]; Q4_K, Q5_K: hf 0) */
        __m256i sc[2][2], mn[2][2];
        for (int h = 0; h < 2; h++) {
            if (HAS_MINS(qtype)) k4_scale_min_half(blk, jj, h, &sc[0][h], &mn[0][h]);
            if (qtype == QUANT_IQ1_TRIT) t1_scale_min_half(blk, jj, h, &sc[0][h], &mn[0][h]);
            if (IS_XS(qtype)) sc[0][h] = iq4_scale_half(blk, jj, h);
            if (qtype == QUANT_Q3_K)
                for (int hf = 0; hf < 2; hf++) sc[hf][h] = q3_scale_half(blk, 2 * jj + hf, h);
            for (int hf = 0; hf < halves && Q6_SCALES(qtype); hf++)
                sc[hf][h] = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q6_scales(blk, j, hf) + 8 * h)));
        }
        /* the K-quants' sums are multiplied by their sub-block's scale as they widen (int16_pair) */
        const int scaled = IS_K_QUANT(qtype) && !UNIT_SCALE(qtype);
        __m256i mult[2][2], mn_pair[2];
        for (int h = 0; h < 2; h++) {
            if (qtype == QUANT_Q2_K) {
                q2_scale_pairs_half(blk, jj, h, mult, mn_pair);
                continue;
            }
            for (int hf = 0; hf < halves; hf++)
                mult[hf][h] = scaled ? int16_pair(sc[hf][h], sc[hf][h]) : _mm256_set1_epi16(1);
            if (HAS_KMIN(qtype)) mn_pair[h] = halves == 2 ? int16_pair(mn[0][h], mn[1][h]) : mn[0][h];
        }
        /* the block's integer sum, the K-quants' times their scales (zeroed: gcc does not see hf 0 set it) */
        __m256i sum[MR2][2] = {{_mm256_setzero_si256()}};
        for (int hf = 0; hf < halves; hf++) {
            /* the integer sums start at -o sum(q) at their first widening: not live before it (registers) */
            __m256i half[MR2][2];
            const int widen = pairs_per_widen(qtype);
            __m256i pairs[MR2][2];  /* int16 sums of pairs of products since the last widening */
#pragma GCC unroll 8
            for (int g = hf * span; g < (hf + 1) * span; g++) {
                __m256i c[2], sign[2];
                for (int h = 0; h < 2; h++) {
                    c[h] = half_codes(qtype, blk, jj, g, h);
                    if (SIGNED_CODES(qtype)) sign[h] = _mm256_xor_si256(c[h], _mm256_set1_epi8((char)0x80)),
                                             c[h] = _mm256_abs_epi8(sign[h]);
                }
                const int first = (g - hf * span) % widen == 0, last = (g - hf * span) % widen == widen - 1;
#pragma GCC unroll 4
                for (int m = 0; m < mr; m++) {
                    const __m256i xq = _mm256_set1_epi32(load_i32(x->q + (m0 + m) * K + j * QB + 4 * g));
                    for (int h = 0; h < 2; h++) {
                        const __m256i p = _mm256_maddubs_epi16(
                            c[h], SIGNED_CODES(qtype) ? _mm256_sign_epi8(xq, sign[h]) : xq);
                        pairs[m][h] = first ? p : _mm256_add_epi16(pairs[m][h], p);
                        /* kept in a register as summed: else gcc reassociates the adds into a tree over every
                         * product and spills each one to the stack (Zen 3, 16 rows of Q4_0: 1.27x); one row
                         * has registers to spare, and Q2_K's ran 0.85x so */
                        if (mr > 1) __asm__("" : "+x"(pairs[m][h]));
                        if (last && g - hf * span < widen && scaled) {  /* the offset: after the loop */
                            half[m][h] = _mm256_madd_epi16(pairs[m][h], mult[hf][h]);
                        } else if (last && g - hf * span < widen) {
                            const int64_t xb = (m0 + m) * nb + j;
                            const int32_t sq = halves == 2 ? x->s16[2 * xb + hf] : x->s[xb];
                            half[m][h] = widen_add(_mm256_set1_epi32(-off * sq), pairs[m][h]);
                        } else if (last) {
                            half[m][h] = _mm256_add_epi32(half[m][h], _mm256_madd_epi16(pairs[m][h], mult[hf][h]));
                        }
                        if (last && mr > 1) __asm__("" : "+x"(half[m][h]));  /* the widened sums too (Q8_0 1.09x) */
                    }
                }
            }
#pragma GCC unroll 4
            for (int m = 0; m < mr; m++)
                for (int h = 0; h < 2; h++) sum[m][h] = hf == 0 ? half[m][h] : _mm256_add_epi32(sum[m][h], half[m][h]);
        }
        if (scaled && off != 0) {  /* - o sum_hf scale_hf sum(q of hf), the pairs in one vpmaddwd */
#pragma GCC unroll 4
            for (int m = 0; m < mr; m++) {
                const __m256i xs = x_sums_pair(x, (m0 + m) * nb + j, halves);
                for (int h = 0; h < 2; h++) {
                    const __m256i sc_pair = int16_pair(sc[0][h], halves == 2 ? sc[1][h] : _mm256_setzero_si256());
                    const __m256i o = times_const(_mm256_madd_epi16(sc_pair, xs), off);
                    sum[m][h] = _mm256_sub_epi32(sum[m][h], o);
                }
            }
        }
        if (IS_K_QUANT(qtype)) {
#pragma GCC unroll 4
            for (int m = 0; m < mr; m++)
                for (int h = 0; h < 2; h++) {
                    const int64_t xb = (m0 + m) * nb + j;
                    ksum[m][h] = jj == 0 ? sum[m][h] : _mm256_add_epi32(ksum[m][h], sum[m][h]);
                    if (!HAS_KMIN(qtype)) continue;
                    /* Q2_K: a min per half, times x's 16-block sum */
                    const __m256i v = _mm256_madd_epi16(mn_pair[h], x_sums_pair(x, xb, halves));
                    kmin[m][h] = jj == 0 ? v : _mm256_add_epi32(kmin[m][h], v);
                }
            if (jj < 7) continue;
        }
        for (int h = 0; h < 2; h++) {
            __m256 a = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16 * h)));
            if (D_UNIT(qtype) != 1.0f) a = _mm256_mul_ps(a, _mm256_set1_ps(D_UNIT(qtype)));
            const __m256 dmin = qtype == QUANT_IQ1_TRIT  /* its min in eighths of d */
                                    ? _mm256_mul_ps(a, _mm256_set1_ps(0.125f))
                                    : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 32 + 16 * h)));
#pragma GCC unroll 4
            for (int m = 0; m < mr; m++) {
                const __m256 dx = _mm256_set1_ps(x->d[X_SCALE_AT(qtype, x, m0 + m, j)]);
                const __m256 s = _mm256_cvtepi32_ps(IS_K_QUANT(qtype) ? ksum[m][h] : sum[m][h]);
                acc[m][h] = _mm256_fmadd_ps(s, _mm256_mul_ps(a, dx), acc[m][h]);
                if (HAS_KMIN(qtype))
                    acc[m][h] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(kmin[m][h]), _mm256_mul_ps(dmin, dx), acc[m][h]);
                if (HAS_BLOCK_MIN(qtype))  /* dmin: the block's m here */
                    acc[m][h] = _mm256_fmadd_ps(
                        dmin, _mm256_set1_ps(x->d[X_SCALE_AT(qtype, x, m0 + m, j)] * (float)x->s[(m0 + m) * nb + j]),
                        acc[m][h]);
            }
        }
    }
    for (int m = 0; m < mr; m++)
        for (int h = 0; h < 2; h++) _mm256_storeu_ps(out + m * ldo + 8 * h, acc[m][h]);
}

/* Each (format, mr) its own unrolled copy: the tile sizes must be literals for the registers. */
#define QCASE2(R) case R: tile(qtype, x, m0, R, w, K, p, out, ldo, stream); break;
_Static_assert(MR2 == 4, "the tile cases below cover mr <= 4");
#define QTILE_FN(NAME, QT)                                                                                   \
    static void NAME(const QuantRows *x, int64_t m0, int mr, const uint8_t *w, int64_t K, int64_t p,          \
                     float *out, int64_t ldo, int stream) {                                                  \
        const int qtype = QT;                                                                                \
        switch (mr) { QCASE2(1) QCASE2(2) QCASE2(3) QCASE2(4) default: break; }                               \
    }
QUANT_FORMATS(QTILE_FN)
/* Each format's tile, by qtype. */
static void (*const TILES[])(const QuantRows *, int64_t, int, const uint8_t *, int64_t, int64_t, float *, int64_t,
                             int) = {QUANT_FORMATS(QTILE_ENTRY)};

/* Rows m0 .. m0 + rows against panels p0 .. p0 + nz, a panel at a time (its blocks then stay in L1 for
 * every micro-tile of rows); the hardware prefetcher streams the panels. */
static void tile_rows(int qtype, const QuantRows *x, int64_t m0, int64_t rows, const uint8_t *w, int64_t K,
                      int64_t p0, int nz, float *out, int64_t ldo, const uint8_t *next, int64_t next_bytes,
                      int prefetch) {
    (void)next, (void)next_bytes;
    for (int z = 0; z < nz; z++)
        for (int64_t m = 0; m < rows; m += MR2) {
            const int mr = (int)(rows - m < MR2 ? rows - m : MR2);
            float *o = out + m * ldo + z * NR;
            const int stream = m == 0 && prefetch;
            TILES[qtype](x, m0 + m, mr, w, K, p0 + z, o, ldo, stream);
        }
}
#else
/* ---------------------------------------------------------------------------- the AVX-512 VNNI path */

/* IQ2_GRID's code vector g (= 2 i + h) of 32-block j. With VBMI: the 64 grid indices through half h of
 * IQ2_GRID_CODE by byte lookups (two 128-entry vpermi2b, the second under the mask of bit 7 over the first's
 * result, which keeps those lanes' indices: the same for each g of a half, so the compiler keeps them across
 * the unrolled g), each row's byte i spread to its 4 level numbers (vpmultishiftqb, 2 bits apart), their
 * values + 128 (vpermb on the low 6 bits, from a table of period 4), negated under the sign mask (128 - value
 * is 0 - (128 + value) in bytes). Else one code at a time. */
INLINE __m512i iq2_codes(const uint8_t *blk, int j, int g) {
#ifdef __AVX512VBMI__
    const uint8_t *v = blk + IQ2_CODES + 128 * j, *table = IQ2_GRID_CODE[g % 2];
    const __m512i idx = _mm512_loadu_si512(v);
    const __mmask64 top = _mm512_movepi8_mask(idx);  /* entries 128..255: the second lookup's, merged over */
    const __m512i low = _mm512_mask2_permutex2var_epi8(_mm512_load_si512(table), idx, ~top,
                                                       _mm512_load_si512(table + 64));
    const __m512i half = _mm512_mask2_permutex2var_epi8(_mm512_load_si512(table + 128), low, top,
                                                        _mm512_load_si512(table + 192));
    /* byte 4 d + t of each qword (its dword d: row 2 q + d) from bit 32 d + 8 i + 2 t */
    const uint64_t step = 0x0808080808080808ull * (uint64_t)(g / 2);
    const __m512i spread = _mm512_set1_epi64((int64_t)(0x2624222006040200ull + step));
    const __m512i value = _mm512_permutexvar_epi8(_mm512_multishift_epi64_epi8(spread, half),
                                                  _mm512_set1_epi32(0x00ab9988));  /* 128 + 8, 25, 43 */
    uint64_t neg;
    memcpy(&neg, v + 64 + 8 * g, 8);
    return _mm512_mask_sub_epi8(value, (__mmask64)neg, _mm512_setzero_si512(), value);
#else
    uint8_t bytes[64];
    iq2_code_bytes(blk, j, g, bytes);
    return _mm512_loadu_si512(bytes);
#endif
}

/* Q2_K's 2-bit code vectors (IQ1_TRIT's, Q3_K's and IQ3_TAB16's low bits) where the CPU has VBMI: bit pair k of
 * each byte by one byte lookup in place (vpermb reads an index's bits 0..5: a 64-byte table of (e >> 2 k) & 3 picks
 * pair k) rather than a shift and a mask; pair 3, out of its reach, is shifted down first. AMX Xeon, one row of
 * 1024 x 2048 in L2 (scripts/quant_builds_microbench.py --in-cache --variant shifts=-DNO_LOW2_LOOKUP): Q2_K and
 * Q3_K 1.12-1.13x, IQ1_TRIT 1.15x, IQ3_TAB16 1.06x; from memory (16384 x 2048) 1.00-1.02x. Not measured on the
 * Zen CPUs, which have VBMI but no AMX: kept to the Intel ones. */
#if defined(__AVX512VBMI__) && defined(__AMX_INT8__) && !defined(NO_LOW2_LOOKUP)
#define LOW2_LOOKUP 1
static const uint8_t LOW2_TABLE[3][64] __attribute__((aligned(64))) = {
#define T(e, k) (((e) >> (2 * (k))) & 3)
#define ROW8(b, k) T(b, k), T(b + 1, k), T(b + 2, k), T(b + 3, k), T(b + 4, k), T(b + 5, k), T(b + 6, k), T(b + 7, k)
#define TAB(k) {ROW8(0, k), ROW8(8, k), ROW8(16, k), ROW8(24, k), ROW8(32, k), ROW8(40, k), ROW8(48, k), ROW8(56, k)}
    TAB(0), TAB(1), TAB(2)
#undef TAB
#undef ROW8
#undef T
};
INLINE __m512i low2_lookup(__m512i raw, int k) {
    if (k == 3) return _mm512_permutexvar_epi8(_mm512_srli_epi16(raw, 6), _mm512_load_si512(LOW2_TABLE[0]));
    return _mm512_permutexvar_epi8(raw, _mm512_load_si512(LOW2_TABLE[k]));
}
#endif

/* Codes vector g (K 32 j + 4 g ..) of 32-block j in the panel block at blk. */
INLINE __m512i codes(int qtype, const uint8_t *blk, int j, int g, int one_sum) {
    const __m512i low = _mm512_set1_epi8(0x0f);
    if (qtype == QUANT_Q8_0) return _mm512_loadu_si512(blk + 32 + 64 * g);
    if (qtype == QUANT_IQ2_GRID) return iq2_codes(blk, j, g);
    if (HAS_LOW2(qtype) || IS_CODE3(qtype)) {
        /* the low bits: bits 2 (g % 4), + 1 of vector g / 4; Q3_K's third bit g of the hb byte moved to bit 2
         * and put in (0xF8: A | (B & C)), IQ3_TAB16's 3 bits then through its table. g is a literal (each half its
         * own block_half): shifts by constants */
        const uint8_t *v = blk + LOW2_AT(qtype, j);
        const __m512i raw = _mm512_loadu_si512(v + 64 * (g / 4));
#ifdef LOW2_LOOKUP
        const __m512i lo = low2_lookup(raw, g % 4);
#else
        const __m512i lo = _mm512_and_si512(g % 4 ? _mm512_srli_epi16(raw, 2 * (g % 4)) : raw, _mm512_set1_epi8(3));
#endif
        if (!IS_CODE3(qtype)) return lo;
        const __m512i hb = _mm512_loadu_si512(v + 128);
        const __m512i third = g < 2 ? _mm512_slli_epi16(hb, 2 - g) : g > 2 ? _mm512_srli_epi16(hb, g - 2) : hb;
        const __m512i c = _mm512_ternarylogic_epi32(lo, third, _mm512_set1_epi8(4), 0xF8);
        if (qtype == QUANT_Q3_K) return c;
        return _mm512_shuffle_epi8(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)code_table(qtype, blk))), c);
    }
    if (XS_CODES(qtype) || qtype == QUANT_IQ4_NL) {  /* the indices through the table, a byte shuffle per 16 */
        const __m512i v =
            _mm512_loadu_si512(blk + (XS_CODES(qtype) ? CODES_AT(qtype) + 256 * j : 32) + 64 * (g % 4));
        const __m512i table = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)code_table(qtype, blk)));
        return _mm512_shuffle_epi8(table, _mm512_and_si512(g < 4 ? v : _mm512_srli_epi16(v, 4), low));
    }
    if (qtype == QUANT_Q6_K) {
        const uint8_t *v = blk + Q6_CODES + Q6_BLOCK * j + 192 * (g / 4);
        if (g % 4 < 3) return _mm512_and_si512(_mm512_loadu_si512(v + 64 * (g % 4)), _mm512_set1_epi8(0x3f));
        /* the fourth code: bit pairs 6, 7 of the three vectors to 0, 1 | 2, 3 | 4, 5, by 16-bit shifts and
         * two bit selects (0xE4: C ? A : B); the low byte's bits 6, 7 then hold the high byte's: masked */
        const __m512i p0 = _mm512_srli_epi16(_mm512_loadu_si512(v), 6);
        const __m512i p1 = _mm512_srli_epi16(_mm512_loadu_si512(v + 64), 4);
        const __m512i p2 = _mm512_srli_epi16(_mm512_loadu_si512(v + 128), 2);
        const __m512i p01 = _mm512_ternarylogic_epi32(p0, p1, _mm512_set1_epi8(0x03), 0xE4);
        return _mm512_and_si512(_mm512_ternarylogic_epi32(p01, p2, _mm512_set1_epi8(0x0f), 0xE4),
                                _mm512_set1_epi8(0x3f));
    }
    if (qtype == QUANT_Q4_0 || qtype == QUANT_Q4_1) {
        __m512i v = _mm512_loadu_si512(blk + NIBBLES_AT(qtype) + 64 * (g % 4));
        return _mm512_and_si512(g < 4 ? v : _mm512_srli_epi16(v, 4), low);
    }
    if (IS_FIFTH_32(qtype)) {
        /* bit g of each hb byte to bit 4 (16-bit shifts move no bit across a byte's bit 4 here), then
         * low nibble | that bit: one ternary op (0xF8: A | (B & C)) */
        const __m512i v = _mm512_loadu_si512(blk + NIBBLES_AT(qtype) + 64 * (g % 4));
        const __m512i hb = _mm512_loadu_si512(blk + FIFTH_AT(qtype));
        const __m512i lo = _mm512_and_si512(g < 4 ? v : _mm512_srli_epi16(v, 4), low);
        const __m512i hi = g < 4 ? _mm512_slli_epi16(hb, 4 - g) : g > 4 ? _mm512_srli_epi16(hb, g - 4) : hb;
        return _mm512_ternarylogic_epi32(lo, hi, _mm512_set1_epi8(0x10), 0xF8);
    }
    const __m512i v = _mm512_loadu_si512(blk + K_CODES(qtype, j) + 64 * g);
    const __m512i lo = _mm512_and_si512(j % 2 ? _mm512_srli_epi16(v, 4) : v, low);
    if (qtype == QUANT_Q4_K) return lo;
    /* Q5_K: 16 more where bit g of the hb byte is set. A tile of one integer sum (one row and one panel: a
     * stream from memory) adds it under the mask of bit g (there 1.03-1.07x faster than the shift below);
     * larger tiles move bit g to bit 4 and put it in as Q5_0's (g is a literal: shifts by constants), fewer
     * ops per code vector */
    const __m512i hb = _mm512_loadu_si512(blk + K5_HB(j));
    if (one_sum)
        return _mm512_mask_add_epi8(lo, _mm512_test_epi8_mask(hb, _mm512_set1_epi8((char)(1 << g))), lo,
                                    _mm512_set1_epi8(16));
    const __m512i hi = g < 4 ? _mm512_slli_epi16(hb, 4 - g) : g > 4 ? _mm512_srli_epi16(hb, g - 4) : hb;
    return _mm512_ternarylogic_epi32(lo, hi, _mm512_set1_epi8(0x10), 0xF8);
}

/* Q4_K, Q5_K: a 256-block's 6-bit scales (sm[0]: sub-blocks 0..3, sm[1]: 4..7) or mins (mins = 1), per
 * lane, as bytes (byte i of a lane: sub-block 4 h + i; GGUF's get_scale_min_k4 on 4 at a time: 0xF8 is
 * A | (B & C), bits 6, 7 of a byte of the first 8 moved to bits 4, 5 of its byte in the last 4). */
INLINE void k4_unpack(const uint8_t *blk, int mins, __m512i sm[2]) {
    const __m512i d = _mm512_loadu_si512(blk + 64 + 64 * mins), d2 = _mm512_loadu_si512(blk + 192);
    const __m512i low = _mm512_and_si512(mins ? _mm512_srli_epi32(d2, 4) : d2, _mm512_set1_epi8(0x0f));
    sm[0] = _mm512_and_si512(d, _mm512_set1_epi8(0x3f));
    sm[1] = _mm512_ternarylogic_epi32(low, _mm512_srli_epi32(d, 2), _mm512_set1_epi8(0x30), 0xF8);
}

/* Q4_K, Q5_K: sub-block jj's scale (jj = 0..7) of k4_unpack's bytes, one per lane. */
INLINE __m512i k4_scale(const __m512i sm[2], int jj) {
    return _mm512_and_si512(_mm512_srl_epi32(jj < 4 ? sm[0] : sm[1], _mm_cvtsi32_si128(8 * (jj % 4))),
                            _mm512_set1_epi32(0xff));
}

/* Q4_K, Q5_K, Q2_K, IQ1_TRIT: sum over a 256-block's sub-blocks i of min_i sum(q of sub-block i), per lane, as
 * integers: the mins (a byte each, 4 to a lane's word: Q4_K's 8 in 2 vectors, Q2_K's 16 in 4) as 16-bit
 * pairs (vpshufb: bytes 2 p, 2 p + 1 of each lane, zero-extended) times x's pairs of sub-block sums (bs:
 * the block's 8 32-block sums or 16 16-block sums, int16), by vpdpwssd. */
INLINE __m512i k_min_sum(const __m512i *mins, int vectors, const int16_t *bs) {
    const __m512i pair[2] = {_mm512_set4_epi32((int)0x800d800c, (int)0x80098008, (int)0x80058004, (int)0x80018000),
                             _mm512_set4_epi32((int)0x800f800e, (int)0x800b800a, (int)0x80078006, (int)0x80038002)};
    __m512i sum = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int p = 0; p < 2 * vectors; p++) {
        int32_t xs;
        memcpy(&xs, bs + 2 * p, 4);
        sum = _mm512_dpwssd_epi32(sum, _mm512_shuffle_epi8(mins[p / 2], pair[p % 2]), _mm512_set1_epi32(xs));
    }
    return sum;
}

/* IQ4_XS: a 256-block's 8 sub-block scales (iq4_scale), a vector each. */
INLINE void iq4_unpack(const uint8_t *blk, __m512i sc[8]) {
    const __m512i low = _mm512_loadu_si512(blk + 64);
    const __m512i high = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(blk + 32)));
#pragma GCC unroll 8
    for (int i = 0; i < 8; i++) {
        const __m512i lo = _mm512_and_si512(_mm512_srl_epi32(low, _mm_cvtsi32_si128(4 * i)), _mm512_set1_epi32(0xf));
        const __m512i hi = _mm512_and_si512(_mm512_srl_epi32(high, _mm_cvtsi32_si128(2 * i)), _mm512_set1_epi32(3));
        sc[i] = _mm512_sub_epi32(_mm512_or_si512(lo, _mm512_slli_epi32(hi, 4)), _mm512_set1_epi32(32));
    }
}

/* Q3_K: a 256-block's 16 sub-block scales (q3_scale), a vector each: the four words of 4 scale bytes
 * (GGUF's kmask unpacking, 0xF8 = A | (B & C)), less 32 per byte, then each byte sign-extended. */
INLINE void q3_unpack(const uint8_t *blk, __m512i sc[16]) {
    const __m512i a0 = _mm512_loadu_si512(blk + 32), a1 = _mm512_loadu_si512(blk + 96);
    const __m512i a2 = _mm512_loadu_si512(blk + 160);
    const __m512i low = _mm512_set1_epi8(0x0f), top = _mm512_set1_epi8(0x30), bias = _mm512_set1_epi8(32);
    const __m512i w[4] = {
        _mm512_ternarylogic_epi32(_mm512_and_si512(a0, low), _mm512_slli_epi32(a2, 4), top, 0xF8),
        _mm512_ternarylogic_epi32(_mm512_and_si512(a1, low), _mm512_slli_epi32(a2, 2), top, 0xF8),
        _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi32(a0, 4), low), a2, top, 0xF8),
        _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi32(a1, 4), low), _mm512_srli_epi32(a2, 2), top,
                                  0xF8)};
#pragma GCC unroll 16
    for (int s = 0; s < 16; s++) {
        const __m512i byte = _mm512_slli_epi32(_mm512_sub_epi8(w[s / 4], bias), 24 - 8 * (s % 4));
        sc[s] = _mm512_and_si512(_mm512_srai_epi32(byte, 24), _mm512_set1_epi32(0xffff));  /* int16: SUMS_FIT_16 */
    }
}

/* Q2_K: a 256-block's 16 sub-block scales (q2_scale_min), a vector each, from its 4 vectors of scale bytes. */
INLINE void q2_unpack(const uint8_t *blk, __m512i sc[16]) {
#pragma GCC unroll 16
    for (int s = 0; s < 16; s++)
        sc[s] = _mm512_and_si512(_mm512_srli_epi32(_mm512_loadu_si512(blk + 64 + 64 * (s / 4)), 8 * (s % 4)),
                                 _mm512_set1_epi32(0xf));
}

/* IQ1_TRIT: a 256-block's 8 sub-block scales 2 ls + 1 (t1_nibble), a vector each. */
INLINE void t1_unpack(const uint8_t *blk, __m512i sc[8]) {
    const __m512i v = _mm512_loadu_si512(blk + 32);
#pragma GCC unroll 8
    for (int i = 0; i < 8; i++) {
        const __m512i ls = _mm512_and_si512(_mm512_srli_epi32(v, 8 * (i % 4) + 4 * (i / 4)), _mm512_set1_epi32(7));
        sc[i] = _mm512_or_si512(_mm512_slli_epi32(ls, 1), _mm512_set1_epi32(1));
    }
}

/* IQ1_TRIT: a 256-block's 8 mins as k_min_sum wants them (byte i of lane l in mins[h]: sub-block 4 h + i's), each
 * its scale nibble's T1_MIN by a byte shuffle. */
INLINE void t1_mins(const uint8_t *blk, __m512i mins[2]) {
    const __m512i v = _mm512_loadu_si512(blk + 32), low = _mm512_set1_epi8(0x0f);
    const __m512i table = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)T1_MIN));
    mins[0] = _mm512_shuffle_epi8(table, _mm512_and_si512(v, low));
    mins[1] = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi32(v, 4), low));
}

INLINE int32_t load_i32(const int8_t *p) { int32_t v; memcpy(&v, p, 4); return v; }

/* The bytes the NZ panel streams will read PREFETCH_J 32-blocks from now, into L1: a micro-tile that reads
 * its panels from memory (the first of a task: the later ones find them in L2) keeps more lines in flight
 * than the hardware prefetcher does on these short streams (a panel of K = 576 is 5 KB). */
#ifndef PREFETCH_J
#define PREFETCH_J 4
#endif

/* A tile of at most this many integer sums (rows x panels) keeps each in two chains, even and odd code
 * vectors, added at the end (integers: the same bits): a one-row, one-panel tile (single-stream mode at
 * one row) otherwise waits on one vpdpbusd chain. Zen 5, 1 thread, one row, 2048 x 2048 out of cache
 * (scripts/quant_builds_microbench.py --single-stream --variant): Q6_K 1.23x, Q4_K 1.03x, Q8_0 / Q4_0
 * unchanged; at two rows (two chains already) no gain. */
#ifndef SPLIT_SUMS
#define SPLIT_SUMS 1
#endif
/* Single-stream mode's one stream per thread is prefetched this many bytes ahead, past what the hardware
 * prefetcher keeps in flight: Zen 5, 1 thread, 2048 x 2048 out of cache, against no software prefetch
 * (scripts/quant_builds_microbench.py --single-stream --baseline): one / two rows Q4_K 1.39x / 1.47x,
 * Q6_K 1.32x / 1.33x, Q4_0 1.24x / 1.34x, Q5_0 1.24x / 1.37x (then at 35-41 GB/s, the core's read
 * bandwidth), Q8_0 0.97x / 1.10x; 9 KB and 16 KB ahead did no better. On a Zen 4 the same prefetch was
 * slower at one row (its hardware prefetcher alone streams faster), so it is a choice made at load too
 * (gemm_quant_set_single_prefetch; 0: the hardware prefetcher alone). Into L2 instead of L1 (2) it was
 * the fastest on that Zen 4 for the K-quants: one row of 16384 x 2048 out of cache, against none, Q5_K
 * 30.1 / 20.0 GB/s, Q6_K 28.0 / 25.5, Q4_K 26.8 / 26.4 (into L1: 18.2, 25.2, 26.4; those figures with a 96 MB
 * ring, partly in the L3). Into L2, it also brings the 32-block L1_NEAR ahead from L2 into L1, which the one-row
 * tile otherwise waits for: one row of 11264 x 2048, a 512 MB ring (2026-12-06), Q5_K 1.16-1.21x (26.4-26.5
 * GB/s, against 18.8 with the hardware prefetcher alone), Q4_K, IQ4_XS and Q3_K 1.03-1.06x, Q2_K even. */
#ifndef SINGLE_PREFETCH_BYTES
#define SINGLE_PREFETCH_BYTES 12288
#endif
#ifndef L1_NEAR
#define L1_NEAR 4
#endif
static int single_prefetch[QUANT_NUM_TYPES] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};
_Static_assert(QUANT_NUM_TYPES == 18, "single_prefetch starts at 1 for each format");

void gemm_quant_set_single_prefetch_for(int qtype, int level) {
    if (qtype >= 0 && qtype < QUANT_NUM_TYPES) single_prefetch[qtype] = level;
}

/* How far ahead a task's first micro-tile prefetches, in 32-blocks (0: not at all; negative: -that far,
 * into L2 rather than L1). */
static int prefetch_blocks(int qtype, int single) {
    const int64_t step = PANEL_BYTES[qtype] * QB / BLOCK_K[qtype];  /* a 32-block's bytes */
    const int distance = (int)(SINGLE_PREFETCH_BYTES / step);
    const int level = single_prefetch[qtype];
    return !single ? PREFETCH_J : level == 2 ? -distance : level ? distance : 0;
}

INLINE void prefetch_ahead(int qtype, const uint8_t *const *blk, int nz, int64_t j, int distance) {
    const int64_t step = PANEL_BYTES[qtype] * QB / BLOCK_K[qtype];  /* a 32-block's bytes */
    /* blk: the K-quants' 256-block, else the 32-block itself (IQ4_NL's half of its pair) */
    const int64_t within = IS_K_QUANT(qtype) ? j % (BLOCK_K[qtype] / QB) : 0;
    const int64_t at = (within + (distance < 0 ? -distance : distance)) * step;
    for (int z = 0; z < nz; z++)
        for (int64_t b = 0; b < step; b += 64) {
            const char *line = (const char *)blk[z] + at + b;
            if (distance < 0) _mm_prefetch(line, _MM_HINT_T1);
            else _mm_prefetch(line, _MM_HINT_T0);
        }
    if (distance < 0)  /* and from L2 into L1 the 32-block L1_NEAR ahead (see SINGLE_PREFETCH_BYTES) */
        for (int z = 0; z < nz; z++)
            for (int64_t b = 0; b < step; b += 64)
                _mm_prefetch((const char *)blk[z] + (within + L1_NEAR) * step + b, _MM_HINT_T0);
}

/* Where a micro-tile that reads its panels from L2 brings later weights into L2 meanwhile: at its 32-block j,
 * `bytes` bytes from at + j stride (at NULL: none). */
typedef struct {
    const uint8_t *at;
    int64_t stride, bytes;
} Ahead;

/* The K-quants at the end of a 256-block (its last 32-block j): y += dx (d ksum - dmin sum(min_i bs_i)),
 * y in out's rows. */
INLINE void k_block_end(int qtype, const QuantRows *x, int64_t m0, int mr, const uint8_t *const *blk, int nz,
                        int64_t j, const __m512i *ksum, float *out, int64_t ldo) {
#pragma GCC unroll 4
    for (int z = 0; z < nz; z++) {
        __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk[z]));
        if (D_UNIT(qtype) != 1.0f) d = _mm512_mul_ps(d, _mm512_set1_ps(D_UNIT(qtype)));
        __m512 dmin = _mm512_setzero_ps();
        __m512i mins[4];  /* Q4_K, Q5_K: k4_unpack's 2; Q2_K: 4 vectors of 4 mins a lane */
        if (HAS_KMIN(qtype))  /* IQ1_TRIT's mins are in eighths of d */
            dmin = qtype == QUANT_IQ1_TRIT ? _mm512_mul_ps(d, _mm512_set1_ps(0.125f))
                                           : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk[z] + 32)));
        if (HAS_MINS(qtype)) k4_unpack(blk[z], 1, mins);
        if (qtype == QUANT_IQ1_TRIT) t1_mins(blk[z], mins);
        if (qtype == QUANT_Q2_K)
            for (int t = 0; t < 4; t++)
                mins[t] = _mm512_and_si512(_mm512_srli_epi32(_mm512_loadu_si512(blk[z] + 64 + 64 * t), 4),
                                           _mm512_set1_epi8(0x0f));
#pragma GCC unroll 8
        for (int m = 0; m < mr; m++) {
            const __m512 dx = _mm512_set1_ps(x->d[X_SCALE_AT(qtype, x, m0 + m, j)]);
            float *y = out + m * ldo + z * NR;
            __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ksum[m * NZ + z]), _mm512_mul_ps(d, dx), _mm512_loadu_ps(y));
            if (HAS_KMIN(qtype)) {
                const __m512i ms = qtype != QUANT_Q2_K ? k_min_sum(mins, 2, x->s + (m0 + m) * (x->K / QB) + j - 7)
                                                       : k_min_sum(mins, 4, x->s16 + (m0 + m) * (x->K / 16) + 2 * (j - 7));
                v = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(ms), _mm512_mul_ps(dmin, dx), v);
            }
            _mm512_storeu_ps(y, v);
        }
    }
}

/* Decoded tiles: a task of at least DECODE_MIN_TILES full micro-tiles decodes its panels once, DECODED_BLOCKS
 * 32-blocks at a time (decode_blocks: every code vector, nz x 4 KB, in L1), for all of them to load, instead of
 * each micro-tile decoding them again from the packed panels. */
#ifndef DECODE_MIN_TILES
#define DECODE_MIN_TILES 2
#endif
#define DECODED_BLOCKS (KB / QB)  /* 32-blocks decoded at a time: a K-quant's 256-block */
#define DECODED_BYTES (DECODED_BLOCKS * 8 * 64)  /* a panel's DECODED_BLOCKS decoded, 8 code vectors each */
#define DECODED_AT(z, jj, g) (((int64_t)(z) * DECODED_BLOCKS + (jj)) * 512 + 64 * (g))
#define DECODES(qtype) ((qtype) != QUANT_Q8_0)  /* Q8_0's codes are loaded as they are */

/* Half hf of 32-block j (the whole block where it has one integer sum) into sum: for rows m0 .. m0 + mr
 * against the panel blocks blk, the integer sums of its code vectors, the K-quants' times their sub-block's
 * scale (kscale, or Q6_K's in the block), added to sum's (the K-quants' 256-block sums; else hf 1) or put
 * there (hf 0). */
INLINE void block_half(int qtype, const QuantRows *x, int64_t m0, int mr, const uint8_t *const *blk, int nz,
                       int64_t K, int64_t j, int jj, int hf, __m512i kscale[NZ][16], __m512i *sum,
                       int decoded, const uint8_t *dec) {
    const int64_t nb = K / QB;
    const float off = code_offset(qtype);
    const int halves = sums_per_block(qtype), span = 8 / halves;  /* span: code vectors per integer sum */
    __m512i half[MR_WIDE * NZ];
#pragma GCC unroll 8
    for (int m = 0; m < mr; m++) {
        /* the formats without mins start at -o sum(q), so the integer sum is sum(w q) / a already */
        const int64_t xb = (m0 + m) * nb + j;
        const int32_t start = HAS_KMIN(qtype) ? 0 : -(int32_t)off * (halves == 2 ? x->s16[2 * xb + hf] : x->s[xb]);
#pragma GCC unroll 4
        for (int z = 0; z < nz; z++) half[m * NZ + z] = _mm512_set1_epi32(start);
    }
    const int split = mr * nz <= SPLIT_SUMS;  /* a literal per copy, as mr and nz */
    __m512i odd[MR_WIDE * NZ];  /* split: the odd code vectors' sums, added to the even ones' after */
    if (split)
        for (int i = 0; i < mr * NZ; i++) odd[i] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int g = hf * span; g < (hf + 1) * span; g++) {
        __m512i c[NZ];
#pragma GCC unroll 4
        for (int z = 0; z < nz; z++)
            c[z] = decoded ? _mm512_load_si512(dec + DECODED_AT(z, jj, g)) : codes(qtype, blk[z], jj, g, mr * nz == 1);
#pragma GCC unroll 8
        for (int m = 0; m < mr; m++) {
            const __m512i xq = _mm512_set1_epi32(load_i32(x->q + (m0 + m) * K + j * QB + 4 * g));
#pragma GCC unroll 4
            for (int z = 0; z < nz; z++) {
                __m512i *acc_g = split && g % 2 ? &odd[m * NZ + z] : &half[m * NZ + z];
                *acc_g = _mm512_dpbusd_epi32(*acc_g, c[z], xq);
            }
        }
    }
    if (split)
        for (int i = 0; i < mr * NZ; i++) half[i] = _mm512_add_epi32(half[i], odd[i]);
#pragma GCC unroll 4
    for (int z = 0; z < nz; z++) {  /* the K-quants: times the sub-block's scale (Numerics) */
        const __m512i sc = !IS_K_QUANT(qtype) || UNIT_SCALE(qtype) ? _mm512_setzero_si512()
                           : HAS_KSCALE(qtype) ? kscale[z][IS_LOW2(qtype) ? 2 * jj + hf : jj]
                           : _mm512_cvtepi8_epi32(
                                 _mm_loadu_si128((const __m128i *)q6_scales(blk[z], j, hf)));
#pragma GCC unroll 8
        for (int m = 0; m < mr; m++) {
            /* where a sum fits in 16 bits and its scale's top half is 0, one vpmaddwd: vpmulld is two uops */
            const __m512i scaled = UNIT_SCALE(qtype) || !IS_K_QUANT(qtype) ? half[m * NZ + z]
                                   : SUMS_FIT_16(qtype) ? _mm512_madd_epi16(half[m * NZ + z], sc)
                                                        : _mm512_mullo_epi32(half[m * NZ + z], sc);
            sum[m * NZ + z] = hf == 0 && !IS_K_QUANT(qtype) ? scaled : _mm512_add_epi32(sum[m * NZ + z], scaled);
        }
    }
}

/* The prefetches of a micro-tile at 32-block j of its panels blk (tile's stream and ahead). */
INLINE void tile_prefetch(int qtype, const uint8_t *const *blk, int nz, int64_t j, int stream, Ahead ahead) {
    if (stream) prefetch_ahead(qtype, blk, nz, j, stream);
    else if (ahead.at != NULL)
        for (int64_t b = 0; b < ahead.bytes; b += 64)
            _mm_prefetch((const char *)ahead.at + j * ahead.stride + b, _MM_HINT_T2);
}

/* A K-quant's 256-block from 32-block j0 into y[0..mr, 0..16 nz) (out's rows, fp32): its integer sums kept in
 * registers through it (ksum), the epilogue's pressure outside. Codes from `dec` (decode_blocks', this
 * 256-block's) where `decoded` (a literal in each copy), else from the panels. */
INLINE void k_block(int qtype, const QuantRows *x, int64_t m0, int mr, const uint8_t *w, int64_t K, int64_t p0,
                    int nz, int64_t j0, float *out, int64_t ldo, int stream, Ahead ahead, int decoded,
                    const uint8_t *dec) {
    __m512i ksum[MR_WIDE * NZ];  /* the 256-block's integer sums so far, each times its scale */
    /* Q4_K, Q5_K, IQ4_XS, Q3_K, Q2_K: the 256-block's scales, a vector per sub-block, in memory (indexed at run
     * time): in registers beside ksum they would spill a 4 x 3 tile's sums */
    __m512i kscale[NZ][16];  /* Q3_K, Q2_K: 16, one per 16-weight sub-block */
    for (int i = 0; i < mr * NZ; i++) ksum[i] = _mm512_setzero_si512();
    const uint8_t *blk0[NZ];  /* the panels' 256-blocks */
#pragma GCC unroll 4
    for (int z = 0; z < nz; z++) blk0[z] = panel_block(qtype, w, K, p0 + z, j0);
    if (HAS_MINS(qtype))
#pragma GCC unroll 4
        for (int z = 0; z < nz; z++) {
            __m512i sm[2];
            k4_unpack(blk0[z], 0, sm);
#pragma GCC unroll 8
            for (int i = 0; i < 8; i++) kscale[z][i] = k4_scale(sm, i);
        }
#pragma GCC unroll 4
    for (int z = 0; z < nz; z++) {
        if (IS_XS(qtype)) iq4_unpack(blk0[z], kscale[z]);
        if (qtype == QUANT_Q3_K) q3_unpack(blk0[z], kscale[z]);
        if (qtype == QUANT_Q2_K) q2_unpack(blk0[z], kscale[z]);
        if (qtype == QUANT_IQ1_TRIT) t1_unpack(blk0[z], kscale[z]);
    }
    const int halves = sums_per_block(qtype);
    for (int jj = 0; jj < KB / QB; jj++) {
        const int64_t j = j0 + jj;
        const uint8_t *blk[NZ];
#pragma GCC unroll 4
        for (int z = 0; z < nz; z++) blk[z] = panel_block(qtype, w, K, p0 + z, j);
        tile_prefetch(qtype, blk, nz, j, decoded ? 0 : stream, ahead);
        /* Each half its own call, so that g is a literal in codes(): which of Q6_K's code vectors is the
         * fourth is then known when compiled, Q3_K's and Q2_K's shifts are by constants (docs/BENCHMARKS.md,
         * Quantized weights: Q6_K 1.74x at one row from L3, Q3_K and Q2_K 1.1x at 16). But a Q6_K tile
         * of more than 2 rows x panels keeps the loop: unrolled, it ran 0.90-0.95x. */
        if (qtype == QUANT_Q6_K && mr * nz > 2 && !decoded) {
            for (int hf = 0; hf < halves; hf++)
                block_half(qtype, x, m0, mr, blk, nz, K, j, jj, hf, kscale, ksum, decoded, dec);
        } else {
            block_half(qtype, x, m0, mr, blk, nz, K, j, jj, 0, kscale, ksum, decoded, dec);
            if (halves == 2) block_half(qtype, x, m0, mr, blk, nz, K, j, jj, 1, kscale, ksum, decoded, dec);
        }
    }
    k_block_end(qtype, x, m0, mr, blk0, nz, j0 + KB / QB - 1, ksum, out, ldo);
}

/* The formats with one scale per 32-block: their 32-blocks j0 .. j1 into acc (a wide tile's: out's rows), in K
 * order. Codes from `dec` (decode_blocks', from 32-block j0) where `decoded` (a literal in each copy). */
INLINE void q_blocks(int qtype, const QuantRows *x, int64_t m0, int mr, const uint8_t *w, int64_t K, int64_t p0,
                     int nz, int64_t j0, int64_t j1, __m512 *acc, float *out, int64_t ldo, int stream, Ahead ahead,
                     int decoded, const uint8_t *dec) {
    const int64_t nb = K / QB;
    const int wide = mr > MR, halves = sums_per_block(qtype);
    for (int64_t j = j0; j < j1; j++) {
        const uint8_t *blk[NZ];
#pragma GCC unroll 4
        for (int z = 0; z < nz; z++) blk[z] = panel_block(qtype, w, K, p0 + z, j);
        tile_prefetch(qtype, blk, nz, j, decoded ? 0 : stream, ahead);
        const int jj = decoded ? (int)(j - j0) : 0;  /* where dec holds the block */
        __m512i sum[MR_WIDE * NZ];  /* the block's integer sum */
        block_half(qtype, x, m0, mr, blk, nz, K, j, jj, 0, NULL, sum, decoded, dec);
        if (halves == 2) block_half(qtype, x, m0, mr, blk, nz, K, j, jj, 1, NULL, sum, decoded, dec);
        __m512 a[NZ], mn[NZ];  /* mn: Q4_1's, Q5_1's mins */
#pragma GCC unroll 4
        for (int z = 0; z < nz; z++) {
            a[z] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk[z]));
            if (HAS_BLOCK_MIN(qtype)) mn[z] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk[z] + 32)));
        }
#pragma GCC unroll 8
        for (int m = 0; m < mr; m++) {
            const float dx1 = x->d[X_SCALE_AT(qtype, x, m0 + m, j)];
            const __m512 dx = _mm512_set1_ps(dx1);
            const __m512 mdx = _mm512_set1_ps(HAS_BLOCK_MIN(qtype) ? dx1 * (float)x->s[(m0 + m) * nb + j] : 0.0f);
#pragma GCC unroll 4
            for (int z = 0; z < nz; z++) {
                const __m512 s = _mm512_cvtepi32_ps(sum[m * NZ + z]);
                __m512 y = wide ? _mm512_loadu_ps(out + m * ldo + z * NR) : acc[m * NZ + z];
                y = _mm512_fmadd_ps(s, _mm512_mul_ps(a[z], dx), y);
                if (HAS_BLOCK_MIN(qtype)) y = _mm512_fmadd_ps(mn[z], mdx, y);
                if (wide) _mm512_storeu_ps(out + m * ldo + z * NR, y);
                else acc[m * NZ + z] = y;
            }
        }
    }
}

/* y[0..mr, 0..16 nz) (fp32, ldo apart) = rows m0.. of x against panels p0 .. p0 + nz; `stream` > 0:
 * prefetch the panels that many 32-blocks ahead (prefetch_ahead); else `ahead`'s bytes into L2. Up to MR
 * rows the fp32 results stay in registers; a wide tile (up to MR_WIDE rows) keeps them in y's rows (L1)
 * and its registers for the MR_WIDE NZ integer sums: the same arithmetic, in the same order. The
 * K-quants keep them in y's rows too (k_block). */
INLINE void tile(int qtype, const QuantRows *x, int64_t m0, int mr, const uint8_t *w, int64_t K, int64_t p0,
                 int nz, float *out, int64_t ldo, int stream, Ahead ahead) {
    const int wide = mr > MR, in_l1 = wide || IS_K_QUANT(qtype);  /* literals in each copy */
    __m512 acc[MR * NZ];
    for (int m = 0; m < mr; m++)
        for (int z = 0; z < nz; z++) {
            if (in_l1) _mm512_storeu_ps(out + m * ldo + z * NR, _mm512_setzero_ps());
            else acc[m * NZ + z] = _mm512_setzero_ps();
        }
    const int64_t nb = K / QB;
    if (IS_K_QUANT(qtype)) {
        for (int64_t j0 = 0; j0 < nb; j0 += KB / QB)
            k_block(qtype, x, m0, mr, w, K, p0, nz, j0, out, ldo, stream, ahead, 0, NULL);
        return;
    }
    q_blocks(qtype, x, m0, mr, w, K, p0, nz, 0, nb, acc, out, ldo, stream, ahead, 0, NULL);
    for (int m = 0; m < mr && !in_l1; m++)
        for (int z = 0; z < nz; z++) _mm512_storeu_ps(out + m * ldo + z * NR, acc[m * NZ + z]);
}

/* The code vectors of 32-blocks j0 .. j0 + count of panels p0 .. p0 + nz into dec (DECODED_AT), the panels
 * prefetched `stream` 32-blocks ahead. */
INLINE void decode_blocks(int qtype, const uint8_t *w, int64_t K, int64_t p0, int nz, int64_t j0, int count,
                          uint8_t *dec, int stream) {
    const Ahead none = {NULL, 0, 0};
    for (int jj = 0; jj < count; jj++) {
        const uint8_t *blk[NZ];
        for (int z = 0; z < nz; z++) blk[z] = panel_block(qtype, w, K, p0 + z, j0 + jj);
        tile_prefetch(qtype, blk, nz, j0 + jj, stream, none);
        for (int z = 0; z < nz; z++)
#pragma GCC unroll 8
            for (int g = 0; g < 8; g++) _mm512_store_si512(dec + DECODED_AT(z, jj, g), codes(qtype, blk[z], jj, g, 0));
    }
}
/* Each (format, mr, nz) its own unrolled copy: the tile sizes must be literals for the registers. */
#define QCASE(R, Z) case (R) * 4 + (Z): tile(qtype, x, m0, R, w, K, p0, Z, out, ldo, stream, ahead); break;
#define QCASES(R) QCASE(R, 1) QCASE(R, 2) QCASE(R, 3)
_Static_assert(MR <= 4 && MR_WIDE <= 8 && NZ <= 3,
               "the tile cases below cover mr <= 8, nz <= 3: a missing one computes nothing");
#define QTILE_FN(NAME, QT)                                                                                   \
    static void NAME(const QuantRows *x, int64_t m0, int mr, const uint8_t *w, int64_t K, int64_t p0, int nz, \
                     float *out, int64_t ldo, int stream, Ahead ahead) {                                     \
        const int qtype = QT;                                                                                \
        switch (mr * 4 + nz) {                                                                               \
            QCASES(1) QCASES(2) QCASES(3) QCASES(4) QCASES(5) QCASES(6) QCASES(7) QCASES(8) default: break;  \
        }                                                                                                    \
    }
QUANT_FORMATS(QTILE_FN)
/* Each format's tile, by qtype. */
static void (*const TILES[])(const QuantRows *, int64_t, int, const uint8_t *, int64_t, int64_t, int, float *,
                             int64_t, int, Ahead) = {QUANT_FORMATS(QTILE_ENTRY)};

/* The other formats' full micro-tile (MR rows) over the DECODED_BLOCKS 32-blocks from j0 (fewer at the end), codes
 * from dec: its fp32 results from out's rows and back. */
INLINE void q_chunk(int qtype, const QuantRows *x, int64_t m0, const uint8_t *w, int64_t K, int64_t p0, int nz,
                    int64_t j0, float *out, int64_t ldo, Ahead ahead, const uint8_t *dec) {
    const int64_t j1 = j0 + DECODED_BLOCKS < K / QB ? j0 + DECODED_BLOCKS : K / QB;
    __m512 acc[MR * NZ];
    for (int m = 0; m < MR; m++)
        for (int z = 0; z < nz; z++) acc[m * NZ + z] = _mm512_loadu_ps(out + m * ldo + z * NR);
    q_blocks(qtype, x, m0, MR, w, K, p0, nz, j0, j1, acc, out, ldo, 0, ahead, 1, dec);
    for (int m = 0; m < MR; m++)
        for (int z = 0; z < nz; z++) _mm512_storeu_ps(out + m * ldo + z * NR, acc[m * NZ + z]);
}

/* A full micro-tile (MR rows) over the DECODED_BLOCKS 32-blocks from j0 (a K-quant's 256-block), codes from
 * dec: a copy per format and nz. */
#define KCASE(Z) case Z: k_block(qtype, x, m0, MR, w, K, p0, Z, j0, out, ldo, 0, ahead, 1, dec); break;
#define QCHUNK(Z) case Z: q_chunk(qtype, x, m0, w, K, p0, Z, j0, out, ldo, ahead, dec); break;
#define DECODED_FN(NAME, QT)                                                                                 \
    static void NAME##_decoded(const QuantRows *x, int64_t m0, const uint8_t *w, int64_t K, int64_t p0, int nz, \
                               int64_t j0, float *out, int64_t ldo, Ahead ahead, const uint8_t *dec) {       \
        const int qtype = QT;                                                                                \
        if (IS_K_QUANT(qtype)) switch (nz) { KCASE(1) KCASE(2) KCASE(3) default: break; }                    \
        else if (DECODES(qtype)) switch (nz) { QCHUNK(1) QCHUNK(2) QCHUNK(3) default: break; }                \
    }
QUANT_FORMATS(DECODED_FN)
#define DECODED_ENTRY(NAME, QT) [QT] = NAME##_decoded,
static void (*const DECODED_TILES[])(const QuantRows *, int64_t, const uint8_t *, int64_t, int64_t, int, int64_t,
                                     float *, int64_t, Ahead, const uint8_t *) = {QUANT_FORMATS(DECODED_ENTRY)};

/* Each format's decode_blocks, by qtype (a copy per format: g a literal in codes()). */
#define DECODE_FN(NAME, QT)                                                                                  \
    static void NAME##_decode(const uint8_t *w, int64_t K, int64_t p0, int nz, int64_t j0, int count,       \
                              uint8_t *dec, int stream) {                                                    \
        if (DECODES(QT)) decode_blocks(QT, w, K, p0, nz, j0, count, dec, stream);                            \
    }
QUANT_FORMATS(DECODE_FN)
#define DECODE_ENTRY(NAME, QT) [QT] = NAME##_decode,
static void (*const DECODERS[])(const uint8_t *, int64_t, int64_t, int, int64_t, int, uint8_t *, int) = {
    QUANT_FORMATS(DECODE_ENTRY)};

/* Wide-tile mode: micro-tiles of MR_WIDE rows, for every format but the K-quants: Q4_K, Q5_K and IQ4_XS,
 * whose larger epilogue gains nothing from it (IQ4_XS spilled: 1.55x slower at 16 rows), and Q6_K and Q3_K,
 * whose two half sums would need twice the registers. Fewer code unpacks and x broadcasts per vpdpbusd: on
 * an AMX Xeon a batch of 16 of a 1B model ran 1.09x (Q4_0 and Q8_0, scripts/quant_modes_ab.py);
 * kernels/quant_linear.py times it against MR-row tiles at load and keeps the faster (0: off). The bits do
 * not depend on it. */
static int wide_tiles = 0;

void gemm_quant_set_wide_tiles(int on) { wide_tiles = on; }

static inline int tile_height(int qtype) {
    return wide_tiles && !IS_K_QUANT(qtype) ? MR_WIDE : MR;
}

/* The next task's panels come into L2 while this one computes from L2, a slice per micro-tile after its
 * first: then no micro-tile waits on memory alone, and a batch runs at the larger of its compute and memory
 * times instead of near their sum (weights out of cache, 1 thread, M = 16: Q4_0 1.13x, Q5_0 1.10x). Only
 * where the later micro-tiles hold a full tile's rows or more (with fewer, e.g. one row after a full tile,
 * they fetch as much as they hide: Q4_K at M = 5 0.89x). A Zen 4, 1 thread, 2048 x 8192, against 3 or more
 * later micro-tiles and no Q8_0 (docs/bench/quant_kernel_ahead_zen4.json): M = 8 Q8_0 1.48x, Q6_K 1.34x,
 * Q4_0 1.12x, Q4_K 1.07x; M = 12 1.48x / 1.24x / 1.18x / 1.04x; Q8_0 at M = 16 1.31x (9728 x 896: 1.64x),
 * M = 128 unchanged. */
static Ahead ahead_slice(const uint8_t *next, int64_t next_bytes, int64_t rows, int height, int64_t i,
                         int64_t K) {
    const Ahead none = {NULL, 0, 0};
    const int64_t num_tiles = (rows + height - 1) / height;
    if (next == NULL || rows < 2 * height || i == 0) return none;
    const int64_t slice = (next_bytes + num_tiles - 2) / (num_tiles - 1);
    if ((i - 1) * slice >= next_bytes) return none;
    const int64_t bytes = (slice / (K / QB) + 63) / 64 * 64;
    const Ahead ahead = {next + (i - 1) * slice, bytes, bytes};
    return ahead;
}

/* Full micro-tiles 0 .. num_tiles (MR rows each) from row m0 against panels p0 .. p0 + nz, decoded
 * DECODED_BLOCKS 32-blocks at a time into this thread's buffer; `next` (next_bytes), or NULL: the next task's
 * panels, brought into L2 while they compute. */
static void decoded_tiles(int qtype, const QuantRows *x, int64_t m0, int64_t num_tiles, const uint8_t *w,
                          int64_t K, int64_t p0, int nz, float *out, int64_t ldo, const uint8_t *next,
                          int64_t next_bytes, int prefetch) {
    static _Thread_local uint8_t dec[NZ * DECODED_BYTES] __attribute__((aligned(64)));
    const int64_t nb = K / QB;
    /* the next task's panels, a slice for each micro-tile at each 32-block, spread over their compute */
    const int64_t slice = next == NULL || !prefetch ? 0 : (next_bytes / (nb * num_tiles) + 63) / 64 * 64;
    for (int64_t i = 0; i < num_tiles; i++)
        for (int m = 0; m < MR; m++)
            for (int z = 0; z < nz; z++) _mm512_storeu_ps(out + (i * MR + m) * ldo + z * NR, _mm512_setzero_ps());
    for (int64_t j0 = 0; j0 < nb; j0 += DECODED_BLOCKS) {
        DECODERS[qtype](w, K, p0, nz, j0, (int)(nb - j0 < DECODED_BLOCKS ? nb - j0 : DECODED_BLOCKS), dec, prefetch);
        for (int64_t i = 0; i < num_tiles; i++) {
            const Ahead ahead = {slice ? next + i * slice : NULL, num_tiles * slice, slice};
            DECODED_TILES[qtype](x, m0 + i * MR, w, K, p0, nz, j0, out + i * MR * ldo, ldo, ahead, dec);
        }
    }
}

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && !defined(QUANT_NO_AMX)
/* AMX-INT8 (Sapphire Rapids and later) for the K-quants: a task's full 16-row groups take a 256-block's integer
 * sum, its sub-block scales included, from the tile unit in one pass. Each code is decoded times its sub-block's
 * integer scale, p = scale (c - o) (|p| <= 4096), and p split into two int8 planes, p = 128 hi + lo with lo in
 * 0..127 (amx_k_decode). Then tdpbssd multiplies x's 16 rows (A: int8, 64 K a row, rows K apart) by 64 K of a
 * plane (B: one 64-byte line per 4 K of the panel's 16 outputs) into 16 x 16 int32 sums, 4 steps a 256-block
 * and plane: sum(lo q) + 128 sum(hi q) is k_block's ksum exactly, the scaled sub-block sums added up (|ksum| <
 * 2^28), so k_block_end turns it to fp32 as on the VNNI tiles and a row's bits are the same. Why the planes: a
 * tile's sums reach the vector registers only through memory, and loads wait for a pending tile store, so a
 * store per sub-block (its scale applied after it) left the unit idle: 8 stores a 256-block against 2 here.
 * TQ2_0's p = c - 1 (no scale) is an int8 as it is: one plane, half the products and stores (ONE_PLANE). */
#define AMX_ROWS 16
#define ONE_PLANE(qtype) UNIT_SCALE(qtype)
/* Rows a task needs to take the tile unit (0: never). The K-quants: below them the planes' decode, which fewer
 * groups share, costs more than the VNNI tiles' sums. One thread, 8192 x 2048 out of cache, an AMX Xeon
 * (docs/BENCHMARKS.md, Quantized weights): at 16 rows Q6_K ran 0.88x, Q3_K 1.07x, Q2_K 1.00x; at 32 Q6_K
 * 1.07-1.10x, IQ4_XS 1.17x, Q3_K 1.33x, Q2_K 1.27x, but Q4_K 0.97-1.00x and Q5_K 0.89-0.96x (their VNNI codes
 * are one AND away); at 48 Q4_K 1.21x, Q5_K 1.03x; at 128 every K-quant 1.53-2.32x. The 32-weight formats
 * (amx_q_products), whose every 32-block's sums are stored and scaled: at 16 rows Q4_0 0.92x, Q5_0 0.87x, IQ4_NL
 * 0.91x; at 48 1.01-1.12x; at 128 Q4_0 1.26-1.33x, Q5_0 1.24-1.26x, IQ4_NL 1.02-1.22x. Never Q8_0 (its VNNI codes
 * need no decode: at 48 0.88-0.95x, at 128 0.86x and 1.13x in two runs), Q4_1 and Q5_1 (a min's FMA a block
 * more: 0.77-0.99x up to 128). TQ2_0, one plane (8192 x 2048, 2026-12-07): at 16 rows 1.34x. */
static inline int64_t amx_min_rows(int qtype) {
#ifdef AMX_MIN_ROWS_ALL  /* one threshold for every format: A/B runs of builds (quant_builds_microbench --variant) */
    return AMX_MIN_ROWS_ALL;
#endif
    if (HAS_BLOCK_MIN(qtype) || qtype == QUANT_Q8_0) return 0;
    if (ONE_PLANE(qtype)) return AMX_ROWS;
    return HAS_MINS(qtype) || !IS_K_QUANT(qtype) ? 3 * AMX_ROWS : 2 * AMX_ROWS;
}
#define AMX_PLANE_AT(z, plane, jj, g) ((((int64_t)(z) * 2 + (plane)) * DECODED_BLOCKS + (jj)) * 512 + 64 * (g))

static int quant_amx = 1; /* the tile unit where the CPU has it and Linux grants it (0: off, for A/B runs) */

int gemm_quant_set_amx(int on) {
    quant_amx = on;
    return on && amx_permitted();
}

static int amx_in_use(void) { return quant_amx && amx_permitted(); }

/* Tile 0: A (16 rows of 64 K); 1, 2: B (the lo and hi planes' 64 K); 3, 4: their sums. A constant: stores to a
 * local one before ldtilecfg were dropped by gcc (it does not see the instruction read them). */
static const TileConfig AMX_QUANT_TILES = {.palette = 1, .colsb = {64, 64, 64, 64, 64},
                                           .rows = {AMX_ROWS, AMX_ROWS, AMX_ROWS, AMX_ROWS, AMX_ROWS}};

/* A 256-block from 32-block j0 of panel p as the two planes of scale (c - o) (AMX_PLANE_AT's of z 0), the
 * panel prefetched `stream` 32-blocks ahead. */
INLINE void amx_k_decode(int qtype, const uint8_t *w, int64_t K, int64_t p, int64_t j0, uint8_t *dec, int stream) {
    const Ahead none = {NULL, 0, 0};
    const __m512i off = _mm512_set1_epi8((char)(HAS_KMIN(qtype) ? 0 : (int)code_offset(qtype)));
    const __m512i low7 = _mm512_set1_epi16(127), byte = _mm512_set1_epi16(0xff);
    const int halves = sums_per_block(qtype);
    const uint8_t *blk = panel_block(qtype, w, K, p, j0);
    __m512i kscale[16];
    if (HAS_MINS(qtype)) {
        __m512i sm[2];
        k4_unpack(blk, 0, sm);
        for (int i = 0; i < 8; i++) kscale[i] = k4_scale(sm, i);
    }
    if (IS_XS(qtype)) iq4_unpack(blk, kscale);
    if (qtype == QUANT_Q3_K) q3_unpack(blk, kscale);
    if (qtype == QUANT_Q2_K) q2_unpack(blk, kscale);
    if (qtype == QUANT_IQ1_TRIT) t1_unpack(blk, kscale);
    for (int jj = 0; jj < DECODED_BLOCKS; jj++) {
        tile_prefetch(qtype, &blk, 1, j0 + jj, stream, none);
#pragma GCC unroll 8
        for (int g = 0; g < 8; g++) {
            const int hf = g * halves / 8;
            const __m512i c = _mm512_sub_epi8(codes(qtype, blk, jj, g, 0), off);
            if (ONE_PLANE(qtype)) {
                _mm512_store_si512(dec + AMX_PLANE_AT(0, 0, jj, g), c);
                continue;
            }
            const __m512i sc = HAS_KSCALE(qtype) ? kscale[IS_LOW2(qtype) ? 2 * jj + hf : jj]
                               : _mm512_cvtepi8_epi32(
                                     _mm_loadu_si128((const __m128i *)q6_scales(blk, j0 + jj, hf)));
            const __m512i sc16 = _mm512_or_si512(_mm512_and_si512(sc, _mm512_set1_epi32(0xffff)),
                                                 _mm512_slli_epi32(sc, 16));
            const __m512i even = _mm512_mullo_epi16(_mm512_srai_epi16(_mm512_slli_epi16(c, 8), 8), sc16);
            const __m512i odd = _mm512_mullo_epi16(_mm512_srai_epi16(c, 8), sc16);
            const __m512i lo = _mm512_or_si512(_mm512_and_si512(even, low7),
                                               _mm512_slli_epi16(_mm512_and_si512(odd, low7), 8));
            const __m512i hi = _mm512_or_si512(_mm512_and_si512(_mm512_srai_epi16(even, 7), byte),
                                               _mm512_slli_epi16(_mm512_srai_epi16(odd, 7), 8));
            _mm512_store_si512(dec + AMX_PLANE_AT(0, 0, jj, g), lo);
            _mm512_store_si512(dec + AMX_PLANE_AT(0, 1, jj, g), hi);
        }
    }
}

/* The products of a 256-block (from 32-block j0) for rows m0 .. m0 + 16 with a panel's planes (dec) into tiles 3
 * and 4 (ONE_PLANE: 3), 64 K a step. */
INLINE void amx_k_products(int qtype, const QuantRows *x, int64_t m0, int64_t K, int64_t j0, const uint8_t *dec) {
    _tile_zero(3);
    if (!ONE_PLANE(qtype)) _tile_zero(4);
    for (int t = 0; t < DECODED_BLOCKS / 2; t++) {  /* 32-blocks 2 t, 2 t + 1 */
        _tile_loadd(0, x->q + m0 * K + j0 * QB + 2 * QB * t, K);
        _tile_loadd(1, dec + AMX_PLANE_AT(0, 0, 2 * t, 0), 64);
        _tile_dpbssd(3, 0, 1);
        if (ONE_PLANE(qtype)) continue;
        _tile_loadd(2, dec + AMX_PLANE_AT(0, 1, 2 * t, 0), 64);
        _tile_dpbssd(4, 0, 2);
    }
}

INLINE void amx_k_store(int qtype, int32_t sums[2][AMX_ROWS][NR]) {
    _tile_stored(3, sums[0], 64);
    if (!ONE_PLANE(qtype)) _tile_stored(4, sums[1], 64);
}

/* The stored planes' sums of the 256-block from 32-block j0 of panel p, rows m0 .. m0 + 16, into out's rows:
 * lo + 128 hi (ONE_PLANE: the one) is k_block's ksum, then its k_block_end. */
INLINE void amx_k_epilogue(int qtype, const QuantRows *x, int64_t m0, const uint8_t *w, int64_t K, int64_t p,
                           int64_t j0, float *out, int64_t ldo, int32_t sums[2][AMX_ROWS][NR]) {
    __m512i ksum[AMX_ROWS * NZ];  /* k_block_end's order: this panel's at m NZ */
    for (int m = 0; m < AMX_ROWS; m++)
        ksum[m * NZ] = ONE_PLANE(qtype) ? _mm512_load_si512(sums[0][m])
                                        : _mm512_add_epi32(_mm512_load_si512(sums[0][m]),
                                                           _mm512_slli_epi32(_mm512_load_si512(sums[1][m]), 7));
    const uint8_t *blk0 = panel_block(qtype, w, K, p, j0);
    k_block_end(qtype, x, m0, AMX_ROWS, &blk0, 1, j0 + KB / QB - 1, ksum, out, ldo);
}

/* The formats with one fp16 scale per 32-block (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL) on AMX-INT8: their scale
 * cannot go into the codes, so each 32-block's 16 x 16 sums leave the tile unit on their own. tdpbssd multiplies
 * x's 16 rows (A: 32 K a row) by a 32-block of a panel decoded as signed codes c - o (B: 8 lines of 4 K of the
 * 16 outputs): sum((c - o) q) is block_half's integer sum exactly, so q_blocks' epilogue, run on the stored sums
 * in K order, gives a row the VNNI tiles' bits. An item is AMX_Q_BLOCKS 32-blocks of a (panel, group), its sums
 * in tiles 4..7 and stored together; its products are issued before the last item's epilogue (amx_tiles_of),
 * though here the two barely overlap (timed apart, their times add up), which is what caps the gain (1.2-1.3x). */
#define AMX_Q_BLOCKS 4

/* Tiles 0, 1: A (16 rows of 32 K); 2, 3: B (a 32-block's 8 lines); 4..7: an item's sums, a 32-block each. */
static const TileConfig AMX_Q_TILES = {.palette = 1, .colsb = {32, 32, 64, 64, 64, 64, 64, 64},
                                       .rows = {AMX_ROWS, AMX_ROWS, 8, 8, AMX_ROWS, AMX_ROWS, AMX_ROWS, AMX_ROWS}};

/* `count` 32-blocks from j0 of panel p as signed codes c - o (DECODED_AT's of z 0), prefetched `stream` ahead. */
INLINE void amx_q_decode(int qtype, const uint8_t *w, int64_t K, int64_t p, int64_t j0, int count, uint8_t *dec,
                         int stream) {
    const Ahead none = {NULL, 0, 0};
    const __m512i off = _mm512_set1_epi8((char)(int)code_offset(qtype));
    for (int jj = 0; jj < count; jj++) {
        const uint8_t *blk = panel_block(qtype, w, K, p, j0 + jj);
        tile_prefetch(qtype, &blk, 1, j0 + jj, stream, none);
#pragma GCC unroll 8
        for (int g = 0; g < 8; g++)
            _mm512_store_si512(dec + DECODED_AT(0, jj, g), _mm512_sub_epi8(codes(qtype, blk, jj, g, 0), off));
    }
}

/* 32-block j + b's product into sum tile c, A and B in tiles a and 2 + a (a = b % 2: a step's loads need not wait
 * for the last step's product; literals, as gcc's tile intrinsics paste them into the instruction). */
#define AMX_Q_STEP(b, a, a2, c)                                                                                \
    if ((b) < count) {                                                                                         \
        _tile_loadd(a, x->qt + AMX_TILE_AT(x, m0, j + (b)), QB);                                               \
        _tile_loadd(a2, dec + DECODED_AT(0, (b), 0), 64);                                                      \
        _tile_zero(c);                                                                                         \
        _tile_dpbssd(c, a, a2);                                                                                \
    }

/* The products of `count` (<= AMX_Q_BLOCKS) 32-blocks from j for rows m0 .. m0 + 16, codes from dec (the first's). */
INLINE void amx_q_products(const QuantRows *x, int64_t m0, int64_t K, int64_t j, int count, const uint8_t *dec) {
    AMX_Q_STEP(0, 0, 2, 4)
    AMX_Q_STEP(1, 1, 3, 5)
    AMX_Q_STEP(2, 0, 2, 6)
    AMX_Q_STEP(3, 1, 3, 7)
}

INLINE void amx_q_store(int count, int32_t sums[AMX_Q_BLOCKS][AMX_ROWS][NR]) {
    _tile_stored(4, sums[0], 64);
    if (count > 1) _tile_stored(5, sums[1], 64);
    if (count > 2) _tile_stored(6, sums[2], 64);
    if (count > 3) _tile_stored(7, sums[3], 64);
}

/* The stored sums of `count` 32-blocks from j of panel p, rows m0 .. m0 + 16, into out's rows: q_blocks'
 * arithmetic, block by block. The 16 rows' results stay in registers through the blocks, so that the rows'
 * chains of FMAs interleave (a row at a time, through all its blocks, each chain was waited on alone). */
INLINE void amx_q_epilogue(int qtype, const QuantRows *x, int64_t m0, const uint8_t *w, int64_t K, int64_t p,
                           int64_t j, int count, float *out, int64_t ldo, int32_t sums[AMX_Q_BLOCKS][AMX_ROWS][NR]) {
    const int64_t nb = K / QB;
    const float *dx = x->d + X_SCALE_AT(qtype, x, m0, j);  /* row m's at m nb (a scale per 32-block) */
    const int16_t *xs = x->s + m0 * nb + j;
    __m512 y[AMX_ROWS];
#pragma GCC unroll 16
    for (int m = 0; m < AMX_ROWS; m++) y[m] = _mm512_loadu_ps(out + m * ldo);
#pragma GCC unroll 4
    for (int b = 0; b < count; b++) {
        const uint8_t *blk = panel_block(qtype, w, K, p, j + b);
        const __m512 a = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
        const __m512 mn = HAS_BLOCK_MIN(qtype) ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 32)))
                                               : _mm512_setzero_ps();  /* Q4_1's, Q5_1's mins */
#pragma GCC unroll 16
        for (int m = 0; m < AMX_ROWS; m++) {
            const float dx1 = dx[m * nb + b];
            y[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(sums[b][m])),
                                   _mm512_mul_ps(a, _mm512_set1_ps(dx1)), y[m]);
            if (HAS_BLOCK_MIN(qtype)) y[m] = _mm512_fmadd_ps(mn, _mm512_set1_ps(dx1 * (float)xs[m * nb + b]), y[m]);
        }
    }
#pragma GCC unroll 16
    for (int m = 0; m < AMX_ROWS; m++) _mm512_storeu_ps(out + m * ldo, y[m]);
}

/* An item of amx_tiles_of: `count` 32-blocks from j of a panel z and a group g, their sums (a K-quant's 256-block:
 * its two planes' in the first two). */
typedef struct {
    _Alignas(64) int32_t sums[AMX_Q_BLOCKS][AMX_ROWS][NR];
    int64_t j, g;
    int z, count;
} AmxItem;

/* Where panel z's codes start in the decode buffer: a K-quant's two planes (amx_k_decode), else signed codes. */
#define AMX_DEC_AT(qtype, z) (IS_K_QUANT(qtype) ? AMX_PLANE_AT(z, 0, 0, 0) : DECODED_AT(z, 0, 0))

INLINE void amx_decode(int qtype, const uint8_t *w, int64_t K, int64_t p, int64_t j0, int count, uint8_t *dec,
                       int stream) {
    if (IS_K_QUANT(qtype)) amx_k_decode(qtype, w, K, p, j0, dec, stream);  /* count: always a 256-block's */
    else amx_q_decode(qtype, w, K, p, j0, count, dec, stream);
}

/* An item's products; dec: its panel's codes (AMX_DEC_AT), its first 32-block's. */
INLINE void amx_products(int qtype, const QuantRows *x, int64_t m0, int64_t K, const AmxItem *it, const uint8_t *dec) {
    if (IS_K_QUANT(qtype)) amx_k_products(qtype, x, m0 + it->g * AMX_ROWS, K, it->j, dec);
    else amx_q_products(x, m0 + it->g * AMX_ROWS, K, it->j, it->count, dec);
}

INLINE void amx_store(int qtype, AmxItem *it) {
    if (IS_K_QUANT(qtype)) amx_k_store(qtype, it->sums);
    else amx_q_store(it->count, it->sums);
}

/* A stored item into out's rows. */
INLINE void amx_finish(int qtype, const QuantRows *x, int64_t m0, const uint8_t *w, int64_t K, int64_t p0,
                       float *out, int64_t ldo, AmxItem *it) {
    float *o = out + it->g * AMX_ROWS * ldo + it->z * NR;
    if (IS_K_QUANT(qtype)) amx_k_epilogue(qtype, x, m0 + it->g * AMX_ROWS, w, K, p0 + it->z, it->j, o, ldo, it->sums);
    else amx_q_epilogue(qtype, x, m0 + it->g * AMX_ROWS, w, K, p0 + it->z, it->j, it->count, o, ldo, it->sums);
}

/* Groups of 16 rows from row m0 against panels p0 .. p0 + nz, DECODED_BLOCKS 32-blocks (a K-quant's 256-block) at
 * a time, each panel's decoded once for all groups; `next` (next_bytes), or NULL: the next task's panels, brought
 * into L2 a slice per 256-block. Items (a K-quant's 256-block, else AMX_Q_BLOCKS 32-blocks, of a panel and group)
 * in each row's K order, software-pipelined around the tile store that the epilogue's loads wait for: an item's
 * products are issued, then (at its panel's last item) the next panel's decode and the last item's epilogue run on
 * the vector units meanwhile, and only then is this item's sum stored. */
INLINE void amx_tiles_of(int qtype, const QuantRows *x, int64_t m0, int64_t groups, const uint8_t *w, int64_t K,
                         int64_t p0, int nz, float *out, int64_t ldo, const uint8_t *next, int64_t next_bytes,
                         int prefetch) {
    static _Thread_local uint8_t dec[NZ * 2 * DECODED_BYTES] __attribute__((aligned(64)));
    const int64_t nb = K / QB, chunks = (nb + DECODED_BLOCKS - 1) / DECODED_BLOCKS;
    const int step = IS_K_QUANT(qtype) ? DECODED_BLOCKS : AMX_Q_BLOCKS;  /* 32-blocks an item */
    const int64_t slice = next == NULL || !prefetch ? 0 : (next_bytes / chunks + 63) / 64 * 64;
    for (int64_t m = 0; m < groups * AMX_ROWS; m++)
        for (int z = 0; z < nz; z++) _mm512_storeu_ps(out + m * ldo + z * NR, _mm512_setzero_ps());
    _tile_loadconfig(IS_K_QUANT(qtype) ? &AMX_QUANT_TILES : &AMX_Q_TILES);
    amx_decode(qtype, w, K, p0, 0, (int)(nb < DECODED_BLOCKS ? nb : DECODED_BLOCKS), dec, prefetch);
    AmxItem items[2];  /* the last item and this one, by n % 2 */
    int64_t n = 0;
    for (int64_t j0 = 0; j0 < nb; j0 += DECODED_BLOCKS) {
        for (int64_t b = 0; b < slice; b += 64)
            _mm_prefetch((const char *)next + j0 / DECODED_BLOCKS * slice + b, _MM_HINT_T2);
        const int in_chunk = (int)(nb - j0 < DECODED_BLOCKS ? nb - j0 : DECODED_BLOCKS);
        const int64_t j1 = j0 + DECODED_BLOCKS;
        for (int z = 0; z < nz; z++)
            for (int64_t g = 0; g < groups; g++)
                for (int jj = 0; jj < in_chunk; jj += step) {
                    AmxItem *it = &items[n % 2];
                    it->j = j0 + jj, it->z = z, it->g = g, it->count = in_chunk - jj < step ? in_chunk - jj : step;
                    amx_products(qtype, x, m0, K, it, dec + AMX_DEC_AT(qtype, z) + jj * 512);
                    const int last = g == groups - 1 && jj + it->count == in_chunk;
                    if (last && z + 1 < nz)  /* (the tiles loaded before these stores: x86 keeps that order) */
                        amx_decode(qtype, w, K, p0 + z + 1, j0, in_chunk, dec + AMX_DEC_AT(qtype, z + 1), prefetch);
                    else if (last && j1 < nb)
                        amx_decode(qtype, w, K, p0, j1, (int)(nb - j1 < DECODED_BLOCKS ? nb - j1 : DECODED_BLOCKS),
                                   dec, prefetch);
                    if (n > 0) amx_finish(qtype, x, m0, w, K, p0, out, ldo, &items[(n - 1) % 2]);
                    amx_store(qtype, it);
                    n++;
                }
    }
    amx_finish(qtype, x, m0, w, K, p0, out, ldo, &items[(n - 1) % 2]);
    _tile_release();
}

/* Each format's amx_tiles_of (a copy per format: qtype a literal in the decode and the epilogue). */
#define AMX_FN(NAME, QT)                                                                                     \
    static void NAME##_amx(const QuantRows *x, int64_t m0, int64_t groups, const uint8_t *w, int64_t K,      \
                           int64_t p0, int nz, float *out, int64_t ldo, const uint8_t *next, int64_t next_bytes, \
                           int prefetch) {                                                                   \
        amx_tiles_of(QT, x, m0, groups, w, K, p0, nz, out, ldo, next, next_bytes, prefetch);                 \
    }
QUANT_FORMATS(AMX_FN)
#define AMX_ENTRY(NAME, QT) [QT] = NAME##_amx,
static void (*const AMX_TILES[])(const QuantRows *, int64_t, int64_t, const uint8_t *, int64_t, int64_t, int, float *,
                                 int64_t, const uint8_t *, int64_t, int) = {QUANT_FORMATS(AMX_ENTRY)};

static void amx_tiles(int qtype, const QuantRows *x, int64_t m0, int64_t groups, const uint8_t *w, int64_t K,
                      int64_t p0, int nz, float *out, int64_t ldo, const uint8_t *next, int64_t next_bytes,
                      int prefetch) {
    AMX_TILES[qtype](x, m0, groups, w, K, p0, nz, out, ldo, next, next_bytes, prefetch);
}
#else
int gemm_quant_set_amx(int on) { (void)on; return 0; }
static int amx_in_use(void) { return 0; }
#define AMX_ROWS 16
static inline int64_t amx_min_rows(int qtype) { (void)qtype; return 0; }
static void amx_tiles(int qtype, const QuantRows *x, int64_t m0, int64_t groups, const uint8_t *w, int64_t K,
                      int64_t p0, int nz, float *out, int64_t ldo, const uint8_t *next, int64_t next_bytes,
                      int prefetch) {
    (void)qtype, (void)x, (void)m0, (void)groups, (void)w, (void)K, (void)p0, (void)nz, (void)out, (void)ldo;
    (void)next, (void)next_bytes, (void)prefetch;
}
#endif

/* Rows m0 .. m0 + rows against panels p0 .. p0 + nz; `next`: the next task's panels (next_bytes), or NULL. */
static void tile_rows(int qtype, const QuantRows *x, int64_t m0, int64_t rows, const uint8_t *w, int64_t K,
                      int64_t p0, int nz, float *out, int64_t ldo, const uint8_t *next, int64_t next_bytes,
                      int prefetch) {
    if (amx_min_rows(qtype) > 0 && rows >= amx_min_rows(qtype) && amx_in_use()) {  /* 16-row groups on AMX, then rest */
        const int64_t done = rows / AMX_ROWS * AMX_ROWS;
        amx_tiles(qtype, x, m0, rows / AMX_ROWS, w, K, p0, nz, out, ldo, next, next_bytes, prefetch);
        m0 += done, rows -= done, out += done * ldo, next = NULL;
        if (rows == 0) return;
    }
    const int height = tile_height(qtype);
    int64_t num_tiles = (rows + height - 1) / height, i = 0;
    if (DECODES(qtype) && height == MR && rows / MR >= DECODE_MIN_TILES) {  /* full micro-tiles decoded, then rest */
        i = rows / MR;
        decoded_tiles(qtype, x, m0, i, w, K, p0, nz, out, ldo, next, next_bytes, prefetch);
    }
    for (; i < num_tiles; i++) {
        const int64_t m = i * height;
        const int mr = (int)(rows - m < height ? rows - m : height);
        const int stream = i == 0 ? prefetch : 0;  /* the task's first micro-tile reads its panels from memory */
        const Ahead ahead = prefetch ? ahead_slice(next, next_bytes, rows, height, i, K) : (Ahead){NULL, 0, 0};
        float *o = out + m * ldo;
        TILES[qtype](x, m0 + m, mr, w, K, p0, nz, o, ldo, stream, ahead);
    }
}
#endif

/* ----------------------------------------------------------------------------------- entry points */

#if !QUANT_VNNI
void gemm_quant_set_wide_tiles(int on) { (void)on; }  /* the VNNI path's modes; the others have one tile */
int gemm_quant_set_amx(int on) { (void)on; return 0; }
static int amx_in_use(void) { return 0; }
#define AMX_ROWS 16
static inline int64_t amx_min_rows(int qtype) { (void)qtype; return 0; }
/* and prefetch nothing in single-stream mode */
void gemm_quant_set_single_prefetch_for(int qtype, int level) { (void)qtype, (void)level; }

/* The AVX2 path prefetches PREFETCH_J2 ahead outside single-stream mode (prefetch != 0), plain C never. */
static int prefetch_blocks(int qtype, int single) { (void)qtype; return !single; }
#endif

int gemm_quant_path(void) { return QUANT_PATH; }

int gemm_quant_byte_lookups(void) {
#if QUANT_VNNI && defined(__AVX512VBMI__)
    return 1;
#else
    return 0;
#endif
}

/* Single-stream mode: calls of at most this many rows take one panel per task, so each thread reads one
 * sequential stream (the VNNI path prefetching it SINGLE_PREFETCH_BYTES ahead or not, the others not at
 * all), which some CPUs follow faster than NZ streams kept in flight by hand (a Zen 4 at M = 1: 1.2-1.45x)
 * and others slower; kernels/quant_linear.py times the choices on the model's own weights at load and
 * sets the fastest (0: off). The result's bits do not depend on it. */
static int single_stream_rows[QUANT_NUM_TYPES];

void gemm_quant_set_single_stream_for(int qtype, int max_rows) {
    if (qtype >= 0 && qtype < QUANT_NUM_TYPES) single_stream_rows[qtype] = max_rows;
}

/* Every format at once: the modes as they were chosen before they were chosen per format (per format:
 * kernels/quant_linear.py times each format present on its own weights, since Q8_0's stream and the
 * K-quants' can prefer different prefetching on one CPU). */
void gemm_quant_set_single_stream(int max_rows) {
    for (int q = 0; q < QUANT_NUM_TYPES; q++) gemm_quant_set_single_stream_for(q, max_rows);
}

void gemm_quant_set_single_prefetch(int level) {
    for (int q = 0; q < QUANT_NUM_TYPES; q++) gemm_quant_set_single_prefetch_for(q, level);
}

static int check_shape(int qtype, int64_t N, int64_t K) {
    return qtype >= 0 && qtype < QUANT_NUM_TYPES && N > 0 && N % NR == 0 && K > 0 && K % BLOCK_K[qtype] == 0;
}

/* A task's rows of y (rows ldy apart, from column col0, width wide) in y's dtype, from tmp's fp32 (bf16 y)
 * or in place (fp32 y: tmp is y), bias added. */
static void finish_rows(const float *tmp, int64_t rows, int64_t width, const void *bias, void *y, int64_t ldy,
                        int64_t col0, int is_bf16) {
    for (int64_t m = 0; m < rows; m++) {
        float *row = is_bf16 ? (float *)tmp + m * width : (float *)y + m * ldy + col0;
        if (bias != NULL)
            for (int64_t c = 0; c < width; c++)
                row[c] += is_bf16 ? bf16_to_f32(((const uint16_t *)bias)[col0 + c]) : ((const float *)bias)[col0 + c];
        if (is_bf16)
            for (int64_t c = 0; c < width; c++) ((uint16_t *)y)[m * ldy + col0 + c] = f32_to_bf16(row[c]);
    }
}

/* One gemm_quant call: its arguments, x's quantized rows and its tasks, (group of panels, chunk of rows). */
typedef struct {
    const void *x, *bias;
    const uint8_t *wq;
    void *y;
    int qtype, is_bf16, single, gz;
    int64_t M, N, K, ldy, panels, groups, chunks, tasks;
    QuantRows r;
} QuantCall;

/* A thread's share of a call: its rows of x quantized, then its tasks (static order), each with the next
 * task's first panels prefetched. Orphaned worksharing: a team runs it, or one thread alone (RUN_TEAM). */
static void quant_call_run(QuantCall *c) {
    const int qtype = c->qtype, is_bf16 = c->is_bf16, gz = c->gz;
    const int64_t M = c->M, K = c->K, ldy = c->ldy, panels = c->panels, groups = c->groups, chunks = c->chunks;
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; m++) {
        quantize_row(c->x, is_bf16, m, &c->r);
        tile_row(&c->r, m, M);
    }
    float tmp[MC * NZ * NR];
#pragma omp for schedule(static)
    for (int64_t task = 0; task < c->tasks; task++) {
        const int64_t g = task / chunks, m0 = task % chunks * MC, rows = M - m0 < MC ? M - m0 : MC;
        const int nz = (int)(panels - g * gz < gz ? panels - g * gz : gz);
        void *y0 = (char *)c->y + (is_bf16 ? 2 : 4) * (size_t)(m0 * ldy);
        /* this thread's next task (static order): the next group, once this is the last chunk */
        const int64_t nz_next = g + 1 < groups ? (panels - (g + 1) * gz < gz ? panels - (g + 1) * gz : gz) : 0;
        const int is_last_chunk = m0 + MC >= M;
        const uint8_t *next = is_last_chunk && nz_next ? panel_block(qtype, c->wq, K, (g + 1) * gz, 0) : NULL;
        float *out = is_bf16 ? tmp : (float *)y0 + g * gz * NR;
        tile_rows(qtype, &c->r, m0, rows, c->wq, K, g * gz, nz, out, is_bf16 ? nz * NR : ldy, next,
                  nz_next * (K / BLOCK_K[qtype]) * PANEL_BYTES[qtype], prefetch_blocks(qtype, c->single));
        if (is_bf16 || c->bias != NULL) finish_rows(tmp, rows, nz * NR, c->bias, y0, ldy, g * gz * NR, is_bf16);
    }
}

/* x [M, K] (fp32, or bf16 with is_bf16), the packed weight (layout above), bias [N] (x's dtype) or NULL ->
 * y [M, N] in x's dtype (row m at y + m ldy: _strided). Returns 0, -1 out of memory, -2 bad shape. */
int gemm_quant(const void *x, const void *wq, int qtype, const void *bias, void *y, int64_t M, int64_t N,
               int64_t K, int is_bf16, int num_threads) {
    return gemm_quant_strided(x, wq, qtype, bias, y, N, M, N, K, is_bf16, num_threads);
}

int gemm_quant_strided(const void *x, const void *wq, int qtype, const void *bias, void *y, int64_t ldy, int64_t M,
                       int64_t N, int64_t K, int is_bf16, int num_threads) {
    if (!check_shape(qtype, N, K) || M <= 0 || ldy < N) return -2;
    const int64_t span = IS_K_QUANT(qtype) ? KB : QB;  /* x's scale per span values (QuantRows) */
    QuantRows r = {malloc((size_t)(M * K)), malloc(sizeof(float) * (size_t)(M * K / span)),
                   malloc(sizeof(int16_t) * (size_t)(M * K / QB)), malloc(sizeof(int16_t) * (size_t)(M * K / 16)), K,
                   span, NULL};
    const int amx_q = !IS_K_QUANT(qtype) && amx_min_rows(qtype) > 0 && M >= amx_min_rows(qtype) && amx_in_use();
    if (amx_q) r.qt = malloc((size_t)(M * K));
    if (r.q == NULL || r.d == NULL || r.s == NULL || r.s16 == NULL || (amx_q && r.qt == NULL)) {
        free(r.q), free(r.d), free(r.s), free(r.s16), free(r.qt);
        return -1;
    }
    /* a group: the panels of one task (one in single-stream mode) */
    const int single = M <= single_stream_rows[qtype], gz = single ? 1 : NZ;
    const int64_t panels = N / NR, groups = (panels + gz - 1) / gz, chunks = (M + MC - 1) / MC;
    QuantCall call = {x, bias, wq, y, qtype, is_bf16, single, gz, M, N, K, ldy, panels, groups, chunks,
                      groups * chunks, r};
    RUN_TEAM(team_size(num_threads, call.tasks), quant_call_run(&call));
    free(r.q), free(r.d), free(r.s), free(r.s16), free(r.qt);
    return 0;
}

/* One run of bytes of each row's GGUF block that the packed layout interleaves by lane, unit bytes at a
 * time: src[from + u unit ..] of lane l goes to dst[to + (16 u + l) unit ..]. */
typedef struct { int from, to, bytes, unit; } Piece;

static const Piece PIECES[QUANT_NUM_TYPES][5] = {
    {{0, 0, 2, 2}, {2, 32, 32, 4}},                                    /* Q8_0: d | codes */
    {{0, 0, 2, 2}, {2, 32, 16, 4}},                                    /* Q4_0: d | qs */
    {{0, 0, 2, 2}, {2, 32, 2, 2}, {4, 64, 12, 4}, {16, 256, 128, 4}},  /* Q4_K: d | dmin | scales | qs */
    {{0, 0, 2, 2}, {6, 96, 16, 4}},                                    /* Q5_0: d | qs (hb: below) */
    {{208, 0, 2, 2}, {192, 32, 16, 1}},                                /* Q6_K: d | scales (codes: below) */
    {{0, 0, 2, 2}, {2, 32, 2, 2}, {4, 64, 12, 4}},                     /* Q5_K: Q4_K's header (hb, qs: below) */
    {{0, 0, 2, 2}, {2, 32, 2, 2}, {4, 64, 16, 4}},                     /* Q4_1: d | m | qs */
    {{0, 0, 2, 2}, {2, 32, 2, 2}, {8, 128, 16, 4}},                    /* Q5_1: d | m | qs (hb: below) */
    {{0, 0, 2, 2}, {2, 32, 2, 2}, {4, 64, 4, 4}},                      /* IQ4_XS: d | scales (qs: below) */
    {{0, 0, 2, 2}, {2, 32, 16, 4}, {18, 288, 2, 2}, {20, 320, 16, 4}}, /* IQ4_NL: d | qs, twice */
    {{108, 0, 2, 2}, {96, 32, 12, 4}},                                 /* Q3_K: d | scales (codes: below) */
    {{80, 0, 2, 2}, {82, 32, 2, 2}, {0, 64, 16, 4}},                   /* Q2_K: d | dmin | scales (codes: below) */
    {{0, 0, 2, 2}, {2, 32, 2, 2}, {4, 64, 4, 4}, {136, TAB_AT, 4, 4}}, /* IQ4_TAB: IQ4_XS's | table share */
    {{0, 0, 2, 2}, {2, 32, 16, 1}, {146, TAB16_AT, 4, 4}},             /* IQ4_TAB16: d | scales | table share */
    {{0, 0, 2, 2}, {2, 32, 2, 2}, {4, 64, 4, 4}},                      /* IQ2_GRID: IQ4_XS's (idx, neg: below) */
    {{0, 0, 2, 2}, {2, 32, 4, 4}},                                     /* IQ1_TRIT: d | scales (codes: below) */
    {{0, 0, 2, 2}, {2, 32, 16, 1}, {114, T3_TAB, 4, 4}},               /* IQ3_TAB16: d | scales | table share */
    {{64, 0, 2, 2}},                                                   /* TQ2_0: d (codes: below) */
};

/* Q3_K's, Q2_K's, IQ1_TRIT's and TQ2_0's 256 codes of row lane (GGUF: Q3_K hmask[32] | qs[64] | scales[12] | d,
 * Q2_K scales[16] | qs[64] | d | dmin, IQ1_TRIT d | scales[4] | qs[64], TQ2_0 qs[64] | d; K 128 n + 32 i + l
 * (l < 32) has its low 2 bits at bit 2 i of qs[32 n + l], Q3_K its third at bit 4 n + i of hmask[l]) -> the
 * packed vectors (into a zeroed dst). */
static void pack_low2_codes(int qtype, const uint8_t *src, int lane, uint8_t *dst) {
    const uint8_t *qs = src + (qtype == QUANT_Q3_K ? 32 : qtype == QUANT_Q2_K ? 16 : qtype == QUANT_IQ3_TAB16 ? 50
                               : qtype == QUANT_TQ2_0 ? 0 : 6);
    const uint8_t *hmask = src + (qtype == QUANT_Q3_K ? 0 : 18);  /* IQ3_TAB16: d | scales[16] | hmask | qs | share */
    for (int k = 0; k < 256; k++) {
        const int n = k / 128, i = k % 128 / 32, l = k % 32;
        const int low = (qs[32 * n + l] >> (2 * i)) & 3, g = k % 32 / 4, t = k % 4;
        uint8_t *v = dst + LOW2_AT(qtype, k / 32);
        v[64 * (g / 4) + 4 * lane + t] |= (uint8_t)(low << (2 * (g % 4)));
        if (IS_CODE3(qtype)) v[128 + 4 * lane + t] |= (uint8_t)(((hmask[l] >> (4 * n + i)) & 1) << g);
    }
}

/* IQ4_XS's qs (GGUF: 16 bytes per 32-block; IQ4_TAB16's likewise) of row lane -> each 32-block's codes as
 * Q4_0's, from dst on. */
static void pack_iq4_xs_codes(const uint8_t *src, int lane, uint8_t *dst) {
    for (int c = 0; c < 8; c++)
        for (int u = 0; u < 4; u++) memcpy(dst + 256 * c + 4 * (NR * u + lane), src + 16 * c + 4 * u, 4);
}

/* IQ2_GRID's 32-blocks of row lane (its row block: d | IQ4_XS's scales | per 32-block c at 8 + 8 c: 4 grid
 * indices | 4 sign bytes, bit k of byte i: K 8 i + k negative; models/iq2_grid.py) -> idx and the sign masks
 * (into a zeroed dst). */
static void pack_iq2_grid(const uint8_t *src, int lane, uint8_t *dst) {
    for (int c = 0; c < 8; c++) {
        uint8_t *v = dst + IQ2_CODES + 128 * c;
        memcpy(v + 4 * lane, src + 8 + 8 * c, 4);
        for (int g = 0; g < 8; g++) {
            const int nibble = (src[12 + 8 * c + g / 2] >> (4 * (g % 2))) & 0xf;
            v[64 + 8 * g + lane / 2] |= (uint8_t)(nibble << (4 * (lane % 2)));
        }
    }
}

/* Q5_0's or Q5_1's qh (bit k: the fifth bit of K k) of row lane -> hb byte t: bit g = the fifth bit of K
 * 4 g + t. */
static void pack_high_bits(const uint8_t *qh_bytes, int lane, uint8_t *hb) {
    uint32_t qh;
    memcpy(&qh, qh_bytes, 4);
    for (int t = 0; t < 4; t++) {
        uint8_t byte = 0;
        for (int g = 0; g < 8; g++) byte |= (uint8_t)(((qh >> (4 * g + t)) & 1u) << g);
        hb[4 * lane + t] = byte;
    }
}

/* Q5_K's qh and qs of row lane (GGUF: d | dmin | scales[12] | qh[32] | qs[128]; K 32 s + i has its fifth bit
 * at bit s of qh[i], its low 4 in qs as Q4_K's) -> each pair of 32-blocks' hb and qs (into a zeroed dst). */
static void pack_q5_k(const uint8_t *src, int lane, uint8_t *dst) {
    for (int c = 0; c < 4; c++)
        for (int g = 0; g < 8; g++)
            memcpy(dst + K_CODES(QUANT_Q5_K, 2 * c) + 64 * g + 4 * lane, src + 48 + 32 * c + 4 * g, 4);
    for (int k = 0; k < 256; k++) {
        const int s = k / 32, g = k % 32 / 4, t = k % 4;
        dst[K5_HB(s) + 4 * lane + t] |= (uint8_t)(((src[16 + k % 32] >> s) & 1) << g);
    }
}

/* Q6_K's 256 codes of row lane (GGUF: ql[128] | qh[64] | scales[16] | d; in each half n of 128 weights,
 * K 32 q + l (quarter q, l < 32) has the low 4 bits in nibble q / 2 of ql[64 n + 32 (q % 2) + l] and the
 * top 2 at bit 2 q of qh[32 n + l]) -> the packed vectors (into a zeroed dst). */
static void pack_q6_k_codes(const uint8_t *src, int lane, uint8_t *dst) {
    for (int k = 0; k < 256; k++) {
        const int n = k / 128, q = k % 128 / 32, l = k % 32;
        const int code = ((src[64 * n + 32 * (q % 2) + l] >> (4 * (q / 2))) & 0xf) |
                         (((src[128 + 32 * n + l] >> (2 * q)) & 3) << 4);
        const int c = k / 32, h = k % 32 / 16, r = k % 16 / 4, t = k % 4;
        uint8_t *v = dst + Q6_CODES + Q6_BLOCK * c + 192 * h + 4 * lane + t;
        if (r < 3) v[64 * r] |= (uint8_t)code;
        else
            for (int i = 0; i < 3; i++) v[64 * i] |= (uint8_t)(((code >> (2 * i)) & 3) << 6);
    }
}

/* GGUF blocks [N, K / block, block bytes] -> the packed layout (above). Returns 0, or -2 on a bad shape. */
int quant_pack(const void *blocks, int qtype, int64_t N, int64_t K, void *out, int num_threads) {
    if (!check_shape(qtype, N, K)) return -2;
    const int64_t nb = K / BLOCK_K[qtype], bb = PANEL_BYTES[qtype] / NR;
#pragma omp parallel for num_threads(num_threads > 0 ? num_threads : omp_get_max_threads()) schedule(static)
    for (int64_t p = 0; p < N / NR; p++)
        for (int64_t j = 0; j < nb; j++) {
            uint8_t *dst = (uint8_t *)out + (p * nb + j) * PANEL_BYTES[qtype];
            /* the formats whose bits are ORed in (and IQ4_TAB16's gap) */
            if (qtype == QUANT_Q6_K || qtype == QUANT_Q5_K || HAS_LOW2(qtype) || IS_CODE3(qtype) ||
                qtype == QUANT_IQ4_TAB16 || qtype == QUANT_IQ2_GRID)
                memset(dst, 0, (size_t)PANEL_BYTES[qtype]);
            for (int l = 0; l < NR; l++) {
                const uint8_t *src = (const uint8_t *)blocks + ((p * NR + l) * nb + j) * bb;
                for (int i = 0; i < 5 && PIECES[qtype][i].bytes > 0; i++) {
                    const Piece pc = PIECES[qtype][i];
                    for (int u = 0; u < pc.bytes / pc.unit; u++)
                        memcpy(dst + pc.to + (NR * u + l) * pc.unit, src + pc.from + u * pc.unit, (size_t)pc.unit);
                }
                if (IS_FIFTH_32(qtype))  /* qh after d (and m) */
                    pack_high_bits(src + (HAS_BLOCK_MIN(qtype) ? 4 : 2), l, dst + FIFTH_AT(qtype));
                if (qtype == QUANT_Q6_K) pack_q6_k_codes(src, l, dst);
                if (qtype == QUANT_Q5_K) pack_q5_k(src, l, dst);
                if (XS_CODES(qtype) && qtype != QUANT_IQ4_TAB16) pack_iq4_xs_codes(src + 8, l, dst + IQ4_CODES);
                if (qtype == QUANT_IQ2_GRID) pack_iq2_grid(src, l, dst);
                if (qtype == QUANT_IQ4_TAB16) pack_iq4_xs_codes(src + 18, l, dst + TAB16_CODES);
                if (HAS_LOW2(qtype) || IS_CODE3(qtype)) pack_low2_codes(qtype, src, l, dst);
            }
            if (qtype == QUANT_Q8_0) /* int8 -> code + 128: the kernel's unsigned operand */
                for (int i = 32; i < PANEL_BYTES[qtype]; i++) dst[i] ^= 0x80;
        }
    return 0;
}

/* Rows ids[0..n) of the weight, dequantized into out [n, K] (fp32, or bf16 with is_bf16): an embedding
 * lookup. Returns 0, or -2 on a bad shape or an id outside [0, N). */
int quant_rows(const void *wq, int qtype, const int64_t *ids, int64_t n, int64_t N, int64_t K, void *out,
               int is_bf16) {
    if (!check_shape(qtype, N, K)) return -2;
    for (int64_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= N) return -2;
    for (int64_t i = 0; i < n; i++) {
        const int64_t panel = ids[i] / NR;
        const int lane = (int)(ids[i] % NR);
        for (int64_t j = 0; j < K / QB; j++) {
            const uint8_t *blk = panel_block(qtype, (const uint8_t *)wq, K, panel, j);
            float a = 0.0f, b = 0.0f;
            for (int k = 0; k < QB; k++) {
                if (k % 16 == 0) block_ab(qtype, blk, lane, (int)j, k, &a, &b);  /* Q6_K: a scale per 16 */
                const float v = a * (float)code_at(qtype, blk, lane, (int)j, k) - b;
                const int64_t at = i * K + j * QB + k;
                if (is_bf16) ((uint16_t *)out)[at] = f32_to_bf16(v);
                else ((float *)out)[at] = v;
            }
        }
    }
    return 0;
}
