// Lightning-indexer scores of every past token from int8 key rows: for each request's positions, the weighted
// ReLUs of its query heads' dot products with the key at that position's slot. Built and loaded by
// index_scores_cpu.py, which says what it computes.
//
// With AVX-512 and head dims in sixteens, a key's int8 values are widened to float32 once (a zmm per 16 dims),
// each head's dot product is a few FMAs, and four heads' products are summed across their lanes together (a
// horizontal sum per head cost as much as the products). The rows of the positions a few ahead are prefetched
// (they lie where the cache's allocator put them, so no hardware prefetcher can guess them). The ReLU is a max:
// a branch on the dot product's sign was mispredicted half the time (5x slower).

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "avx512.h"

#define TILE 256          // positions per parallel work item
#define PREFETCH_AHEAD 8  // positions
#define MAX_CHUNKS 16     // the AVX-512 path's head dims: up to 256

static inline float relu(float x) { return x > 0.0f ? x : 0.0f; }  // one vmaxss, no branch

static inline float score_scalar(const int8_t *key, const float *q, const float *w, int64_t heads, int64_t dim) {
    float total = 0.0f;
    for (int64_t h = 0; h < heads; h++) {
        float dot = 0.0f;
        for (int64_t d = 0; d < dim; d++) dot += q[h * dim + d] * (float)key[d];
        total += w[h] * relu(dot);
    }
    return total;
}

#ifdef AVX512_PATHS
// The dot products of four heads' queries (rows `dim` apart from q) with a key widened into k [chunks], summed
// across their lanes together: [4] floats.
static inline __attribute__((always_inline)) __m128 four_dots(const __m512 *k, const float *q, int64_t dim,
                                                             int64_t chunks) {
    __m512 a[4];
    for (int h = 0; h < 4; h++) {
        a[h] = _mm512_mul_ps(_mm512_loadu_ps(q + h * dim), k[0]);
        for (int64_t c = 1; c < chunks; c++) a[h] = _mm512_fmadd_ps(_mm512_loadu_ps(q + h * dim + 16 * c), k[c], a[h]);
    }
    return lane_sums4(a[0], a[1], a[2], a[3]);
}

static inline __attribute__((always_inline)) float score_avx512(const int8_t *key, const float *q, const float *w,
                                                                int64_t heads, int64_t dim, int64_t chunks) {
    __m512 k[MAX_CHUNKS];
    for (int64_t c = 0; c < chunks; c++)
        k[c] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(key + 16 * c))));
    __m128 weighted = _mm_setzero_ps();
    int64_t h = 0;
    for (; h + 4 <= heads; h += 4)
        weighted = _mm_add_ps(weighted, _mm_mul_ps(_mm_loadu_ps(w + h),
                                                   _mm_max_ps(four_dots(k, q + h * dim, dim, chunks), _mm_setzero_ps())));
    __m128 pairs = _mm_add_ps(weighted, _mm_movehl_ps(weighted, weighted));
    float total = _mm_cvtss_f32(_mm_add_ss(pairs, _mm_movehdup_ps(pairs)));
    for (; h < heads; h++) {
        __m512 dot = _mm512_mul_ps(_mm512_loadu_ps(q + h * dim), k[0]);
        for (int64_t c = 1; c < chunks; c++) dot = _mm512_fmadd_ps(_mm512_loadu_ps(q + h * dim + 16 * c), k[c], dot);
        total += w[h] * relu(_mm512_reduce_add_ps(dot));
    }
    return total;
}
#endif

// out [batch, width]: sum_h w[b, h] ReLU(q[b, h] . key) x scale of the key row at slots[b, p] (rows of row_bytes:
// dim int8 values, then the float32 scale), -inf from lengths[b] on, +inf at lengths[b] - 1. q [batch, heads,
// dim], w [batch, heads] float32. Returns 0; 1 when a slot read is outside [0, num_rows); 2 (nothing written) when a
// length is outside [0, width].
int int8_past_scores(const uint8_t *rows, int64_t row_bytes, int64_t num_rows, int64_t dim, const int64_t *slots,
                     int64_t batch, int64_t width, const float *q, const float *w, int64_t heads,
                     const int64_t *lengths, float *out, int parallel) {
    for (int64_t b = 0; b < batch; b++)
        if (lengths[b] < 0 || lengths[b] > width) return 2;
    int64_t tiles = (width + TILE - 1) / TILE;
    int bad = 0;
#ifdef AVX512_PATHS
    int wide = dim % 16 == 0 && dim / 16 <= MAX_CHUNKS;
#endif
    #pragma omp parallel for if (parallel) schedule(dynamic, 1) reduction(| : bad)
    for (int64_t t = 0; t < batch * tiles; t++) {
        int64_t b = t / tiles, lo = (t % tiles) * TILE, hi = lo + TILE < width ? lo + TILE : width;
        int64_t n = lengths[b];
        const int64_t *slot = slots + b * width;
        const float *qb = q + b * heads * dim, *wb = w + b * heads;
        float *o = out + b * width;
        for (int64_t p = lo; p < hi; p++) {
            if (p >= n) { o[p] = -INFINITY; continue; }
            if (p == n - 1) { o[p] = INFINITY; continue; }
            int64_t ahead = p + PREFETCH_AHEAD;
            if (ahead < n - 1 && slot[ahead] >= 0 && slot[ahead] < num_rows) {
                const char *row = (const char *)(rows + slot[ahead] * row_bytes);
                __builtin_prefetch(row);
                __builtin_prefetch(row + row_bytes - 1);
            }
            int64_t s = slot[p];
            if (s < 0 || s >= num_rows) { bad = 1; o[p] = NAN; continue; }
            const uint8_t *row = rows + s * row_bytes;
            float scale;
            memcpy(&scale, row + dim, sizeof scale);
#ifdef AVX512_PATHS
            // the common head dims as constants, so that the widened key stays in registers
            float score = dim == 64    ? score_avx512((const int8_t *)row, qb, wb, heads, 64, 4)
                          : dim == 128 ? score_avx512((const int8_t *)row, qb, wb, heads, 128, 8)
                          : wide       ? score_avx512((const int8_t *)row, qb, wb, heads, dim, dim / 16)
                                       : score_scalar((const int8_t *)row, qb, wb, heads, dim);
#else
            float score = score_scalar((const int8_t *)row, qb, wb, heads, dim);
#endif
            o[p] = score * scale;
        }
    }
    return bad;
}
