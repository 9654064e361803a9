// A decode step's page table from a table of each request's rows and the positions it selected, in one call: the
// baseline's pool rows of its selection, or HiSparse's hot slots on the fast path. Built and loaded by
// page_rows_cpu.py.

#include <stdint.h>

// page[b, j] = table[b * table_stride + selected[b, j]] for selected [batch, k], -1 where selected[b, j] is -1
// (padding). Returns how many positions it looked up (those not -1), or -1, writing nothing, when a position is
// outside [-1, width).
int64_t page_rows(const int64_t *table, int64_t table_stride, int64_t width, const int64_t *selected, int64_t batch,
                  int64_t k, int64_t *page) {
    int64_t count = 0;
    for (int64_t i = 0; i < batch * k; i++) {
        if (selected[i] < -1 || selected[i] >= width) return -1;
        count += selected[i] >= 0;
    }
    for (int64_t b = 0; b < batch; b++) {
        const int64_t *rows = table + b * table_stride, *chosen = selected + b * k;
        int64_t *out = page + b * k;
        for (int64_t j = 0; j < k; j++) out[j] = chosen[j] < 0 ? -1 : rows[chosen[j]];
    }
    return count;
}
