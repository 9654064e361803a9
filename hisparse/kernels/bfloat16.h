// bfloat16 <-> float32 as PyTorch converts them, for the C kernels: a bfloat16 is the top 16 bits of a float32,
// and rounding goes to the nearest even, a NaN staying a NaN.

#pragma once

#include <math.h>
#include <stdint.h>

static inline float bf16_to_float(uint16_t bits) {
    union { uint32_t u; float f; } v = {.u = (uint32_t)bits << 16};
    return v.f;
}

static inline uint16_t float_to_bf16(float value) {
    union { float f; uint32_t u; } v = {.f = value};
    if (isnan(value)) return (uint16_t)((v.u >> 16) | 0x40u);
    return (uint16_t)((v.u + 0x7FFFu + ((v.u >> 16) & 1u)) >> 16);
}

static inline float round_bf16(float value) { return bf16_to_float(float_to_bf16(value)); }
