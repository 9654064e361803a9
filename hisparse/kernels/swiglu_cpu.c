// SwiGLU of bfloat16 rows, silu(gate) * up, in one pass instead of PyTorch's silu and product. Built and loaded by
// swiglu_cpu.py, which says what is rounded where.
//
// With AVX-512 (and its bfloat16 conversions), 16 values at a time: e^-g by exp_nonpositive.h's `exp2_16` (its
// degree-6 polynomial), the quotient g / (1 + e^-g) a division, the
// roundings vcvtneps2bf16's (nearest even, as PyTorch's); otherwise plain loops with libm's expf.

#include <math.h>
#include <stdint.h>

#include "avx512.h"
#include "bfloat16.h"
#include "exp_nonpositive.h"

#if defined(AVX512_PATHS) && defined(__AVX512BF16__)
#define BF16_PATHS 1
static inline __m512 round16(__m512 x) {  // to bfloat16 and back
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x)), 16));
}

// e^x for x in float32's range (clamped to [-104, 89]: 0 below, inf above as expf gives), to 1.2e-7
static inline __m512 exp16(__m512 x) {
    __m512 clamped = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.0f)), _mm512_set1_ps(89.0f));
    return exp2_16(_mm512_mul_ps(clamped, _mm512_set1_ps(LOG2_E)), 6);
}
#endif

// out [rows, n] = bf16(bf16(silu(gate)) * up) with gate = x[r, :n] and up = x[r, n:2n] (rows of 2n values).
void swiglu(const uint16_t *x, int64_t rows, int64_t n, uint16_t *out, int parallel) {
    #pragma omp parallel for if (parallel) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *gate = x + r * 2 * n, *up = gate + n;
        uint16_t *o = out + r * n;
        int64_t i = 0;
#ifdef BF16_PATHS
        for (; i + 16 <= n; i += 16) {
            __m512 g = widen_bf16x16(gate + i);
            __m512 silu = round16(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(
                _mm512_setzero_ps(), g)))));
            __m512 product = _mm512_mul_ps(silu, widen_bf16x16(up + i));
            _mm256_storeu_si256((__m256i *)(o + i), (__m256i)_mm512_cvtneps_pbh(product));
        }
#endif
        for (; i < n; i++) {
            float g = bf16_to_float(gate[i]);
            o[i] = float_to_bf16(round_bf16(g / (1.0f + expf(-g))) * bf16_to_float(up[i]));
        }
    }
}
