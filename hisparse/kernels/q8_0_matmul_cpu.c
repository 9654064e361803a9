// x [B, K] @ W.T -> [B, N] for a weight W [N, K] in Q8_0 blocks (32 inputs, one scale each), with AVX-512 VNNI
// int8 dot products: llama.cpp's Q8_0 x Q8_0 scheme. Built and loaded by q8_0_matmul_cpu.py (gcc -O3
// -march=native -fopenmp), which documents the layout.
//
// Each block of x is rounded to int8 with one scale (dx = max |x| / 127) and the weights stay bytes: one vpdpbusd
// multiplies 64 weights by 64 inputs and sums them in fours. vpdpbusd multiplies unsigned by signed bytes, so x
// goes in as qx + 128 and the excess comes off with each block's sum of q, kept with the weight:
//
//   sum_i w[n, i] x[b, i] = sum_g scale[n, g] dx[b, g] (sum_i q (qx + 128) + offset[n, g] / scale[n, g])
//
// where offset = -128 scale sum_i q (the weights are exact; only the products see x's rounding).

#include <immintrin.h>
#include <stdint.h>

#include "bfloat16.h"
#include "rounded_x.h"

#define MAX_BATCH 4
#define PREFETCH_BYTES 2048  // how far ahead of each row's next blocks their bytes are asked for

// Output rows n .. n + R - 1 for `batch` rows of x (R and batch constants after inlining: the R x batch
// accumulators stay in registers, and R rows make R independent chains of adds). Two blocks (64 bytes) a
// step; an odd last block is masked.
static inline __attribute__((always_inline)) void rows(int R, int batch, const RoundedX *x, int64_t blocks,
                                                       const int8_t *w, const float *scales, const float *offsets,
                                                       float *result) {
    const int64_t row_bytes = blocks * BLOCK;
    __m512 acc[4][MAX_BATCH];
    for (int r = 0; r < R; r++)
        for (int b = 0; b < batch; b++) acc[r][b] = _mm512_setzero_ps();
    // a step's two blocks' values over the 8 int32 lanes each block's products land in
    const __m512i spread = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    const __mmask8 two_mask = 3, one_mask = 1;
    for (int64_t g = 0; g < blocks; g += 2) {
        int left = blocks - g < 2 ? 1 : 2;
        __mmask64 byte_mask = left == 2 ? ~0ULL : (1ULL << 32) - 1;
        __mmask8 block_mask = left == 2 ? two_mask : one_mask;
        __m512i weights[4];
        __m512 scale[4];
        for (int r = 0; r < R; r++) {
            const int8_t *at = w + r * row_bytes + g * BLOCK;
            _mm_prefetch((const char *)at + PREFETCH_BYTES, _MM_HINT_T0);
            weights[r] = _mm512_maskz_loadu_epi8(byte_mask, at);
            __m128 two = _mm_maskz_loadu_ps(block_mask, scales + r * blocks + g);
            scale[r] = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(two));
        }
        for (int b = 0; b < batch; b++) {
            __m512i x_bytes = _mm512_maskz_loadu_epi8(byte_mask, x->bytes + (b * blocks + g) * BLOCK);
            __m128 two = _mm_maskz_loadu_ps(block_mask, x->dx + b * blocks + g);
            __m512 dx = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(two));
            for (int r = 0; r < R; r++) {
                __m512i dots = _mm512_dpbusd_epi32(_mm512_setzero_si512(), x_bytes, weights[r]);
                acc[r][b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots), _mm512_mul_ps(scale[r], dx), acc[r][b]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int b = 0; b < batch; b++) {
            float offset = 0.0f;
            for (int64_t g = 0; g < blocks; g++) offset += offsets[r * blocks + g] * x->dx[b * blocks + g];
            result[r * MAX_BATCH + b] = _mm512_reduce_add_ps(acc[r][b]) + offset;
        }
}

// R = 4 rows at a time up to batch 2, else 2: at most 8 accumulators.
#define ROWS_FOR(B, R)                                                                                            \
    _Pragma("omp parallel for schedule(static)")                                                                  \
    for (int64_t n = 0; n < out_features; n += R) {                                                               \
        float result[4 * MAX_BATCH];                                                                              \
        rows(R, B, &rounded, blocks, w + n * blocks * BLOCK, scales + n * blocks, offsets + n * blocks, result);  \
        for (int r = 0; r < R; r++)                                                                               \
            for (int b = 0; b < B; b++) {                                                                         \
                float value = result[r * MAX_BATCH + b];                                                          \
                if (bfloat16) ((uint16_t *)out)[b * out_features + n + r] = float_to_bf16(value);                 \
                else ((float *)out)[b * out_features + n + r] = value;                                            \
            }                                                                                                     \
    }

// Returns 0, or -1 (nothing done) for a batch outside [1, MAX_BATCH], widths that are not whole blocks or rows of
// four, or no memory.
int q8_0_matmul(const void *x, int64_t batch, int64_t in_features, const int8_t *w, const float *scales,
                const float *offsets, int64_t out_features, void *out, int bfloat16) {
    if (batch < 1 || batch > MAX_BATCH || in_features % BLOCK || out_features % 4) return -1;
    int64_t blocks = in_features / BLOCK;
    RoundedX rounded;
    if (round_x(x, batch, blocks, bfloat16, 128, &rounded)) return -1;
    switch (batch) {  // each case a copy of the loop with the batch a constant
        case 1: ROWS_FOR(1, 4) break;
        case 2: ROWS_FOR(2, 4) break;
        case 3: ROWS_FOR(3, 2) break;
        default: ROWS_FOR(4, 2) break;
    }
    free(rounded.bytes);
    return 0;
}
