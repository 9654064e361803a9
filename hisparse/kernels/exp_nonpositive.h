// e^x for x <= 0, scalar and 16 lanes, for the C kernels' softmaxes (and SwiGLU's 2^f): 2^(x log2 e) = 2^n 2^f,
// n an integer and f in [-1/2, 1/2], 2^f the degree-6 Taylor polynomial of e^(f ln 2) (error below 1.2e-7), 2^n
// built from its exponent bits; clamped at 2^-127, whose bits are those of 0.0 (-inf gives 0).

#pragma once

#include <math.h>
#include <stdint.h>

#include "avx512.h"

#define LOG2_E 1.4426950408889634f

static inline float exp_nonpositive(float x) {
    float y = fmaxf(x * LOG2_E, -127.0f), n = floorf(y + 0.5f), f = y - n;
    float p = 1.5403530393381606e-4f;
    p = p * f + 1.3333558146428443e-3f;
    p = p * f + 9.618129107628477e-3f;
    p = p * f + 5.550410866482158e-2f;
    p = p * f + 0.2402265069591007f;
    p = p * f + 0.6931471805599453f;
    p = p * f + 1.0f;
    union { uint32_t u; float f; } power = {.u = (uint32_t)((int32_t)n + 127) << 23};
    return p * power.f;
}

#ifdef AVX512_PATHS
// 2^f for f in [-1/2, 1/2], 16 lanes: the polynomial above
static inline __m512 exp2_fraction16(__m512 f) {
    __m512 p = _mm512_set1_ps(1.5403530393381606e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618129107628477e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550410866482158e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.2402265069591007f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6931471805599453f));
    return _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
}

static inline __m512 exp_nonpositive16(__m512 x) {
    __m512 y = _mm512_max_ps(_mm512_mul_ps(x, _mm512_set1_ps(LOG2_E)), _mm512_set1_ps(-127.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_add_ps(y, _mm512_set1_ps(0.5f)), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 p = exp2_fraction16(_mm512_sub_ps(y, n));
    __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}
#endif
