// x [B, K] @ W.T -> [B, N] for a weight W [N, K] in Q4_1 blocks (32 inputs, w = (q - 8) scale + zero, q in 0..15),
// with AVX-512 VNNI int8 dot products: llama.cpp's Q4_1 x Q8_1 scheme. Built and loaded by q4_1_matmul_cpu.py
// (gcc -O3 -march=native -fopenmp), which writes the layout.
//
// Each block of x is rounded to int8 with one scale (dx = max |x| / 127). vpdpbusd multiplies unsigned by signed
// bytes, which is what q (0..15) times qx (-127..127) is, and the zero term needs only each x block's sum:
//
//   sum_i w[n, i] x[b, i] = sum_g dx[b, g] (scale[n, g] sum_i q qx + (zero[n, g] - 8 scale[n, g]) sum_i qx)
//
// Rows go in groups of 16, one per 32-bit lane: a vpdpbusd multiplies 4 inputs of a block (broadcast) by those 4
// weights of each of the 16 rows, so 8 of them sum a whole block for 16 rows in one int32 vector, and one vector of
// the 16 rows' scales turns it into floats. A group's block is 256 bytes: 4 vectors of 64, whose low nibbles hold
// inputs 4c .. 4c + 3 of the 16 rows (row i at bytes 4i .. 4i + 3) and whose high nibbles inputs 16 + 4c .. 19 + 4c.
// Scales and zeros are [N / 16, K / 32, 2, 16] in x's dtype, bfloat16 or float32.

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "bfloat16.h"
#include "rounded_x.h"

#define ROWS 16
#define MAX_BATCH 8

static inline __m512i x_bytes4(const int8_t *at) {
    int32_t four;
    memcpy(&four, at, sizeof four);
    return _mm512_set1_epi32(four);
}

// One group of 16 rows for `batch` rows of x (a constant after inlining: the accumulators stay in registers). Low
// and high nibbles sum into separate vectors, two independent chains of dot products a block.
static inline __attribute__((always_inline)) void row_group(int batch, const RoundedX *x, int64_t blocks,
                                                            const uint8_t *w, const void *scales, int bfloat16,
                                                            __m512 *acc) {
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    const __m512 eight = _mm512_set1_ps(8.0f);
    const int64_t width = blocks * BLOCK;
    for (int b = 0; b < batch; b++) acc[b] = _mm512_setzero_ps();
    for (int64_t g = 0; g < blocks; g++) {
        __m512i low_dots[MAX_BATCH], high_dots[MAX_BATCH];
        for (int b = 0; b < batch; b++) low_dots[b] = high_dots[b] = _mm512_setzero_si512();
        const uint8_t *at = w + g * 4 * 64;
        _mm_prefetch((const char *)at + 2048, _MM_HINT_T0);
        _mm_prefetch((const char *)at + 2048 + 64, _MM_HINT_T0);
        _mm_prefetch((const char *)at + 2048 + 128, _MM_HINT_T0);
        _mm_prefetch((const char *)at + 2048 + 192, _MM_HINT_T0);
        for (int c = 0; c < 4; c++) {
            __m512i packed = _mm512_loadu_si512(at + c * 64);
            __m512i low = _mm512_and_si512(packed, nibble);
            __m512i high = _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble);
            for (int b = 0; b < batch; b++) {
                const int8_t *xb = x->bytes + b * width + g * BLOCK;
                low_dots[b] = _mm512_dpbusd_epi32(low_dots[b], low, x_bytes4(xb + 4 * c));
                high_dots[b] = _mm512_dpbusd_epi32(high_dots[b], high, x_bytes4(xb + 16 + 4 * c));
            }
        }
        __m512 scale = sixteen_floats(scales, g * 2 * ROWS, bfloat16);
        __m512 offset = _mm512_fnmadd_ps(eight, scale, sixteen_floats(scales, g * 2 * ROWS + ROWS, bfloat16));  // zero - 8 scale
        for (int b = 0; b < batch; b++) {
            __m512 dots = _mm512_cvtepi32_ps(_mm512_add_epi32(low_dots[b], high_dots[b]));
            acc[b] = _mm512_fmadd_ps(dots, _mm512_mul_ps(scale, _mm512_set1_ps(x->dx[b * blocks + g])), acc[b]);
            acc[b] = _mm512_fmadd_ps(offset, _mm512_set1_ps(x->sums[b * blocks + g]), acc[b]);
        }
    }
}

// Rows group .. group + 15 of x's rows first .. first + B - 1 into `out` (B a constant after inlining).
static inline __attribute__((always_inline)) void group_rows(int B, const RoundedX *rounded, int64_t first,
                                                             int64_t blocks, const uint8_t *w, const void *scales,
                                                             int bfloat16, int64_t group, int64_t out_features,
                                                             void *out) {
    RoundedX x = {rounded->bytes + first * blocks * BLOCK, rounded->dx + first * blocks, rounded->sums + first * blocks};
    __m512 acc[MAX_BATCH];
    row_group(B, &x, blocks, w + group * blocks * 4 * 64,
              (const char *)scales + group * blocks * 2 * ROWS * (bfloat16 ? 2 : 4), bfloat16, acc);
    for (int b = 0; b < B; b++) {
        float values[ROWS];
        _mm512_storeu_ps(values, acc[b]);
        for (int i = 0; i < ROWS; i++) {
            int64_t at = (first + b) * out_features + group * ROWS + i;
            if (bfloat16) ((uint16_t *)out)[at] = float_to_bf16(values[i]);
            else ((float *)out)[at] = values[i];
        }
    }
}

// Returns 0, or -1 (nothing done) for no batch, widths that are not whole blocks or groups of rows, or no memory.
// Batches past MAX_BATCH go MAX_BATCH rows of x at a time through each group of rows, whose weights (a few KB) the
// first pass left in the core's cache.
int q4_1_matmul(const void *x, int64_t batch, int64_t in_features, const uint8_t *w, const void *scales,
                int64_t out_features, void *out, int bfloat16) {
    if (batch < 1 || in_features % BLOCK || out_features % ROWS) return -1;
    int64_t blocks = in_features / BLOCK;
    RoundedX rounded;
    if (round_x(x, batch, blocks, bfloat16, 0, &rounded)) return -1;
#pragma omp parallel for schedule(static)
    for (int64_t group = 0; group < out_features / ROWS; group++)
        for (int64_t first = 0; first < batch; first += MAX_BATCH) {
#define GROUP_ROWS(B) group_rows(B, &rounded, first, blocks, w, scales, bfloat16, group, out_features, out)
            switch (batch - first < MAX_BATCH ? batch - first : MAX_BATCH) {  // each a copy with B a constant
                case 1: GROUP_ROWS(1); break;
                case 2: GROUP_ROWS(2); break;
                case 3: GROUP_ROWS(3); break;
                case 4: GROUP_ROWS(4); break;
                case 5: GROUP_ROWS(5); break;
                case 6: GROUP_ROWS(6); break;
                case 7: GROUP_ROWS(7); break;
                default: GROUP_ROWS(8); break;
            }
#undef GROUP_ROWS
        }
    free(rounded.bytes);
    return 0;
}
