// One layer's LRU swap-in of a decode step, page table out: kernels/swap_in_cpu.py's plan for the lru policy
// (`_plan_row` with policy 0, newest position in its reserved row, totals added), then the missed rows' copies.
// Built and loaded by lru_page_table_cpu.py, which says why it exists beside the numba plan.

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "thread_buffer.h"

#define PREFETCH_AHEAD 8  // rows

// A layer's tables and pools, bound once (lru_page_table_cpu.LruTables mirrors it).
typedef struct {
    int32_t *slot_pos;          // [R, S]: the position each hot slot holds, -1 none
    int32_t *lru;               // [R, S]: each row's slots, least recently used first
    const int64_t *device_rows; // [R, S]: each hot slot's device row
    const int64_t *host_rows;   // [R, C]: each position's host row
    int64_t num_rows, num_slots, context;
    const uint8_t *host;        // host pool rows of row_bytes
    uint8_t *device;            // device pool rows
    int64_t row_bytes;
    int64_t *totals;            // [3]: hits, misses, evictions, added to
} Tables;

// Each thread's scratch (`thread_buffer`): a sparse set over the context (never cleared: see `held`) and a
// request's plan lists.
static __thread void *scratch;
static __thread size_t scratch_bytes;

// The error codes of kernels/swap_in.py.
enum { TOO_MANY_SELECTED = 1, POSITION_OUT_OF_RANGE = 2, ROW_OUT_OF_RANGE = 3, ROW_TWICE = 4 };

// The values' checks, in the numba plan's order; 0 or an error code (its value in *detail).
static int check(const Tables *t, const int64_t *top_k, int64_t batch, int64_t width, const int64_t *rows,
                 const int64_t *newest, int64_t *detail) {
    uint8_t *seen = calloc(t->num_rows > 0 ? t->num_rows : 1, 1);
    if (!seen) return -1;
    int code = 0;
    for (int64_t b = 0; b < batch && !code; b++) {
        int64_t r = rows[b];
        if (r < 0 || r >= t->num_rows) { code = ROW_OUT_OF_RANGE; *detail = r; break; }
        if (seen[r]) { code = ROW_TWICE; *detail = r; break; }
        seen[r] = 1;
        int64_t count = 0;
        for (int64_t j = 0; j < width; j++) {
            int64_t p = top_k[b * width + j];
            if (p < -1 || p >= t->context) { code = POSITION_OUT_OF_RANGE; *detail = p; break; }
            count += p >= 0 && p != newest[b];
        }
        if (!code && count > t->num_slots) { code = TOO_MANY_SELECTED; *detail = count; }
    }
    free(seen);
    return code;
}

// The slot of row r holding position p, -1 if none: lookup[p] is whatever a scatter left there, so it counts
// only if that slot really holds p.
static inline int64_t held(const Tables *t, const int32_t *lookup, int64_t r, int64_t p) {
    int64_t s = lookup[p];
    return s >= 0 && s < t->num_slots && t->slot_pos[r * t->num_slots + s] == p ? s : -1;
}

// Request b's plan: its page table row, its misses' host and device rows (src, dst), and its counts in counts[3].
// lookup: this thread's sparse set [C]; scratch: its 3 S + width int32.
static void plan_row(const Tables *t, const int64_t *top_k, int64_t width, int64_t b, int64_t r, int64_t newest,
                     int64_t reserved, int64_t *page, int64_t *src, int64_t *dst, int64_t counts[3],
                     int32_t *lookup, int32_t *scratch) {
    const int64_t S = t->num_slots;
    int32_t *slot_pos = t->slot_pos + r * S, *lru = t->lru + r * S;
    const int64_t *device_rows = t->device_rows + r * S, *host_rows = t->host_rows + r * t->context;
    const int64_t *selected = top_k + b * width;
    int32_t *pinned = scratch, *evictable = scratch + S, *hits = scratch + 2 * S, *col_slot = scratch + 3 * S;
    for (int64_t s = 0; s < S; s++) {
        if (slot_pos[s] >= 0) lookup[slot_pos[s]] = (int32_t)s;
        pinned[s] = 0;
    }
    for (int64_t j = 0; j < width; j++) {  // hits keep their slot
        int64_t p = selected[j], s = p >= 0 && p != newest ? held(t, lookup, r, p) : -1;
        col_slot[j] = (int32_t)s;
        if (s >= 0) pinned[s] = 1;
    }
    int64_t n_evictable = 0, n_hits = 0;
    for (int64_t i = 0; i < S; i++) {  // the order's walk: hits, and the rest evictable oldest first
        int32_t s = lru[i];
        if (pinned[s]) hits[n_hits++] = s;
        else evictable[n_evictable++] = s;
    }
    int64_t n_miss = 0, n_evict = 0;
    for (int64_t j = 0; j < width; j++) {
        int64_t p = selected[j];
        if (p < 0) { page[j] = -1; continue; }
        if (p == newest) { page[j] = reserved; continue; }
        int64_t s = col_slot[j];
        if (s < 0) {  // the i-th miss takes the i-th oldest evictable slot
            s = evictable[n_miss];
            pinned[s] = 2;
            n_evict += slot_pos[s] >= 0;
            slot_pos[s] = (int32_t)p;
            src[n_miss] = host_rows[p];
            dst[n_miss] = device_rows[s];
            __builtin_prefetch(t->host + host_rows[p] * t->row_bytes);
            n_miss++;
        }
        page[j] = device_rows[s];
    }
    // The new order: untouched evictables, then the loaded slots, then the hits.
    int64_t k = 0;
    for (int64_t i = n_miss; i < n_evictable; i++) lru[k++] = evictable[i];
    for (int64_t i = 0; i < n_miss; i++) lru[k++] = evictable[i];
    for (int64_t i = 0; i < n_hits; i++) lru[k++] = hits[i];
    counts[0] = n_hits;
    counts[1] = n_miss;
    counts[2] = n_evict;
}

static void copy_rows(const Tables *t, const int64_t *src, const int64_t *dst, int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; i++) {
        if (i + PREFETCH_AHEAD < hi) {
            const char *ahead = (const char *)(t->host + src[i + PREFETCH_AHEAD] * t->row_bytes);
            for (int64_t line = 0; line < t->row_bytes; line += 64) __builtin_prefetch(ahead + line);
        }
        memcpy(t->device + dst[i] * t->row_bytes, t->host + src[i] * t->row_bytes, t->row_bytes);
    }
}

// The page table [batch, width] of the selected positions top_k [batch, width] (-1 padding stays -1; newest[b]
// reads row reserved[b]), the missed rows copied host -> device, the tables updated and the batch's (hits,
// misses, evictions) added to t->totals. `parallel`: requests and copies on the OpenMP team (the plan's threads
// are awake for the copy). Returns 0; an error code of kernels/swap_in.py (detail in *detail, nothing
// changed); -1 without memory.
int lru_page_table(const Tables *t, const int64_t *top_k, int64_t batch, int64_t width, const int64_t *rows,
                   const int64_t *newest, const int64_t *reserved, int64_t *page_table, int parallel,
                   int64_t *detail) {
    int code = check(t, top_k, batch, width, rows, newest, detail);
    if (code || batch == 0) return code;
    const int64_t S = t->num_slots;
    int64_t *moves = malloc(sizeof(int64_t) * (size_t)(2 * batch * width + 3 * batch));
    if (!moves) return -1;
    int64_t *src = moves, *dst = moves + batch * width, *counts = moves + 2 * batch * width;
    int no_memory = 0;  // a thread without scratch: found before any table changes
    if (!parallel) {  // outside any parallel region: entering one, even for a team of one, cost 2 us a call here
        size_t bytes = sizeof(int32_t) * (size_t)(t->context + 3 * S + width);
        int32_t *lookup = thread_buffer(&scratch, &scratch_bytes, bytes);
        no_memory = !lookup;
        for (int64_t b = 0; b < batch && !no_memory; b++)
            plan_row(t, top_k, width, b, rows[b], newest[b], reserved[b], page_table + b * width, src + b * width,
                     dst + b * width, counts + 3 * b, lookup, lookup + t->context);
        for (int64_t b = 0; b < batch && !no_memory; b++)
            copy_rows(t, src + b * width, dst + b * width, 0, counts[3 * b + 1]);
    } else {
        #pragma omp parallel shared(no_memory)
        {
            size_t bytes = sizeof(int32_t) * (size_t)(t->context + 3 * S + width);
            int32_t *lookup = thread_buffer(&scratch, &scratch_bytes, bytes);
            if (!lookup) {
                #pragma omp atomic write
                no_memory = 1;
            }
            #pragma omp barrier
            int failed;
            #pragma omp atomic read
            failed = no_memory;
            if (!failed) {
                #pragma omp for schedule(dynamic, 1)
                for (int64_t b = 0; b < batch; b++)
                    plan_row(t, top_k, width, b, rows[b], newest[b], reserved[b], page_table + b * width,
                             src + b * width, dst + b * width, counts + 3 * b, lookup, lookup + t->context);
                #pragma omp for schedule(dynamic, 1)
                for (int64_t b = 0; b < batch; b++)
                    copy_rows(t, src + b * width, dst + b * width, 0, counts[3 * b + 1]);
            }
        }
    }
    if (!no_memory)
        for (int64_t b = 0; b < batch; b++)
            for (int c = 0; c < 3; c++) t->totals[c] += counts[3 * b + c];
    free(moves);
    return no_memory ? -1 : 0;
}
