// Causal attention of a prompt chunk over its context: bfloat16 Q, K, V, head dim 64, its products in AMX tiles
// where gcc targets AMX (-march=native on such a CPU), else in AVX512-BF16 dot products. Built and loaded by
// prompt_attention_cpu.py, which says what it computes and why it is shaped so.
//
// Per (query head, 16 queries): QK^T of 32 keys at a time (K packed per KV head as [16-key block][dim pair][16
// keys][2]: an AMX B tile, or one vector of 16 keys' dim pair), the scores of up to KB keys stored, then softmaxed
// online in AVX-512: a pass for each row's maximum, the 16 rows' rescale factors in one vector, a pass for P =
// 2^(score x scale log2 e - top) (masked to each row's keys), P in bfloat16, V packed as [key pair][dim][2], the
// outputs accumulated in float32 (four C tiles of 16 dims, or registers). Per block of KB keys the work outside
// the passes is fixed, so KB is as large as keeps s and p in the L1 and L2 caches.

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "bfloat16.h"
#include "exp_nonpositive.h"
#include "thread_buffer.h"

#define D 64     // head dim
#define KB 512   // keys whose scores are softmaxed together
#define ROWS 16  // queries a work item

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

// The process's permission to use AMX tile data (Linux asks for it once): 0 when granted.
int amx_permit(void) { return (int)syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); }
static inline void release_tiles(void) { _tile_release(); }

typedef struct __attribute__((packed)) {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

static void configure_tiles(void) {  // eight tiles of 16 rows x 64 bytes
    TileConfig c;
    memset(&c, 0, sizeof c);
    c.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        c.rows[t] = 16;
        c.colsb[t] = 64;
    }
    __asm__ volatile("" : : "r"(&c) : "memory");  // gcc 12 drops the stores above without it
    _tile_loadconfig(&c);
}

// s[r][0..32) = the 16 queries' (rows of `queries`, [16][64]) products with the 32 keys of `block` (two 16-key
// blocks of packed K); s's rows KB floats apart.
static inline void score_32_keys(const uint16_t *queries, const uint16_t *block, float *s) {
    _tile_loadd(0, queries, D * 2);
    _tile_loadd(1, queries + 32, D * 2);
    _tile_zero(2);
    _tile_loadd(4, block, 64);
    _tile_loadd(5, block + 16 * 32, 64);
    _tile_dpbf16ps(2, 0, 4);
    _tile_dpbf16ps(2, 1, 5);
    _tile_stored(2, s, KB * 4);
    _tile_zero(3);
    _tile_loadd(4, block + 32 * 32, 64);  // the next 16 keys (zero past S: `padded` keys are packed)
    _tile_loadd(5, block + 32 * 32 + 16 * 32, 64);
    _tile_dpbf16ps(3, 0, 4);
    _tile_dpbf16ps(3, 1, 5);
    _tile_stored(3, s + 16, KB * 4);
}

// o [16][64] (float32; zeros first when `fresh`) += p [16][width] (bfloat16, rows KB apart) x the packed values
// of those keys (`values`: [key pair][64][2]); width a multiple of 32.
static inline void accumulate_values(const uint16_t *p, const uint16_t *values, int64_t width, float *o, int fresh) {
    if (fresh) {
        _tile_zero(4);
        _tile_zero(5);
        _tile_zero(6);
        _tile_zero(7);
    } else {
        _tile_loadd(4, o, D * 4);
        _tile_loadd(5, o + 16, D * 4);
        _tile_loadd(6, o + 32, D * 4);
        _tile_loadd(7, o + 48, D * 4);
    }
    for (int64_t c = 0; c < width; c += 32) {
        const uint16_t *at = values + (c / 2) * D * 2;
        _tile_loadd(0, p + c, KB * 2);
        _tile_loadd(1, at, D * 2 * 2);
        _tile_dpbf16ps(4, 0, 1);
        _tile_loadd(1, at + 32, D * 2 * 2);
        _tile_dpbf16ps(5, 0, 1);
        _tile_loadd(1, at + 64, D * 2 * 2);
        _tile_dpbf16ps(6, 0, 1);
        _tile_loadd(1, at + 96, D * 2 * 2);
        _tile_dpbf16ps(7, 0, 1);
    }
    _tile_stored(4, o, D * 4);
    _tile_stored(5, o + 16, D * 4);
    _tile_stored(6, o + 32, D * 4);
    _tile_stored(7, o + 48, D * 4);
}
#else
int amx_permit(void) { return 0; }  // no tiles here: nothing to ask Linux for
static inline void configure_tiles(void) {}
static inline void release_tiles(void) {}

static inline __m512bh pair_of(const uint16_t *at) { return (__m512bh)_mm512_set1_epi32(*(const int32_t *)at); }

// As the AMX path's, in vdpbf16ps: 8 queries x 32 keys in 16 accumulators, a dim pair at a time (each query's
// pair broadcast against two vectors of 16 keys' pair).
static inline void score_32_keys(const uint16_t *queries, const uint16_t *block, float *s) {
    for (int r0 = 0; r0 < ROWS; r0 += 8) {
        __m512 acc[8][2];
        for (int r = 0; r < 8; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
        for (int pair = 0; pair < D / 2; pair++) {
            __m512bh k0 = (__m512bh)_mm512_loadu_si512(block + pair * 32);
            __m512bh k1 = (__m512bh)_mm512_loadu_si512(block + 32 * 32 + pair * 32);
            for (int r = 0; r < 8; r++) {
                __m512bh qr = pair_of(queries + (r0 + r) * D + 2 * pair);
                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], qr, k0);
                acc[r][1] = _mm512_dpbf16_ps(acc[r][1], qr, k1);
            }
        }
        for (int r = 0; r < 8; r++) {
            _mm512_store_ps(s + (r0 + r) * KB, acc[r][0]);
            _mm512_store_ps(s + (r0 + r) * KB + 16, acc[r][1]);
        }
    }
}

// As the AMX path's: 4 rows x 64 dims in 16 accumulators, a key pair at a time (each row's P pair broadcast
// against the pair's four vectors of 16 dims).
static inline void accumulate_values(const uint16_t *p, const uint16_t *values, int64_t width, float *o, int fresh) {
    for (int r0 = 0; r0 < ROWS; r0 += 4) {
        __m512 acc[4][4];
        for (int r = 0; r < 4; r++)
            for (int d = 0; d < 4; d++)
                acc[r][d] = fresh ? _mm512_setzero_ps() : _mm512_load_ps(o + (r0 + r) * D + 16 * d);
        for (int64_t c = 0; c < width; c += 2) {
            const uint16_t *at = values + (c / 2) * D * 2;
            __m512bh v[4];
            for (int d = 0; d < 4; d++) v[d] = (__m512bh)_mm512_loadu_si512(at + 32 * d);
            for (int r = 0; r < 4; r++) {
                __m512bh pr = pair_of(p + (r0 + r) * KB + c);
                for (int d = 0; d < 4; d++) acc[r][d] = _mm512_dpbf16_ps(acc[r][d], pr, v[d]);
            }
        }
        for (int r = 0; r < 4; r++)
            for (int d = 0; d < 4; d++) _mm512_store_ps(o + (r0 + r) * D + 16 * d, acc[r][d]);
    }
}
#endif

// The first `open` of 16 lanes (none when open <= 0, all from 16).
static inline __mmask16 first_lanes(int64_t open) {
    return open >= 16 ? 0xFFFF : open > 0 ? (__mmask16)((1u << open) - 1) : 0;
}

// 2^y for y <= 0 to 4.2e-5 (P is rounded to bfloat16's 8 bits; the degree-6 polynomial costs two more FMAs a
// vector); -inf, clamped at -160, exactly 0.
static inline __m512 exp2_nonpositive16(__m512 y) { return exp2_16(_mm512_max_ps(y, _mm512_set1_ps(-160.0f)), 4); }

// One work item: query head h's queries [i0, i0 + 16) (rows past T computed on zeros and dropped).
static void attend_block(const uint16_t *q, const uint16_t *kt, const uint16_t *vv, int64_t T, int64_t S,
                         int64_t heads, int64_t h, int64_t i0, float scale, uint16_t *out) {
    float s[ROWS * KB] __attribute__((aligned(64)));
    uint16_t p[ROWS * KB] __attribute__((aligned(64)));
    float o[ROWS * D] __attribute__((aligned(64)));
    uint16_t queries[ROWS * D] __attribute__((aligned(64)));
    float top[ROWS] __attribute__((aligned(64))), total[ROWS] __attribute__((aligned(64)));
    int64_t rows = T - i0 < ROWS ? T - i0 : ROWS;
    memset(queries, 0, sizeof queries);
    for (int64_t r = 0; r < rows; r++) memcpy(queries + r * D, q + ((i0 + r) * heads + h) * D, D * 2);
    for (int r = 0; r < ROWS; r++) {
        top[r] = -INFINITY;
        total[r] = 0.0f;
    }
    int64_t offset = S - T;  // query i sits at position offset + i and sees keys 0 .. offset + i
    int64_t last = offset + i0 + rows - 1;
    const __m512 to_log2 = _mm512_set1_ps(scale * LOG2_E), minus_inf = _mm512_set1_ps(-INFINITY);
    for (int64_t j0 = 0; j0 <= last; j0 += KB) {
        int64_t width = 0;
        for (int64_t jb = j0; jb < j0 + KB && jb <= last; jb += 32, width += 32)
            score_32_keys(queries, kt + (jb / 16) * 32 * 16 * 2, s + (jb - j0));
        // each row sees the block's keys [0, open): open = its position - j0 + 1 (rows past T repeat the last)
        float block_top[ROWS] __attribute__((aligned(64))), block_sum[ROWS] __attribute__((aligned(64)));
        float alpha[ROWS] __attribute__((aligned(64)));
        for (int r = 0; r < ROWS; r++) {
            const float *row = s + r * KB;
            int64_t open = offset + i0 + (r < rows ? r : rows - 1) - j0 + 1;
            __m512 best0 = minus_inf, best1 = minus_inf;  // two chains of maxima
            for (int64_t c = 0; c < width; c += 32) {
                best0 = _mm512_mask_max_ps(best0, first_lanes(open - c), best0, _mm512_load_ps(row + c));
                best1 = _mm512_mask_max_ps(best1, first_lanes(open - c - 16), best1, _mm512_load_ps(row + c + 16));
            }
            block_top[r] = _mm512_reduce_max_ps(_mm512_max_ps(best0, best1)) * scale;
        }
        __m512 old_top = _mm512_load_ps(top), new_top = _mm512_max_ps(old_top, _mm512_load_ps(block_top));
        _mm512_store_ps(alpha, exp2_nonpositive16(_mm512_mul_ps(_mm512_sub_ps(old_top, new_top),
                                                                _mm512_set1_ps(LOG2_E))));  // 0 at first
        _mm512_store_ps(top, new_top);
        for (int r = 0; r < ROWS; r++) {
            const float *row = s + r * KB;
            int64_t open = offset + i0 + (r < rows ? r : rows - 1) - j0 + 1;
            __m512 shift = _mm512_set1_ps(top[r] * LOG2_E), sum0 = _mm512_setzero_ps(), sum1 = _mm512_setzero_ps();
            for (int64_t c = 0; c < width; c += 32) {
                __m512 a = _mm512_maskz_mov_ps(first_lanes(open - c), exp2_nonpositive16(
                    _mm512_fmsub_ps(_mm512_load_ps(row + c), to_log2, shift)));
                __m512 b = _mm512_maskz_mov_ps(first_lanes(open - c - 16), exp2_nonpositive16(
                    _mm512_fmsub_ps(_mm512_load_ps(row + c + 16), to_log2, shift)));
                sum0 = _mm512_add_ps(sum0, a);
                sum1 = _mm512_add_ps(sum1, b);
                _mm512_store_si512((__m512i *)(p + r * KB + c), (__m512i)_mm512_cvtne2ps_pbh(b, a));
            }
            block_sum[r] = _mm512_reduce_add_ps(_mm512_add_ps(sum0, sum1));
            if (j0 > 0) {
                __m512 by = _mm512_set1_ps(alpha[r]);
                for (int d = 0; d < D; d += 16)
                    _mm512_store_ps(o + r * D + d, _mm512_mul_ps(_mm512_load_ps(o + r * D + d), by));
            }
        }
        _mm512_store_ps(total, _mm512_fmadd_ps(_mm512_load_ps(total), _mm512_load_ps(alpha),
                                               _mm512_load_ps(block_sum)));
        accumulate_values(p, vv + (j0 / 2) * D * 2, width, o, j0 == 0);
    }
    for (int64_t r = 0; r < rows; r++) {
        float inverse = 1.0f / total[r];
        uint16_t *at = out + ((i0 + r) * heads + h) * D;
        for (int d = 0; d < D; d++) at[d] = float_to_bf16(o[r * D + d] * inverse);
    }
}

// out [T, Hq, 64] (bfloat16) = softmax(q K^T scale, causal) V for q [T, Hq, 64], the last T of S positions, whose
// K and V are the pool rows slots[0..S) (a row: K then V, [kv_heads, 64] each, bfloat16); query head h reads KV
// head h / group. Returns 0; 1 (nothing written) when a slot is outside [0, pool_rows); -1 when memory ran out.
int prompt_attention(const uint16_t *q, const uint16_t *pool, int64_t pool_rows, const int64_t *slots, int64_t T,
                     int64_t S, int64_t kv_heads, int64_t group, float scale, uint16_t *out, int parallel) {
    for (int64_t j = 0; j < S; j++)
        if (slots[j] < 0 || slots[j] >= pool_rows) return 1;
    int64_t heads = kv_heads * group, padded = (S + 31) / 32 * 32 + 32;  // whole 32-key blocks, and one more
    size_t per_head = (size_t)padded * D, bytes = 2 * kv_heads * per_head * sizeof(uint16_t);
    static __thread void *packed;  // the calling thread's (`thread_buffer`): a megabyte at 1.5k keys
    static __thread size_t packed_bytes;
    uint16_t *kt = thread_buffer(&packed, &packed_bytes, bytes);
    if (!kt) return -1;
    uint16_t *vv = kt + kv_heads * per_head;
    for (int64_t g = 0; g < kv_heads; g++) {  // the keys past S are zeros: scores of 0, masked, and no V
        memset(kt + g * per_head + (S / 16) * 16 * D, 0, (per_head - (S / 16) * 16 * D) * sizeof(uint16_t));
        memset(vv + g * per_head + (S / 2) * 2 * D, 0, (per_head - (S / 2) * 2 * D) * sizeof(uint16_t));
    }
    int64_t blocks = (T + ROWS - 1) / ROWS;
    #pragma omp parallel if (parallel)
    {
        #pragma omp for schedule(static)
        for (int64_t j = 0; j < S; j++) {
            const uint16_t *row = pool + slots[j] * 2 * kv_heads * D;
            for (int64_t g = 0; g < kv_heads; g++) {
                uint32_t *keys = (uint32_t *)(kt + g * per_head);  // dim pairs as uint32: [j / 16][pair][j % 16]
                const uint32_t *key = (const uint32_t *)(row + g * D);
                for (int pair = 0; pair < D / 2; pair++) keys[((j / 16) * (D / 2) + pair) * 16 + j % 16] = key[pair];
                uint16_t *values = vv + g * per_head;  // [j / 2][d][j % 2]
                const uint16_t *value = row + (kv_heads + g) * D;
                for (int d = 0; d < D; d++) values[((j / 2) * D + d) * 2 + j % 2] = value[d];
            }
        }  // the loop's end is a barrier: every row is packed before any block reads them
        configure_tiles();
        #pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < heads * blocks; item++) {
            int64_t h = item % heads, i0 = (item / heads) * ROWS;
            attend_block(q, kt + (h / group) * per_head, vv + (h / group) * per_head, T, S, heads, h, i0, scale, out);
        }
        release_tiles();
    }
    return 0;
}
