// Writing int8 indexer keys into their cache rows: each key quantized (one float32 scale, the largest magnitude
// mapping to 127) and stored in place, one call per layer. Built and loaded by index_keys_cpu.py; the bytes are
// IndexKeyFormat.pack's (the same division, then rounding half to even).

#include <math.h>
#include <stdint.h>
#include <string.h>

// rows [pool_rows, dim + 4] bytes: dim int8 values, then the scale. Row slots[i] <- keys[i] (float32 [n, dim]).
// Returns 0, or 1 (writing nothing) when a slot is outside [0, pool_rows).
int write_int8_keys(uint8_t *rows, int64_t pool_rows, const int64_t *slots, const float *keys, int64_t n,
                    int64_t dim) {
    for (int64_t i = 0; i < n; i++)
        if (slots[i] < 0 || slots[i] >= pool_rows) return 1;
    for (int64_t i = 0; i < n; i++) {
        const float *key = keys + i * dim;
        float top = 0.0f;
        for (int64_t d = 0; d < dim; d++) top = fmaxf(top, fabsf(key[d]));
        float scale = fmaxf(top, 1e-12f) / 127.0f;
        uint8_t *row = rows + slots[i] * (dim + 4);
        for (int64_t d = 0; d < dim; d++) row[d] = (uint8_t)(int8_t)nearbyintf(key[d] / scale);
        memcpy(row + dim, &scale, sizeof scale);
    }
    return 0;
}
