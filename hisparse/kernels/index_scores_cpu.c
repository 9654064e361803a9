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
#include <stdlib.h>
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

// Scores positions [lo, hi) of request b into o (its row of the output): see int8_past_scores. Returns 1 when a
// slot read is outside [0, num_rows) (its score is NaN), else 0.
static int score_tile(const uint8_t *rows, int64_t row_bytes, int64_t num_rows, int64_t dim, const int64_t *slot,
                      const float *qb, const float *wb, int64_t heads, int64_t n, int64_t lo, int64_t hi, float *o) {
    int bad = 0;
#ifdef AVX512_PATHS
    int wide = dim % 16 == 0 && dim / 16 <= MAX_CHUNKS;
#endif
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
    return bad;
}

static int lengths_fit(const int64_t *lengths, int64_t batch, int64_t width) {
    for (int64_t b = 0; b < batch; b++)
        if (lengths[b] < 0 || lengths[b] > width) return 0;
    return 1;
}

// out [batch, width]: sum_h w[b, h] ReLU(q[b, h] . key) x scale of the key row at slots[b, p] (rows of row_bytes:
// dim int8 values, then the float32 scale), -inf from lengths[b] on, +inf at lengths[b] - 1. q [batch, heads,
// dim], w [batch, heads] float32. Returns 0; 1 when a slot read is outside [0, num_rows); 2 (nothing written) when a
// length is outside [0, width].
int int8_past_scores(const uint8_t *rows, int64_t row_bytes, int64_t num_rows, int64_t dim, const int64_t *slots,
                     int64_t batch, int64_t width, const float *q, const float *w, int64_t heads,
                     const int64_t *lengths, float *out, int parallel) {
    if (!lengths_fit(lengths, batch, width)) return 2;
    int64_t tiles = (width + TILE - 1) / TILE;
    int bad = 0;
    #pragma omp parallel for if (parallel) schedule(dynamic, 1) reduction(| : bad)
    for (int64_t t = 0; t < batch * tiles; t++) {
        int64_t b = t / tiles, lo = (t % tiles) * TILE, hi = lo + TILE < width ? lo + TILE : width;
        bad |= score_tile(rows, row_bytes, num_rows, dim, slots + b * width, q + b * heads * dim, w + b * heads,
                          heads, lengths[b], lo, hi, out + b * width);
    }
    return bad;
}

// -- the top-k of a row of scores --------------------------------------------------------------------------------

#define MINUS_INF_KEY 0x007FFFFFu  // ordered_key(bits of -inf)

// float32 bits -> uint32 in the same order as the floats (-inf lowest, +inf highest)
static inline uint32_t ordered_key(uint32_t bits) { return bits & 0x80000000u ? ~bits : bits | 0x80000000u; }

#define TOP_BITS 12  // the first pass's digit: the scores of one row share their top 8 bits far too often

// Row `keys` [width] (the row's float32 scores, overwritten by their order-preserving keys)'s k largest positions
// into out [k], ascending, -inf never (-1 padding at the end), ties to the earlier positions; k <= width. A radix
// select from the top: a histogram of the top 12 bits while the keys are made, the keys in the k-th largest's
// bucket gathered into `candidates` [width], then 10 bits a pass over those: the k-th largest key and how many of
// the keys equal to it the k take. One scan in position order then keeps them (kernels/top_k_cpu.py is the same
// rule in numba). The loops are branchless, since whether a score makes the cut is a coin toss for the branch
// predictor; the scan carries no count when every key equal to the k-th is taken (almost always).
static void top_k_row(uint32_t *keys, int64_t width, int64_t k, int64_t *out, uint32_t *candidates) {
    int32_t top[1 << TOP_BITS], low[1 << 10];
    memset(top, 0, sizeof top);
    for (int64_t p = 0; p < width; p++) {
        keys[p] = ordered_key(keys[p]);
        top[keys[p] >> (32 - TOP_BITS)]++;
    }
    int64_t remaining = k;
    int digit = (1 << TOP_BITS) - 1;
    while (top[digit] < remaining) remaining -= top[digit--];
    int64_t n = 0;
    for (int64_t p = 0; p < width; p++) {
        candidates[n] = keys[p];
        n += keys[p] >> (32 - TOP_BITS) == (uint32_t)digit;
    }
    uint32_t threshold = (uint32_t)digit << (32 - TOP_BITS), mask = ~0u << (32 - TOP_BITS);
    int64_t equal_to_threshold = 0;
    for (int shift = 32 - TOP_BITS - 10; shift >= 0; shift -= 10) {
        memset(low, 0, sizeof low);
        for (int64_t i = 0; i < n; i++) low[(candidates[i] >> shift) & 1023] += (candidates[i] & mask) == threshold;
        int d = 1023;
        while (low[d] < remaining) remaining -= low[d--];
        equal_to_threshold = low[d];
        threshold |= (uint32_t)d << shift;
        mask |= 1023u << shift;
    }
    int64_t kept = 0;
    if (equal_to_threshold == remaining) {
        for (int64_t p = 0; p < width && kept < k; p++) {
            out[kept] = p;
            kept += (keys[p] >= threshold) & (keys[p] > MINUS_INF_KEY);
        }
    } else {
        for (int64_t p = 0; p < width && kept < k; p++) {
            uint32_t key = keys[p];
            int64_t finite = key > MINUS_INF_KEY, equal = key == threshold;
            int64_t take = finite & ((key > threshold) | (equal & (remaining > 0)));
            remaining -= equal & take;
            out[kept] = p;
            kept += take;
        }
    }
    for (; kept < k; kept++) out[kept] = -1;
}

// out [batch, k] int64: each request's k best-scored positions (the scores of int8_past_scores, written into
// `scores` [batch, width] and then overwritten by their order-preserving keys), ascending, -1 padded; k <= width.
// One parallel region: the scores' tiles, then (after its barrier) the rows' top-k, while the scores are still
// in the caches. Returns as int8_past_scores does, or 3 when a thread's scratch cannot be allocated
// (out is not meaningful unless 0).
int int8_top_k(const uint8_t *rows, int64_t row_bytes, int64_t num_rows, int64_t dim, const int64_t *slots,
               int64_t batch, int64_t width, const float *q, const float *w, int64_t heads, const int64_t *lengths,
               int64_t k, float *scores, int64_t *out, int parallel) {
    if (!lengths_fit(lengths, batch, width)) return 2;
    int64_t tiles = (width + TILE - 1) / TILE;
    int bad = 0, no_memory = 0;
    #pragma omp parallel if (parallel) reduction(| : bad, no_memory)
    {
        #pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < batch * tiles; t++) {
            int64_t b = t / tiles, lo = (t % tiles) * TILE, hi = lo + TILE < width ? lo + TILE : width;
            bad |= score_tile(rows, row_bytes, num_rows, dim, slots + b * width, q + b * heads * dim,
                              w + b * heads, heads, lengths[b], lo, hi, scores + b * width);
        }
        uint32_t *candidates = malloc(width * sizeof *candidates);
        no_memory |= candidates == NULL;
        #pragma omp for schedule(dynamic, 1)
        for (int64_t b = 0; b < batch; b++)
            if (candidates != NULL) top_k_row((uint32_t *)(scores + b * width), width, k, out + b * k, candidates);
        free(candidates);
    }
    return no_memory ? 3 : bad;
}
