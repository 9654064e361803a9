// What the C kernels' AVX-512 paths share: whether they are compiled (F and DQ: _mm512_extractf32x8_ps), 16
// bfloat16 values widened to float32, and the sums of four vectors' lanes at once (a horizontal sum per vector costs
// as much as the products it sums).

#pragma once

#if defined(__AVX512F__) && defined(__AVX512DQ__)
#define AVX512_PATHS 1
#include <immintrin.h>
#include <stdint.h>

// 16 bfloat16 values as float32 (exact: a bfloat16 is a float32's top half)
static inline __m512 widen_bf16x16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

// [sum of a0's 16 lanes, of a1's, of a2's, of a3's]: per 128-bit lane [a0 a1 a0 a1] pairs, then [a0 a1 a2 a3],
// then the four 128-bit lanes added.
static inline __m128 lane_sums4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
    __m512 t01 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
    __m512 t23 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
    __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(t01), _mm512_castps_pd(t23));
    __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(t01), _mm512_castps_pd(t23));
    __m512 t = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
    __m256 half = _mm256_add_ps(_mm512_castps512_ps256(t), _mm512_extractf32x8_ps(t, 1));
    return _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
}
#endif
