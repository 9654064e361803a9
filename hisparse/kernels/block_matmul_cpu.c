// x [B, K] @ W.T -> [B, N] for a weight W [N, K] in llama.cpp's blocks of 32 inputs, with AVX-512 VNNI int8 dot
// products (llama.cpp's Q4_1 x Q8_1 and Q8_0 x Q8_0 schemes). Built and loaded by block_matmul_cpu.py (gcc -O3
// -march=native -fopenmp), which writes the layouts.
//
// Each block of x is rounded to int8 with one scale, dx = max |x| / 127, qx = x 127 / max |x| to the nearest (even).
// vpdpbusd multiplies unsigned bytes by signed ones, so the weights go in unsigned, u = q (Q4_1, 0..15) or q + 128
// (Q8_0), and what that shift adds comes off with each x block's sum:
//
//   Q4_1, w = (q - 8) scale + zero:  sum_i w x = sum_g dx (scale sum_i u qx + (zero - 8 scale) sum_i qx)
//   Q8_0, w = q scale:               sum_i w x = sum_g dx (scale sum_i u qx - 128 scale sum_i qx)
//
// Rows go in groups of 16, one per 32-bit lane: a vpdpbusd multiplies 4 inputs of a block (broadcast) by those 4
// weights of each of the 16 rows, so 8 of them sum a whole block for 16 rows in one int32 vector, and one vector of
// the 16 rows' scales turns it into floats. A group's block is 8 vectors of 64 bytes, vector v holding inputs
// 4v .. 4v + 3 of the 16 rows (row i at bytes 4i .. 4i + 3); Q4_1 packs vectors v and v + 4 into the low and high
// nibbles of one. Scales: Q4_1 [N / 16, K / 32, 2, 16] (scales, then zeros) in x's dtype; Q8_0 [N / 16, K / 32, 16]
// float32.

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "avx512.h"
#include "bfloat16.h"

#define BLOCK 32
#define ROWS 16
#define MAX_BATCH 8  // rows of x a pass over a group of rows takes: its accumulators stay in registers
#define Q4_1 0
#define Q8_0 1

// x rounded per block: qx as bytes [B, K], each block's dx [B, G] and dx sum(qx) [B, G].
typedef struct {
    int8_t *bytes;
    float *dx;
    float *sums;
} RoundedX;

static inline __m512 sixteen_floats(const void *values, int64_t at, int bfloat16) {
    return bfloat16 ? widen_bf16x16((const uint16_t *)values + at) : _mm512_loadu_ps((const float *)values + at);
}

// One block (lo: its first 16 inputs, hi: the other 16) rounded into row slot bg of r; lo and hi become what is left
// of them, x - dx qx.
static inline void round_block(__m512 *lo, __m512 *hi, size_t bg, RoundedX *r) {
    const __m512 magnitude = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
    int nan = _mm512_cmp_ps_mask(*lo, *lo, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(*hi, *hi, _CMP_UNORD_Q);
    float top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(*lo, magnitude), _mm512_and_ps(*hi, magnitude)));
    // A NaN (or infinite) input makes the block's scale NaN (or infinite), and with it the outputs NaN, as a dense
    // product would; its qx are then 0, never a cast of a NaN.
    float dx = nan ? NAN : top / 127.0f, inverse = top > 0.0f && isfinite(top) && !nan ? 127.0f / top : 0.0f;
    __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(*lo, _mm512_set1_ps(inverse)));  // to nearest, as nearbyintf
    __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(*hi, _mm512_set1_ps(inverse)));
    _mm_storeu_si128((__m128i *)(r->bytes + bg * BLOCK), _mm512_cvtepi32_epi8(qlo));
    _mm_storeu_si128((__m128i *)(r->bytes + bg * BLOCK + 16), _mm512_cvtepi32_epi8(qhi));
    r->dx[bg] = dx;
    r->sums[bg] = dx * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
    *lo = _mm512_sub_ps(*lo, _mm512_mul_ps(_mm512_set1_ps(dx), _mm512_cvtepi32_ps(qlo)));
    *hi = _mm512_sub_ps(*hi, _mm512_mul_ps(_mm512_set1_ps(dx), _mm512_cvtepi32_ps(qhi)));
}

// x's rows rounded; with `residual` each row b is rows 2b (x rounded) and 2b + 1 (what that left, rounded again:
// x to within max |x| / 127 / 254 a block, for twice the products). Returns 0, or -1 (nothing allocated) for no
// memory; free(r->bytes) releases it all.
static int round_x(const void *x, int64_t batch, int64_t blocks, int bfloat16, int residual, RoundedX *r) {
    const int copies = residual ? 2 : 1;
    size_t n = (size_t)(batch * blocks), rows = n * copies;
    char *memory = malloc(rows * BLOCK + 2 * rows * sizeof(float));
    if (!memory) return -1;
    r->bytes = (int8_t *)memory;
    r->dx = (float *)(memory + rows * BLOCK);
    r->sums = r->dx + rows;
    for (size_t bg = 0; bg < n; bg++) {
        __m512 lo = sixteen_floats(x, bg * BLOCK, bfloat16), hi = sixteen_floats(x, bg * BLOCK + 16, bfloat16);
        size_t b = bg / blocks, g = bg % blocks;
        for (int copy = 0; copy < copies; copy++) round_block(&lo, &hi, (b * copies + copy) * blocks + g, r);
    }
    return 0;
}

static inline __m512i x_bytes4(const int8_t *at) {
    int32_t four;
    memcpy(&four, at, sizeof four);
    return _mm512_set1_epi32(four);
}

static inline int64_t block_bytes(int format) { return format == Q4_1 ? 4 * 64 : 8 * 64; }
static inline int64_t block_scales(int format) { return format == Q4_1 ? 2 * ROWS : ROWS; }

// One group of 16 rows for `batch` rows of x (format and batch constants after inlining: the accumulators stay in
// registers). A block's first and second 16 inputs sum into separate vectors, two independent chains of products.
static inline __attribute__((always_inline)) void row_group(int format, int batch, const RoundedX *x,
                                                            int64_t blocks, const uint8_t *w, const void *scales,
                                                            int scales_bf16, __m512 *acc) {
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    const int64_t width = blocks * BLOCK;
    for (int b = 0; b < batch; b++) acc[b] = _mm512_setzero_ps();
    for (int64_t g = 0; g < blocks; g++) {
        __m512i first_dots[MAX_BATCH], second_dots[MAX_BATCH];
        for (int b = 0; b < batch; b++) first_dots[b] = second_dots[b] = _mm512_setzero_si512();
        const uint8_t *at = w + g * block_bytes(format);
        for (int64_t line = 0; line < block_bytes(format); line += 64)
            _mm_prefetch((const char *)at + 2048 + line, _MM_HINT_T0);
        for (int v = 0; v < 4; v++) {
            __m512i first, second;
            if (format == Q4_1) {
                __m512i packed = _mm512_loadu_si512(at + v * 64);
                first = _mm512_and_si512(packed, nibble);
                second = _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble);
            } else {
                first = _mm512_loadu_si512(at + v * 64);
                second = _mm512_loadu_si512(at + (v + 4) * 64);
            }
            for (int b = 0; b < batch; b++) {
                const int8_t *xb = x->bytes + b * width + g * BLOCK;
                first_dots[b] = _mm512_dpbusd_epi32(first_dots[b], first, x_bytes4(xb + 4 * v));
                second_dots[b] = _mm512_dpbusd_epi32(second_dots[b], second, x_bytes4(xb + 16 + 4 * v));
            }
        }
        const int64_t s = g * block_scales(format);
        __m512 scale = sixteen_floats(scales, s, scales_bf16), offset;
        if (format == Q4_1)  // zero - 8 scale
            offset = _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), scale, sixteen_floats(scales, s + ROWS, scales_bf16));
        else
            offset = _mm512_mul_ps(_mm512_set1_ps(-128.0f), scale);
        for (int b = 0; b < batch; b++) {
            __m512 dots = _mm512_cvtepi32_ps(_mm512_add_epi32(first_dots[b], second_dots[b]));
            acc[b] = _mm512_fmadd_ps(dots, _mm512_mul_ps(scale, _mm512_set1_ps(x->dx[b * blocks + g])), acc[b]);
            acc[b] = _mm512_fmadd_ps(offset, _mm512_set1_ps(x->sums[b * blocks + g]), acc[b]);
        }
    }
}

// Rows group .. group + 15 of x's rows first .. first + B - 1 into `out` (format and B constants after inlining).
// With `residual` rows 2b and 2b + 1 of the rounded x are out's row b, and `first` is even.
static inline __attribute__((always_inline)) void group_rows(int format, int B, const RoundedX *rounded,
                                                             int64_t first, int64_t blocks, const uint8_t *w,
                                                             const void *scales, int bfloat16, int residual,
                                                             int64_t group, int64_t out_features, void *out) {
    const int scales_bf16 = format == Q4_1 && bfloat16;  // Q4_1's scales are in x's dtype, Q8_0's float32
    const int64_t at = first * blocks;  // x's rows from `first` on
    RoundedX x = {rounded->bytes + at * BLOCK, rounded->dx + at, rounded->sums + at};
    __m512 acc[MAX_BATCH];
    row_group(format, B, &x, blocks, w + group * blocks * block_bytes(format),
              (const char *)scales + group * blocks * block_scales(format) * (scales_bf16 ? 2 : 4), scales_bf16, acc);
    for (int b = 0; b < B; b += residual ? 2 : 1) {
        float values[ROWS];
        _mm512_storeu_ps(values, residual && b + 1 < B ? _mm512_add_ps(acc[b], acc[b + 1]) : acc[b]);
        for (int i = 0; i < ROWS; i++) {
            int64_t at = (residual ? (first + b) / 2 : first + b) * out_features + group * ROWS + i;
            if (bfloat16) ((uint16_t *)out)[at] = float_to_bf16(values[i]);
            else ((float *)out)[at] = values[i];
        }
    }
}

#define GROUPS_FOR(FORMAT)                                                                                        \
    _Pragma("omp parallel for schedule(static)")                                                                  \
    for (int64_t group = 0; group < out_features / ROWS; group++)                                                 \
        for (int64_t first = 0; first < rows; first += MAX_BATCH) {                                               \
            int64_t left = rows - first;                                                                          \
            switch (left < MAX_BATCH ? left : MAX_BATCH) {  /* each a copy with B a constant */                   \
                case 1: GROUP_ROWS(FORMAT, 1); break;                                                             \
                case 2: GROUP_ROWS(FORMAT, 2); break;                                                             \
                case 3: GROUP_ROWS(FORMAT, 3); break;                                                             \
                case 4: GROUP_ROWS(FORMAT, 4); break;                                                             \
                case 5: GROUP_ROWS(FORMAT, 5); break;                                                             \
                case 6: GROUP_ROWS(FORMAT, 6); break;                                                             \
                case 7: GROUP_ROWS(FORMAT, 7); break;                                                             \
                default: GROUP_ROWS(FORMAT, 8); break;                                                            \
            }                                                                                                     \
        }

// format: Q4_1 (scales in x's dtype) or Q8_0 (float32 scales); residual: x rounded twice (`round_x`). Returns 0, or
// -1 (nothing done) for no batch, widths that are not whole blocks or groups of rows, an unknown format, or no
// memory. Batches past MAX_BATCH go MAX_BATCH rows of x at a time through each group of rows, whose weights (a few
// KB) the first pass left in the core's cache.
int block_matmul(const void *x, int64_t batch, int64_t in_features, const uint8_t *w, const void *scales,
                 int64_t out_features, void *out, int bfloat16, int format, int residual) {
    if (batch < 1 || in_features % BLOCK || out_features % ROWS || (format != Q4_1 && format != Q8_0)) return -1;
    int64_t blocks = in_features / BLOCK;
    RoundedX rounded;
    if (round_x(x, batch, blocks, bfloat16, residual, &rounded)) return -1;
    const int64_t rows = residual ? 2 * batch : batch;  // an even MAX_BATCH keeps each pair in one pass
#define GROUP_ROWS(FORMAT, B) \
    group_rows(FORMAT, B, &rounded, first, blocks, w, scales, bfloat16, residual, group, out_features, out)
    if (format == Q4_1) {
        GROUPS_FOR(Q4_1)
    } else {
        GROUPS_FOR(Q8_0)
    }
#undef GROUP_ROWS
    free(rounded.bytes);
    return 0;
}
