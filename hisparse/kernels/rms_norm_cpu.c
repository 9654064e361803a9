// RMSNorm of bfloat16 rows with its residual add, one call instead of PyTorch's chain of small ops (a cast, a
// square, a mean, a reciprocal square root, two products, casts back). Built and loaded by rms_norm_cpu.py,
// which says what is rounded where.

#include <math.h>
#include <stdint.h>

#include "bfloat16.h"

// One row of `rms_norm`.
static inline void norm_row(const uint16_t *x, const uint16_t *delta, uint16_t *sum, const uint16_t *weight,
                            uint16_t *out, int64_t r, int64_t dim, float eps) {
    const uint16_t *in = x + r * dim;
    if (delta) {
        const uint16_t *d = delta + r * dim;
        uint16_t *s = sum + r * dim;
        #pragma omp simd
        for (int64_t i = 0; i < dim; i++) s[i] = float_to_bf16(bf16_to_float(in[i]) + bf16_to_float(d[i]));
        in = s;
    }
    double squares = 0.0;
    #pragma omp simd reduction(+ : squares)  // any order: float64 holds these float32 squares' sum exactly enough
    for (int64_t i = 0; i < dim; i++) {
        float v = bf16_to_float(in[i]);
        squares += (double)(v * v);
    }
    float scale = 1.0f / sqrtf((float)squares / (float)dim + eps);
    uint16_t *o = out + r * dim;
    #pragma omp simd
    for (int64_t i = 0; i < dim; i++) {
        float normed = bf16_to_float(float_to_bf16(bf16_to_float(in[i]) * scale));
        o[i] = float_to_bf16(bf16_to_float(weight[i]) * normed);
    }
}

// out = weight * bf16(s / rms(s)) for s = x, or s = bf16(x + delta) (then also written to sum) where delta is
// given. Rows [rows, dim], contiguous. Few rows run outside any parallel region: entering one, even for a team of
// one, cost 0.6 us a call here, as much as a row of the default model.
void rms_norm(const uint16_t *x, const uint16_t *delta, uint16_t *sum, const uint16_t *weight, uint16_t *out,
              int64_t rows, int64_t dim, float eps) {
    if (rows < 64) {
        for (int64_t r = 0; r < rows; r++) norm_row(x, delta, sum, weight, out, r, dim, eps);
        return;
    }
    #pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) norm_row(x, delta, sum, weight, out, r, dim, eps);
}
