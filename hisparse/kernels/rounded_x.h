// The activations of the VNNI matmuls (q8_0_matmul_cpu.c, q4_1_matmul_cpu.c) rounded as llama.cpp's Q8 blocks: each
// block of 32 inputs to int8 with one scale, dx = max |x| / 127, qx = x 127 / max |x| to the nearest (even).

#pragma once

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define BLOCK 32

// x rounded per block: qx + bias as bytes [B, K] (vpdpbusd reads one side unsigned: the q8_0 kernel adds 128),
// each block's scale dx [B, G] and dx sum(qx) [B, G].
typedef struct {
    int8_t *bytes;
    float *dx;
    float *sums;
} RoundedX;

static inline __m512 sixteen_floats(const void *values, int64_t at, int bfloat16) {
    return bfloat16 ? _mm512_castsi512_ps(_mm512_slli_epi32(
                          _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)values + at))), 16))
                    : _mm512_loadu_ps((const float *)values + at);
}

// Returns 0, or -1 (nothing allocated) for no memory; free(r->bytes) releases it all.
static int round_x(const void *x, int64_t batch, int64_t blocks, int bfloat16, int bias, RoundedX *r) {
    size_t n = (size_t)(batch * blocks);
    char *memory = malloc(n * BLOCK + 2 * n * sizeof(float));
    if (!memory) return -1;
    r->bytes = (int8_t *)memory;
    r->dx = (float *)(memory + n * BLOCK);
    r->sums = r->dx + n;
    const __m512 magnitude = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
    for (size_t bg = 0; bg < n; bg++) {
        __m512 lo = sixteen_floats(x, bg * BLOCK, bfloat16), hi = sixteen_floats(x, bg * BLOCK + 16, bfloat16);
        int nan = _mm512_cmp_ps_mask(lo, lo, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(hi, hi, _CMP_UNORD_Q);
        float top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(lo, magnitude), _mm512_and_ps(hi, magnitude)));
        // A NaN (or infinite) input makes the block's scale NaN (or infinite), and with it the outputs NaN, as a
        // dense product would; its qx are then 0, never a cast of a NaN.
        float dx = nan ? NAN : top / 127.0f, inverse = top > 0.0f && isfinite(top) && !nan ? 127.0f / top : 0.0f;
        __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, _mm512_set1_ps(inverse)));  // to nearest, as nearbyintf
        __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, _mm512_set1_ps(inverse)));
        __m512i shift = _mm512_set1_epi32(bias);
        _mm_storeu_si128((__m128i *)(r->bytes + bg * BLOCK), _mm512_cvtepi32_epi8(_mm512_add_epi32(qlo, shift)));
        _mm_storeu_si128((__m128i *)(r->bytes + bg * BLOCK + 16), _mm512_cvtepi32_epi8(_mm512_add_epi32(qhi, shift)));
        r->dx[bg] = dx;
        r->sums[bg] = dx * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
    }
    return 0;
}
