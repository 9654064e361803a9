// Decode attention straight from a pool of K/V rows: one query per request over its own rows. Built and loaded by
// decode_attention_cpu.py, which says what it computes and why it is shaped so.
//
// Per request, two passes over its rows. Scores: with AVX512-BF16, bfloat16 queries and rows multiply in vdpbf16ps
// pairs where they lie, four rows at a time per query head (their four dot products summed across lanes together:
// a horizontal sum per dot product cost as much as the products); otherwise the queries are widened once and each
// valid row's K half widened once and scored by every query head, four heads at a time. Each head's scores go
// through a softmax whose exponential is a polynomial. Values: for head dims of 64, per KV head, the query heads
// reading it keep their accumulators in registers for the whole pass and each row's V half is widened once into
// them; otherwise the V halves, TILE_ROWS valid rows at a time, are weighted into accumulators in memory.
// With AVX-512 and head dims in sixteens the loops are intrinsics; otherwise plain loops of the same arithmetic.
// A request's query heads may be split between threads (when requests are fewer than threads): each head's
// arithmetic is the same whichever heads share its call, so the outputs do not depend on the split.

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "avx512.h"
#include "bfloat16.h"
#include "exp_nonpositive.h"

#pragma GCC target("prefer-vector-width=512")  // the plain loops (widening, weighting V) in full-width vectors

#define TILE_ROWS 4
#define PREFETCH_AHEAD 8  // rows
#define MAX_HEAD_VALUES 16384  // query heads x head dim: the widened queries and outputs live on the stack

// values [n] of a row half, bfloat16 or float32, as float32
static void widen(const void *src, int bf16, int64_t n, float *dst) {
    if (bf16) {
        const uint16_t *s = src;
        for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_float(s[i]);
    } else {
        memcpy(dst, src, (size_t)n * sizeof(float));
    }
}

#ifdef AVX512_PATHS
// The dot products of four queries with four keys (float32 [dim] each, dim a multiple of 16), summed across
// their lanes together: [4].
static inline __m128 four_dots(const char *const q[4], const char *const k[4], int64_t dim) {
    __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t d = 0; d < dim; d += 16)
        for (int t = 0; t < 4; t++)  // four independent chains
            a[t] = _mm512_fmadd_ps(_mm512_loadu_ps((const float *)q[t] + d), _mm512_loadu_ps((const float *)k[t] + d),
                                   a[t]);
    return lane_sums4(a[0], a[1], a[2], a[3]);
}
#endif

#if defined(AVX512_PATHS) && defined(__AVX512BF16__)
#define BF16_DOTS 1  // bfloat16 queries and rows multiplied in vdpbf16ps pairs where they lie
#endif

static inline float dot(const float *q, const float *k, int64_t dim) {
    float s = 0.0f;
    for (int64_t d = 0; d < dim; d++) s += q[d] * k[d];
    return s;
}

// scores[i] (of `stride` values) at column j <- (query i . its KV head's key) * scale, for every query head i of
// the call; query head i reads KV head (phase + i) / group of `keys` (phase: the first head's place in its group).
// Queries and keys float32 (widened).
static void score_row(const float *queries, const float *keys, int64_t heads, int64_t group, int64_t phase,
                      int64_t dim, float scale, float *scores, int64_t stride, int64_t j) {
#ifdef AVX512_PATHS
    if (dim % 16 == 0) {
        for (int64_t i = 0; i < heads; i += 4) {  // four heads at a time; past the last one, its product again, unused
            const char *q[4], *k[4];
            for (int t = 0; t < 4; t++) {
                int64_t h = i + t < heads ? i + t : heads - 1;
                q[t] = (const char *)(queries + h * dim);
                k[t] = (const char *)(keys + ((phase + h) / group) * dim);
            }
            float four[4];
            _mm_storeu_ps(four, four_dots(q, k, dim));
            for (int t = 0; t < 4 && i + t < heads; t++) scores[(i + t) * stride + j] = four[t] * scale;
        }
        return;
    }
#endif
    for (int64_t i = 0; i < heads; i++)
        scores[i * stride + j] = dot(queries + i * dim, keys + ((phase + i) / group) * dim, dim) * scale;
}

#ifdef BF16_DOTS
// The scores of four rows by each query head of the call at once (bfloat16 queries and rows, dim a multiple of
// 32): a head's four dot products summed across their lanes together, stored side by side. key[t]: row t's K half
// (NULL: no row, scored -inf); offset[i]: query head i's KV head within it, in values.
static void score_four_rows(const uint16_t *queries, const uint16_t *const key[4], const int64_t *offset,
                            int64_t heads, int64_t dim, float scale, float *scores, int64_t stride, int64_t j,
                            int64_t count) {
    const uint16_t *k[4];
    for (int t = 0; t < 4; t++) k[t] = key[t] ? key[t] : key[0] ? key[0] : key[1] ? key[1] : key[2] ? key[2] : key[3];
    __m128 scales = _mm_set1_ps(scale);
    for (int64_t i = 0; i < heads; i++) {
        const uint16_t *q = queries + i * dim;
        __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        for (int64_t d = 0; d < dim; d += 32) {
            __m512bh qv = (__m512bh)_mm512_loadu_si512(q + d);
            for (int t = 0; t < 4; t++)
                a[t] = _mm512_dpbf16_ps(a[t], qv, (__m512bh)_mm512_loadu_si512(k[t] + offset[i] + d));
        }
        float four[4];
        _mm_storeu_ps(four, _mm_mul_ps(lane_sums4(a[0], a[1], a[2], a[3]), scales));
        for (int t = 0; t < count; t++) scores[i * stride + j + t] = key[t] ? four[t] : -INFINITY;
    }
}
#endif

// s[0..n) <- e^(s - max s); returns their sum.
static float softmax_numerators(float *s, int64_t n) {
    float top = -INFINITY, total = 0.0f;
    int64_t j = 0;
#ifdef AVX512_PATHS
    __m512 tops = _mm512_set1_ps(-INFINITY), sums = _mm512_setzero_ps();
    for (; j + 16 <= n; j += 16) tops = _mm512_max_ps(tops, _mm512_loadu_ps(s + j));
    top = _mm512_reduce_max_ps(tops);
    for (; j < n; j++) top = fmaxf(top, s[j]);
    __m512 shift = _mm512_set1_ps(top);
    for (j = 0; j + 16 <= n; j += 16) {
        __m512 e = exp_nonpositive16(_mm512_sub_ps(_mm512_loadu_ps(s + j), shift));
        _mm512_storeu_ps(s + j, e);
        sums = _mm512_add_ps(sums, e);
    }
    total = _mm512_reduce_add_ps(sums);
#else
    for (; j < n; j++) top = fmaxf(top, s[j]);
    j = 0;
#endif
    for (; j < n; j++) {
        s[j] = exp_nonpositive(s[j] - top);
        total += s[j];
    }
    return total;
}

// acc[i] += sum_t weights[t][i] values[t][its KV head] for the tile's rows t < filled: each accumulator is loaded
// and stored once for the tile.
static void accumulate_tile(float *acc, float (*weights)[64], const float *values, int64_t row_values, int filled,
                            int64_t heads, int64_t group, int64_t phase, int64_t dim) {
    for (int64_t i = 0; i < heads; i++) {
        float *a = acc + i * dim;
        const float *v = values + ((phase + i) / group) * dim;
        if (filled == TILE_ROWS) {
            float p0 = weights[0][i], p1 = weights[1][i], p2 = weights[2][i], p3 = weights[3][i];
            const float *v0 = v, *v1 = v + row_values, *v2 = v + 2 * row_values, *v3 = v + 3 * row_values;
            for (int64_t d = 0; d < dim; d++) a[d] += p0 * v0[d] + p1 * v1[d] + p2 * v2[d] + p3 * v3[d];
        } else {
            for (int t = 0; t < filled; t++)
                for (int64_t d = 0; d < dim; d++) a[d] += weights[t][i] * v[t * row_values + d];
        }
    }
}

#ifdef AVX512_PATHS
#define MAX_REGISTER_HEADS 6  // query heads per KV head whose accumulators stay in registers (4 vectors each)

// acc[h][0..64) = sum_j weights[h][j] values_j over the valid rows, for the `count` query heads that read one KV
// head of 64 dims, its values at `offset` bytes into each row: the row's values widened once and multiplied into
// accumulators that stay in registers for the whole pass (count a constant where this is inlined).
static inline __attribute__((always_inline)) void values_64(const char *pool, const int64_t *rows, int64_t length,
                                                          int64_t row_bytes, int64_t offset, int bf16,
                                                          const float *weights, int64_t stride, int count,
                                                          float *acc) {
    __m512 a[MAX_REGISTER_HEADS][4];
    for (int h = 0; h < count; h++)
        for (int c = 0; c < 4; c++) a[h][c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < length; j++) {
        if (rows[j] < 0) continue;
        const char *v = pool + rows[j] * row_bytes + offset;
        __m512 x[4];
        for (int c = 0; c < 4; c++)
            x[c] = bf16 ? widen_bf16x16((const uint16_t *)v + 16 * c) : _mm512_loadu_ps((const float *)v + 16 * c);
        for (int h = 0; h < count; h++) {
            __m512 p = _mm512_set1_ps(weights[h * stride + j]);
            for (int c = 0; c < 4; c++) a[h][c] = _mm512_fmadd_ps(p, x[c], a[h][c]);
        }
    }
    for (int h = 0; h < count; h++)
        for (int c = 0; c < 4; c++) _mm512_storeu_ps(acc + h * 64 + 16 * c, a[h][c]);
}

// `values_64` for the query heads [h0, h1) of the call (acc and weights indexed from the call's first head), all
// reading KV head `kv`.
static void values_64_heads(const char *pool, const int64_t *rows, int64_t length, int64_t row_bytes,
                            int64_t offset, int bf16, const float *scores, int64_t h0, int64_t h1, float *acc) {
    const float *w = scores + h0 * length;
    float *a = acc + h0 * 64;
    switch (h1 - h0) {
        case 1: values_64(pool, rows, length, row_bytes, offset, bf16, w, length, 1, a); break;
        case 2: values_64(pool, rows, length, row_bytes, offset, bf16, w, length, 2, a); break;
        case 3: values_64(pool, rows, length, row_bytes, offset, bf16, w, length, 3, a); break;
        case 4: values_64(pool, rows, length, row_bytes, offset, bf16, w, length, 4, a); break;
        case 5: values_64(pool, rows, length, row_bytes, offset, bf16, w, length, 5, a); break;
        default: values_64(pool, rows, length, row_bytes, offset, bf16, w, length, 6, a); break;
    }
}
#endif

// A row, K and V, asked for ahead of its scores: its V half is read again in the second pass, from the caches.
static void prefetch_row(const char *row, int64_t bytes) {
    for (int64_t at = 0; at < bytes; at += 64) __builtin_prefetch(row + at, 0, 2);  // to L2: L1 has too few fill buffers
}

// The outputs of a request's query heads [first, last) (q and out: the request's own): 0, or 2 when its scores
// could not be allocated. Only the KV heads these read are widened.
static int attend_request(const char *pool, int pool_bf16, const int64_t *rows, int64_t length, const char *q,
                          int q_bf16, float scale, int64_t kv_heads, int64_t group, int64_t dim, int64_t first,
                          int64_t last, char *out) {
    int64_t heads = last - first, phase = first % group, kv_first = first / group;
    int64_t kv_used = (last - 1) / group + 1 - kv_first, element = pool_bf16 ? 2 : 4, q_element = q_bf16 ? 2 : 4;
    int64_t half_bytes = kv_heads * dim * element, half_values = kv_used * dim, skip = kv_first * dim * element;
    float queries[heads * dim], acc[heads * dim], keys[half_values], tile[TILE_ROWS * half_values];
    float weights[TILE_ROWS][64];
#ifdef BF16_DOTS
    int dots = pool_bf16 && q_bf16 && dim % 32 == 0;  // bfloat16 pairs straight from the query and the row
#else
    int dots = 0;
#endif
    if (!dots) widen(q + first * dim * q_element, q_bf16, heads * dim, queries);
    float *scores = malloc((size_t)(heads * length + 1) * sizeof(float));
    if (!scores) return 2;
    int64_t valid = 0;
#ifdef BF16_DOTS
    if (dots) {
        int64_t offset[heads];  // query head i's key within a row's K half, in values
        for (int64_t i = 0; i < heads; i++) offset[i] = ((phase + i) / group) * dim;
        for (int64_t j = 0; j < length; j += 4) {
            const uint16_t *key[4] = {NULL, NULL, NULL, NULL};
            int64_t count = length - j < 4 ? length - j : 4, any = 0;
            for (int64_t t = 0; t < count; t++) {
                int64_t ahead = j + t + PREFETCH_AHEAD;
                if (ahead < length && rows[ahead] >= 0) prefetch_row(pool + rows[ahead] * 2 * half_bytes, 2 * half_bytes);
                if (rows[j + t] < 0) continue;
                key[t] = (const uint16_t *)(pool + rows[j + t] * 2 * half_bytes + skip);
                any++;
            }
            valid += any;
            if (any) {
                score_four_rows((const uint16_t *)(q + first * dim * 2), key, offset, heads, dim, scale, scores, length,
                                j, count);
            } else {
                for (int64_t i = 0; i < heads; i++)
                    for (int64_t t = 0; t < count; t++) scores[i * length + j + t] = -INFINITY;
            }
        }
    }
#endif
    for (int64_t j = 0; j < length && !dots; j++) {
        if (j + PREFETCH_AHEAD < length && rows[j + PREFETCH_AHEAD] >= 0)
            prefetch_row(pool + rows[j + PREFETCH_AHEAD] * 2 * half_bytes, 2 * half_bytes);
        if (rows[j] < 0) {
            for (int64_t i = 0; i < heads; i++) scores[i * length + j] = -INFINITY;
            continue;
        }
        valid++;
        const char *key_half = pool + rows[j] * 2 * half_bytes + skip;
        widen(key_half, pool_bf16, half_values, keys);
        score_row(queries, keys, heads, group, phase, dim, scale, scores, length, j);
    }
    float inverse[heads];
    for (int64_t i = 0; i < heads; i++) inverse[i] = valid ? 1.0f / softmax_numerators(scores + i * length, length) : 0.0f;
    memset(acc, 0, sizeof acc);
#ifdef AVX512_PATHS
    if (dim == 64 && group <= MAX_REGISTER_HEADS && valid) {
        for (int64_t kv = kv_first; kv < kv_first + kv_used; kv++) {  // the call's heads that read KV head kv
            int64_t h0 = kv * group - first, h1 = (kv + 1) * group - first;
            values_64_heads(pool, rows, length, 2 * half_bytes, half_bytes + kv * dim * element, pool_bf16, scores,
                            h0 < 0 ? 0 : h0, h1 > heads ? heads : h1, acc);
        }
        valid = 0;  // the tiles below have nothing left to do
    }
#endif
    int filled = 0;
    for (int64_t j = 0; j < length && valid; j++) {
        if (rows[j] < 0) continue;
        const char *values = pool + rows[j] * 2 * half_bytes + half_bytes + skip;
        widen(values, pool_bf16, half_values, tile + filled * half_values);
        for (int64_t i = 0; i < heads; i++) weights[filled][i] = scores[i * length + j];
        if (++filled == TILE_ROWS) {
            accumulate_tile(acc, weights, tile, half_values, filled, heads, group, phase, dim);
            filled = 0;
        }
    }
    if (filled) accumulate_tile(acc, weights, tile, half_values, filled, heads, group, phase, dim);
    free(scores);
    for (int64_t i = 0; i < heads; i++) {
        for (int64_t d = 0; d < dim; d++) {
            float value = acc[i * dim + d] * inverse[i];
            if (q_bf16) ((uint16_t *)out)[(first + i) * dim + d] = float_to_bf16(value);
            else ((float *)out)[(first + i) * dim + d] = value;
        }
    }
    return 0;
}

// out [batch, kv_heads x group, dim] (q's dtype, contiguous) = softmax((q . K) scale) V over the pool rows
// rows[b, j] >= 0 (rows [batch, length]) of each request, a request without rows getting zeros. pool: rows of K then
// V ([kv_heads, dim] each), bfloat16 or float32; q: [batch, heads, dim], request b at b x q_stride values, bfloat16
// or float32. In parallel, fewer requests than threads split their heads into `threads / batch` parts (at most one
// a head). Returns 0; 1 (nothing written) when a row is outside [-1, pool_rows); 2 when memory ran out;
// 3 when the heads do not fit (more than 64 query heads or MAX_HEAD_VALUES values).
int decode_attention(const void *pool, int64_t pool_rows, int pool_bf16, const int64_t *rows, int64_t batch,
                     int64_t length, const void *q, int64_t q_stride, int q_bf16, float scale, int64_t kv_heads,
                     int64_t group, int64_t dim, void *out, int parallel) {
    if (kv_heads * group > 64 || kv_heads * group * dim > MAX_HEAD_VALUES) return 3;
    for (int64_t i = 0; i < batch * length; i++)
        if (rows[i] < -1 || rows[i] >= pool_rows) return 1;
    int64_t heads = kv_heads * group, q_element = q_bf16 ? 2 : 4, threads = parallel ? omp_get_max_threads() : 1;
    int64_t parts = batch < threads ? (threads + batch - 1) / batch : 1;
    if (parts > heads) parts = heads;
    int failed = 0;
    #pragma omp parallel for if (parallel) schedule(dynamic, 1) reduction(| : failed)
    for (int64_t item = 0; item < batch * parts; item++) {
        int64_t b = item / parts, part = item % parts;
        failed |= attend_request(pool, pool_bf16, rows + b * length, length, (const char *)q + b * q_stride * q_element,
                                 q_bf16, scale, kv_heads, group, dim, heads * part / parts, heads * (part + 1) / parts,
                                 (char *)out + b * heads * dim * q_element);
    }
    return failed;
}
