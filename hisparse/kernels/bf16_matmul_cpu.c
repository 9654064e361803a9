// x [B, K] @ W.T -> [B, N], x, W [N, K] and the output bfloat16: AVX512-BF16 dot products over a layout of W
// that streams. Built and loaded by bf16_matmul_cpu.py, which writes the layout.
//
// vdpbf16ps adds to each of 16 float32 lanes the products of two bfloat16 pairs. Rows of W go in groups of 16, one
// per lane (the last group padded with zero rows): for each pair of inputs (2p, 2p + 1), one 64-byte vector holds the
// pair of every row of the group, so a group is K / 2 vectors read in order, and a broadcast of x's pair multiplies
// all 16 rows at once. A tile is G groups by B rows of x, G x B accumulators in registers: each weight vector is
// loaded once per tile and each broadcast serves G groups. Every output's sum runs over the pairs in order in one
// accumulator whatever the tile, so a row of x gets the same bits at any batch size. Sums are float32 (vdpbf16ps
// flushes denormals); the output is rounded by vcvtneps2bf16, to the nearest even as PyTorch rounds.

#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#define ROWS 16            // rows of W per group: one per float32 lane
#define PREFETCH 2048      // bytes ahead in a group's stream: the hardware prefetcher alone lags at small batches
#define MAX_TILE 16        // accumulators a tile keeps (G x B)

// Groups group .. group + G - 1 of W for rows first .. first + B - 1 of x (G and B constants after inlining).
static inline __attribute__((always_inline)) void tile(int G, int B, const uint16_t *x, int64_t in_features,
                                                       const uint16_t *w, int64_t group, int64_t first,
                                                       int64_t out_features, uint16_t *out) {
    __m512 acc[MAX_TILE];
    for (int i = 0; i < G * B; i++) acc[i] = _mm512_setzero_ps();
    const int64_t pairs = in_features / 2;
    const uint16_t *stream = w + group * pairs * 2 * ROWS;
    const uint16_t *xs = x + first * in_features;
    for (int64_t p = 0; p < pairs; p++) {
        __m512bh wv[4];
        for (int g = 0; g < G; g++) {
            const uint16_t *at = stream + (g * pairs + p) * 2 * ROWS;
            _mm_prefetch((const char *)at + PREFETCH, _MM_HINT_T0);
            wv[g] = (__m512bh)_mm512_loadu_si512(at);
        }
        for (int b = 0; b < B; b++) {
            int32_t pair;
            memcpy(&pair, xs + b * in_features + 2 * p, sizeof pair);
            __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
            for (int g = 0; g < G; g++) acc[g * B + b] = _mm512_dpbf16_ps(acc[g * B + b], wv[g], xv);
        }
    }
    for (int g = 0; g < G; g++) {
        const int64_t column = (group + g) * ROWS, left = out_features - column;
        const __mmask16 valid = left >= ROWS ? 0xFFFF : (__mmask16)((1u << left) - 1);  // the padded group's real rows
        for (int b = 0; b < B; b++)
            _mm256_mask_storeu_epi16(out + (first + b) * out_features + column, valid,
                                     (__m256i)_mm512_cvtneps_pbh(acc[g * B + b]));
    }
}

// Groups group .. group + G - 1 (G is 4 or 1) for every row of x: eight rows a pass (two tiles of two groups when
// G is 4), then the rows left in one pass (four groups a tile up to four rows: each broadcast serves four vectors).
// The groups' weights, a few tens of KB, stay in the core's cache from the first pass on.
static inline __attribute__((always_inline)) void groups_for_all_rows(int G, const uint16_t *x, int64_t batch,
                                                                      int64_t in_features, const uint16_t *w,
                                                                      int64_t group, int64_t out_features,
                                                                      uint16_t *out) {
#define TILE(g, b, at) tile(g, b, x, in_features, w, at, first, out_features, out)
#define HALVES(b) (G == 4 ? (TILE(2, b, group), TILE(2, b, group + 2)) : TILE(1, b, group))
    int64_t first = 0;
    for (; batch - first >= 8; first += 8) HALVES(8);
    switch (batch - first) {
        case 1: TILE(G, 1, group); break;
        case 2: TILE(G, 2, group); break;
        case 3: TILE(G, 3, group); break;
        case 4: TILE(G, 4, group); break;
        case 5: HALVES(5); break;
        case 6: HALVES(6); break;
        case 7: HALVES(7); break;
        default: break;
    }
#undef HALVES
#undef TILE
}

// w: (N + 15) / 16 groups of K / 2 vectors. Returns 0, or -1 (nothing done) for an odd K or a negative size.
int bf16_matmul(const uint16_t *x, int64_t batch, int64_t in_features, const uint16_t *w, int64_t out_features,
                uint16_t *out, int parallel) {
    if (in_features % 2 || batch < 0 || out_features < 0) return -1;
    const int64_t groups = (out_features + ROWS - 1) / ROWS;
    // Each thread takes a contiguous share of the groups (whole tiles of four would leave one a tile short).
    #pragma omp parallel if (parallel)
    {
        const int64_t threads = omp_get_num_threads(), thread = omp_get_thread_num();
        const int64_t hi = groups * (thread + 1) / threads;
        int64_t group = groups * thread / threads;
        for (; group + 4 <= hi; group += 4) groups_for_all_rows(4, x, batch, in_features, w, group, out_features, out);
        for (; group < hi; group++) groups_for_all_rows(1, x, batch, in_features, w, group, out_features, out);
    }
    return 0;
}
