// The C kernels' exponentials, as 2^(x log2 e) = 2^n 2^f: n an integer, f in [-1/2, 1/2], 2^f a Taylor polynomial
// of e^(f ln 2). e^x for x <= 0, scalar and 16 lanes, for the softmaxes (degree 6, error below 1.2e-7), 2^n built
// from its exponent bits, clamped at 2^-127, whose bits are those of 0.0 (-inf gives 0); and 2^y over float32's
// range in 16 lanes (`exp2_16`), 2^n by vscalefps, of degree 6 or, where the result is rounded to bfloat16 next, 4.

#pragma once

#include <math.h>
#include <stdint.h>

#include "avx512.h"

#define LOG2_E 1.4426950408889634f

// (ln 2)^k / k! from k = 6 down to 0: Horner's rule from the first
static const float EXP2_TAYLOR[7] = {1.5403530393381606e-4f, 1.3333558146428443e-3f, 9.618129107628477e-3f,
                                     5.550410866482158e-2f, 0.2402265069591007f, 0.6931471805599453f, 1.0f};

static inline float exp_nonpositive(float x) {
    float y = fmaxf(x * LOG2_E, -127.0f), n = floorf(y + 0.5f), f = y - n;
    float p = EXP2_TAYLOR[0];
    for (int k = 1; k < 7; k++) p = p * f + EXP2_TAYLOR[k];
    union { uint32_t u; float f; } power = {.u = (uint32_t)((int32_t)n + 127) << 23};
    return p * power.f;
}

#ifdef AVX512_PATHS
// 2^f for f in [-1/2, 1/2], 16 lanes: the polynomial of degree 6 (to 1.2e-7) or 4 (to 4.2e-5)
static inline __attribute__((always_inline)) __m512 exp2_fraction16(__m512 f, int degree) {
    __m512 p = _mm512_set1_ps(EXP2_TAYLOR[6 - degree]);
    for (int k = 7 - degree; k < 7; k++) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP2_TAYLOR[k]));
    return p;
}

static inline __m512 exp_nonpositive16(__m512 x) {
    __m512 y = _mm512_max_ps(_mm512_mul_ps(x, _mm512_set1_ps(LOG2_E)), _mm512_set1_ps(-127.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_add_ps(y, _mm512_set1_ps(0.5f)), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 p = exp2_fraction16(_mm512_sub_ps(y, n), 6);
    __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

// 2^y for y in float32's range, 16 lanes (below -149 it rounds to 0): 2^n, n the nearest integer, by vscalefps
static inline __attribute__((always_inline)) __m512 exp2_16(__m512 y, int degree) {
    __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm512_scalef_ps(exp2_fraction16(_mm512_sub_ps(y, n), degree), n);
}
#endif
