// Half-split RoPE of a batch's heads in one call instead of PyTorch's roll, two products and a sum. Built and
// loaded by rotary_cpu.py. Each product and the sum are rounded as PyTorch's separate ops round them (to the
// rows' dtype), so the bits are theirs.

#include <math.h>
#include <stdint.h>

#include "bfloat16.h"

#pragma GCC optimize("fp-contract=off")  // each product rounded before the sum
#pragma GCC target("prefer-vector-width=512")

// o[i] = in[i] c[i] + in[i + shift] s[i] for i in [lo, hi), each product and the sum rounded to bfloat16
static inline void rotate_bf16(const uint16_t *in, const uint16_t *c, const uint16_t *s, uint16_t *o, int64_t lo,
                               int64_t hi, int64_t shift) {
    #pragma omp simd
    for (int64_t i = lo; i < hi; i++) {
        float straight = round_bf16(bf16_to_float(in[i]) * bf16_to_float(c[i]));
        float swapped = round_bf16(bf16_to_float(in[i + shift]) * bf16_to_float(s[i]));
        o[i] = float_to_bf16(straight + swapped);
    }
}

static inline void rotate_float(const float *in, const float *c, const float *s, float *o, int64_t lo, int64_t hi,
                                int64_t shift) {
    #pragma omp simd
    for (int64_t i = lo; i < hi; i++) o[i] = in[i] * c[i] + in[i + shift] * s[i];
}

// rotate_float of bfloat16 heads, each widened as it is read (exactly: a bfloat16 is a float32's top half)
static inline void rotate_widened(const uint16_t *in, const float *c, const float *s, float *o, int64_t lo,
                                  int64_t hi, int64_t shift) {
    #pragma omp simd
    for (int64_t i = lo; i < hi; i++) o[i] = bf16_to_float(in[i]) * c[i] + bf16_to_float(in[i + shift]) * s[i];
}

enum { FLOAT32 = 0, BFLOAT16 = 1, WIDENED = 2 };  // heads, tables and out of one dtype; or bfloat16 heads, float32 rest

// One head: the swap pairs dim i with i + half in the first half, i - half in the second, itself past them (three
// loops without a branch; inlined with the common dims as constants, they unroll into whole vectors).
static inline __attribute__((always_inline)) void rotate_head(const void *x, const void *cos, const void *sin,
                                                              void *out, int64_t in_at, int64_t out_at, int64_t r,
                                                              int64_t dim, int64_t half, int kind) {
    if (kind == WIDENED) {
        const uint16_t *in = (const uint16_t *)x + in_at;
        const float *c = (const float *)cos + r * dim, *s = (const float *)sin + r * dim;
        float *o = (float *)out + out_at;
        rotate_widened(in, c, s, o, 0, half, half);
        rotate_widened(in, c, s, o, half, 2 * half, -half);
        rotate_widened(in, c, s, o, 2 * half, dim, 0);
    } else if (kind == BFLOAT16) {
        const uint16_t *in = (const uint16_t *)x + in_at;
        const uint16_t *c = (const uint16_t *)cos + r * dim, *s = (const uint16_t *)sin + r * dim;
        uint16_t *o = (uint16_t *)out + out_at;
        rotate_bf16(in, c, s, o, 0, half, half);
        rotate_bf16(in, c, s, o, half, 2 * half, -half);
        rotate_bf16(in, c, s, o, 2 * half, dim, 0);
    } else {
        const float *in = (const float *)x + in_at;
        const float *c = (const float *)cos + r * dim, *s = (const float *)sin + r * dim;
        float *o = (float *)out + out_at;
        rotate_float(in, c, s, o, 0, half, half);
        rotate_float(in, c, s, o, half, 2 * half, -half);
        rotate_float(in, c, s, o, 2 * half, dim, 0);
    }
}

// Row r's heads of `rotate_half_split`.
static inline void rotate_row(const void *x, int64_t stride, int64_t r, int64_t heads, int64_t dim, const void *cos,
                              const void *sin, int64_t half, void *out, int kind) {
    for (int64_t h = 0; h < heads; h++) {
        int64_t in_at = r * stride + h * dim, out_at = (r * heads + h) * dim;
        if (dim == 64 && half == 32 && kind == BFLOAT16)
            rotate_head(x, cos, sin, out, in_at, out_at, r, 64, 32, BFLOAT16);
        else if (dim == 64 && half == 32 && kind == WIDENED)
            rotate_head(x, cos, sin, out, in_at, out_at, r, 64, 32, WIDENED);
        else rotate_head(x, cos, sin, out, in_at, out_at, r, dim, half, kind);
    }
}

// out [rows, heads, dim] = x * cos + swap(x) * sin, x's rows `stride` values apart (each row's heads contiguous),
// cos and sin [rows, dim] (1 and 0 past the 2 * half rotated dims; sin signed for the first half); `kind` says the
// dtypes (the enum above).
void rotate_half_split(const void *x, int64_t stride, int64_t rows, int64_t heads, int64_t dim, const void *cos,
                       const void *sin, int64_t half, void *out, int kind) {
    if (rows < 64) {  // outside any parallel region: entering one, even for a team of one, costs about as much as a row
        for (int64_t r = 0; r < rows; r++) rotate_row(x, stride, r, heads, dim, cos, sin, half, out, kind);
        return;
    }
    #pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) rotate_row(x, stride, r, heads, dim, cos, sin, half, out, kind);
}
