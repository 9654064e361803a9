// Half-split RoPE of a batch's heads in one call instead of PyTorch's roll, two products and a sum. Built and
// loaded by rotary_cpu.py. Each product and the sum are rounded as PyTorch's separate ops round them (to the
// rows' dtype), so the bits are theirs.

#include <math.h>
#include <stdint.h>

#include "bfloat16.h"

#pragma GCC optimize("fp-contract=off")  // each product rounded before the sum

static inline int64_t partner(int64_t i, int64_t half) {  // the dim a dim is rotated with (itself past 2 half)
    return i < half ? i + half : (i < 2 * half ? i - half : i);
}

// out [rows, heads, dim] = x * cos + swap(x) * sin, x's rows `stride` values apart (each row's heads contiguous),
// cos and sin [rows, dim] (1 and 0 past the 2 * half rotated dims; sin signed for the first half).
void rotate_half_split(const void *x, int64_t stride, int64_t rows, int64_t heads, int64_t dim, const void *cos,
                       const void *sin, int64_t half, void *out, int bf16) {
    #pragma omp parallel for if (rows >= 64) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t h = 0; h < heads; h++) {
            int64_t in_at = r * stride + h * dim, out_at = (r * heads + h) * dim;
            if (bf16) {
                const uint16_t *in = (const uint16_t *)x + in_at;
                const uint16_t *c = (const uint16_t *)cos + r * dim, *s = (const uint16_t *)sin + r * dim;
                uint16_t *o = (uint16_t *)out + out_at;
                for (int64_t i = 0; i < dim; i++) {
                    float straight = round_bf16(bf16_to_float(in[i]) * bf16_to_float(c[i]));
                    float swapped = round_bf16(bf16_to_float(in[partner(i, half)]) * bf16_to_float(s[i]));
                    o[i] = float_to_bf16(straight + swapped);
                }
            } else {
                const float *in = (const float *)x + in_at;
                const float *c = (const float *)cos + r * dim, *s = (const float *)sin + r * dim;
                float *o = (float *)out + out_at;
                for (int64_t i = 0; i < dim; i++) o[i] = in[i] * c[i] + in[partner(i, half)] * s[i];
            }
        }
    }
}
