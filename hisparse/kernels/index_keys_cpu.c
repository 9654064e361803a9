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
        int nan = 0;
        for (int64_t d = 0; d < dim; d++) {
            nan |= isnan(key[d]);
            top = fmaxf(top, fabsf(key[d]));
        }
        float scale = nan ? NAN : fmaxf(top, 1e-12f) / 127.0f;  // a NaN key: a NaN scale and values 0, as pack
        uint8_t *row = rows + slots[i] * (dim + 4);
        for (int64_t d = 0; d < dim; d++) {  // a NaN quotient (NaN or inf keys) is 0, never a cast of a NaN
            float q = key[d] / scale;
            row[d] = isnan(q) ? 0 : (uint8_t)(int8_t)nearbyintf(q);
        }
        memcpy(row + dim, &scale, sizeof scale);
    }
    return 0;
}
