// The indexer's key from its projection: LayerNorm, then half-split RoPE, in one call instead of PyTorch's slice,
// cast, norm, rotation (two products, a roll, a sum); and its head weights, scaled twice. Built and loaded by
// indexer_key_cpu.py, which says what differs from PyTorch's arithmetic.

#include <math.h>
#include <stdint.h>

#include "bfloat16.h"

#pragma GCC optimize("fp-contract=off")  // each product rounded before the sum, as PyTorch's separate ops do

// Row r of `indexer_key`.
static inline void key_row(const void *projected, int64_t stride, int64_t start, int bf16, const float *weight,
                           const float *bias, float eps, const float *cos, const float *sin, int64_t half, float *out,
                           int64_t r, int64_t dim) {
    float k[dim], normed[dim];
    for (int64_t i = 0; i < dim; i++)
        k[i] = bf16 ? bf16_to_float(((const uint16_t *)projected)[r * stride + start + i])
                    : ((const float *)projected)[r * stride + start + i];
    double total = 0.0;
    for (int64_t i = 0; i < dim; i++) total += k[i];
    double mean = total / (double)dim, spread = 0.0;
    for (int64_t i = 0; i < dim; i++) spread += ((double)k[i] - mean) * ((double)k[i] - mean);
    float rstd = 1.0f / sqrtf((float)(spread / (double)dim) + eps), shift = -rstd * (float)mean;
    for (int64_t i = 0; i < dim; i++) normed[i] = (k[i] * rstd + shift) * weight[i] + bias[i];
    const float *c = cos + r * dim, *s = sin + r * dim;
    float *o = out + r * dim;
    for (int64_t i = 0; i < dim; i++) {
        int64_t partner = i < half ? i + half : (i < 2 * half ? i - half : i);
        o[i] = normed[i] * c[i] + normed[partner] * s[i];
    }
}

// out [rows, dim] float32 = rope(LayerNorm(k)), k the dim values at column `start` of each row of projected
// (bfloat16 when bf16, else float32; `stride` values a row). cos, sin [rows, dim] are the rotation's factors
// (1 and 0 past the rotated 2 * half dims) and sin carries the sign of the rotation's first half.
void indexer_key(const void *projected, int64_t stride, int64_t start, int bf16, const float *weight,
                 const float *bias, float eps, const float *cos, const float *sin, int64_t half, float *out,
                 int64_t rows, int64_t dim) {
    if (rows < 64) {  // outside any parallel region: entering one, even for a team of one, costs about as much as a row
        for (int64_t r = 0; r < rows; r++)
            key_row(projected, stride, start, bf16, weight, bias, eps, cos, sin, half, out, r, dim);
        return;
    }
    #pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++)
        key_row(projected, stride, start, bf16, weight, bias, eps, cos, sin, half, out, r, dim);
}


// out [rows, heads] float32 = (w * first) * second, each product rounded to float32 as PyTorch's two products of a
// float32 tensor and a scalar are; w the heads values at column `start` of each row of projected (as above).
void indexer_weights(const void *projected, int64_t stride, int64_t start, int bf16, float first, float second,
                     float *out, int64_t rows, int64_t heads) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t h = 0; h < heads; h++) {
            int64_t at = r * stride + start + h;
            float w = bf16 ? bf16_to_float(((const uint16_t *)projected)[at]) : ((const float *)projected)[at];
            out[r * heads + h] = (w * first) * second;
        }
}
