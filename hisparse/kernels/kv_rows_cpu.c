// Writing a step's new K/V rows into the pool in one call instead of PyTorch's cat of K and V and an index_copy_.
// Built and loaded by kv_rows_cpu.py.

#include <stdint.h>
#include <string.h>

// pool[slots[i]] = k[i] then v[i] for i < n: `width` bytes of each, read `k_stride` and `v_stride` bytes apart,
// into rows of `row_bytes` (2 width). Returns 0, or 1 (writing nothing) when a slot is outside [0, pool_rows).
int write_kv_rows(char *pool, int64_t pool_rows, int64_t row_bytes, const int64_t *slots, int64_t n,
                  const char *k, int64_t k_stride, const char *v, int64_t v_stride, int64_t width) {
    for (int64_t i = 0; i < n; i++)
        if (slots[i] < 0 || slots[i] >= pool_rows) return 1;
    for (int64_t i = 0; i < n; i++) {
        char *row = pool + slots[i] * row_bytes;
        memcpy(row, k + i * k_stride, (size_t)width);
        memcpy(row + width, v + i * v_stride, (size_t)width);
    }
    return 0;
}
