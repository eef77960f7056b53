/* The GGUF GEMM of gguf_gemm.h on AMX int8 tiles (Sapphire Rapids and later): compiled where
 * the build's -march has AMX-INT8 (build.py builds for this CPU: -march=native), taken at run
 * time only once Linux has granted the process the tile state (arch_prctl
 * ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA; gguf_amx_ready). Included by gguf.c: static only.
 *
 * A 32-value GGUF block is one tile product's K: per block u, 16 rows of x (int8, the few-row
 * kernel's quantization, A: 16 x 32 bytes) against the 16 weight rows that gguf_gemm_unpack
 * already lays out as a VNNI-ordered B tile (t[g] lane i = bytes 4g..4g+3 of weight row i:
 * 8 rows of 64 bytes), `tdpbssd` into a zeroed 16 x 16 int32 tile C. Signed x against signed
 * quants (the raw quants, Q4_0/Q5_0 less their offset 8/16, Q8_0's int8), so C is exactly
 * the block's integer dot of the other two paths. C is stored and the float epilogue of
 * gguf_gemm_rows / gguf_dot_rows8 runs per output, in block order:
 *     acc = fma(float(dot), dw * dx, acc); acc = fma(mw, sx, acc) (Q4_1/Q5_1)
 * then y = acc + bias: the same operations in the same order, so a row gets the same bits on
 * the few-row kernel, the AVX GEMM and this one, alone or in any batch, on any build.
 * A pass: 32 rows of x (two A tiles) against 32 weight rows (two B tiles), four C tiles a
 * block; block u's products are issued before block u - 1's epilogue (the tiles work while
 * the vector units do). x is quantized straight into its tiles (gguf_xq.qa: 16 rows x 32
 * bytes contiguous per block), with zero rows up to a multiple of 32 (outputs not stored).
 * Tile configuration is per thread (each OpenMP thread loads it and releases the tiles).
 *
 * Where the time goes (one thread of a busy 2-core Sapphire Rapids VM, Q4_1 [576, 576] at
 * 512 rows, ~1.0 ms against the AVX-512 VNNI GEMM's ~1.3): the tile products alone ~0.65 ms,
 * the float epilogue alone ~0.95 (4 vector operations per 16 outputs and block, against
 * VNNI's 8 `vpdpbusd` more), overlapping. Tried and not faster there: the accumulators in
 * registers across 2 or 4 blocks, the buffers offset against 4K aliasing.
 */
#ifndef SHUTTLE_GGUF_AMX_H
#define SHUTTLE_GGUF_AMX_H
#include <stdint.h>

#include "gguf.h"
#include "gguf_gemm.h"
#if defined(__linux__) && defined(__AMX_INT8__) && defined(__AMX_TILE__) && \
    defined(__AVX512F__) && defined(GGUF_GW) && GGUF_GW == 16
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define GGUF_AMX 1
#define GGUF_AMX_ROWS 32 /* rows of x per pass (two A tiles); x is padded to a multiple */
#define GGUF_AMX_OUT 32  /* weight rows per pass (two B tiles) */

#define GGUF_ARCH_GET_XCOMP_PERM 0x1022
#define GGUF_ARCH_REQ_XCOMP_PERM 0x1023
#define GGUF_XFEATURE_XTILEDATA 18

/* whether this process may use the tiles: asks Linux once (the grant is process-wide) */
static int gguf_amx_ready(void) {
    static int state; /* 0 not asked, 1 granted, -1 refused */
    int s = __atomic_load_n(&state, __ATOMIC_ACQUIRE);
    if (s == 0) {
        unsigned long bits = 0;
        s = syscall(SYS_arch_prctl, GGUF_ARCH_REQ_XCOMP_PERM, GGUF_XFEATURE_XTILEDATA) == 0 &&
                    syscall(SYS_arch_prctl, GGUF_ARCH_GET_XCOMP_PERM, &bits) == 0 &&
                    (bits >> GGUF_XFEATURE_XTILEDATA & 1)
                ? 1
                : -1;
        __atomic_store_n(&state, s, __ATOMIC_RELEASE);
    }
    return s == 1;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} gguf_amx_config;

/* tiles 0-3: C (16 x 16 int32); 4, 5: A (16 rows of x, 32 int8); 6, 7: B (8 x 64 bytes) */
static void gguf_amx_configure(void) {
    gguf_amx_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 4; t++) c.colsb[t] = 64, c.rows[t] = 16;
    for (int t = 4; t < 6; t++) c.colsb[t] = 32, c.rows[t] = 16;
    for (int t = 6; t < 8; t++) c.colsb[t] = 64, c.rows[t] = 8;
    _tile_loadconfig(&c);
}

/* Q4_0/Q5_0's offset taken off the unpacked quants (signed bytes from here on) */
static void gguf_amx_offset(int qt, gguf_tile_unit *tile, int nu) {
    const int off = qt == GGUF_Q4_0 ? 8 : qt == GGUF_Q5_0 ? 16 : 0;
    if (!off) return;
    for (int u = 0; u < nu; u++)
        for (int g = 0; g < 8; g++)
            tile[u].t[g] = _mm512_sub_epi8(tile[u].t[g], _mm512_set1_epi8((char)off));
}

/* block u's dots c[a * 2 + b] (x rows 16a.., weight tile b) into the accumulators
 * acc[32 rows][32 outputs] */
static inline __attribute__((always_inline)) void gguf_amx_epilogue(
    int has_min, const gguf_tile_unit *t0, const gguf_tile_unit *t1, const int32_t *c,
    const gguf_xq *x, const int *rr, int u, float *acc) {
    for (int a = 0; a < 2; a++)
        for (int j = 0; j < 16; j++) {
            int64_t xr = (int64_t)rr[16 * a + j] * x->nu + u;
            __m512 dx = _mm512_set1_ps(x->d[xr]), sx = _mm512_set1_ps(x->s[xr]);
            for (int b = 0; b < 2; b++) {
                const gguf_tile_unit *tu = b ? t1 : t0;
                float *ac = acc + (16 * a + j) * 32 + 16 * b;
                __m512 dot = _mm512_cvtepi32_ps(
                    _mm512_load_si512((const void *)(c + 256 * (2 * a + b) + 16 * j)));
                __m512 v = _mm512_fmadd_ps(dot, _mm512_mul_ps(tu->d, dx), _mm512_load_ps(ac));
                if (has_min) v = _mm512_fmadd_ps(tu->m, sx, v);
                _mm512_store_ps(ac, v);
            }
        }
}

/* block u's four tile products: x rows [16a, 16a + 16) (AMX tiles from xa) against weight
 * tile b, into c[2a + b] */
static inline __attribute__((always_inline)) void gguf_amx_products(
    const int8_t *xa, int64_t in, const gguf_tile_unit *t0, const gguf_tile_unit *t1, int u,
    int32_t *c) {
    _tile_loadd(4, xa + 512 * u, 32);
    _tile_loadd(5, xa + 16 * in + 512 * u, 32);
    _tile_loadd(6, t0[u].t, 64);
    _tile_loadd(7, t1[u].t, 64);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    _tile_dpbssd(0, 4, 6);
    _tile_dpbssd(1, 4, 7);
    _tile_dpbssd(2, 5, 6);
    _tile_dpbssd(3, 5, 7);
    _tile_stored(0, c, 64);
    _tile_stored(1, c + 256, 64);
    _tile_stored(2, c + 512, 64);
    _tile_stored(3, c + 768, 64);
}

/* rows [r0, r0 + 32) of x (q padded with zero rows past `rows`) against the weight tiles t0
 * (rows [o0, o0 + 16)) and t1 (the next 16): y[r, o0 .. o0 + 32) for r < rows, o < out */
static inline __attribute__((always_inline)) void gguf_amx_rows(
    int has_min, const gguf_tile_unit *t0, const gguf_tile_unit *t1, const gguf_xq *x, int r0,
    int rows, int o0, int out, const float *bias, float *y) {
    const int nu = x->nu;
    int rr[32];
    float acc[32 * 32] __attribute__((aligned(64)));
    int32_t c[2][1024] __attribute__((aligned(64)));
    for (int j = 0; j < 32; j++) rr[j] = r0 + j < rows ? r0 + j : rows - 1;
    memset(acc, 0, sizeof acc);
    const int8_t *xa = x->qa + (int64_t)r0 * x->in;
    /* block u's tile products issued before block u - 1's epilogue: the tiles work while the
     * vector units do */
    gguf_amx_products(xa, x->in, t0, t1, 0, c[0]);
    for (int u = 1; u < nu; u++) {
        gguf_amx_products(xa, x->in, t0, t1, u, c[u & 1]);
        gguf_amx_epilogue(has_min, t0 + u - 1, t1 + u - 1, c[(u - 1) & 1], x, rr, u - 1, acc);
    }
    gguf_amx_epilogue(has_min, t0 + nu - 1, t1 + nu - 1, c[(nu - 1) & 1], x, rr, nu - 1, acc);
    for (int j = 0; j < 32 && r0 + j < rows; j++)
        for (int i = 0; i < 32 && o0 + i < out; i++)
            y[(int64_t)(r0 + j) * out + o0 + i] = acc[32 * j + i] + (bias ? bias[o0 + i] : 0.f);
}

/* every row of x against the weight tiles t0, t1 of rows [o0, o0 + 32) */
static void gguf_amx_tile(int qt, const gguf_tile_unit *t0, const gguf_tile_unit *t1,
                          const gguf_xq *x, int rows, int o0, int out, const float *bias,
                          float *y) {
    const int has_min = qt == GGUF_Q4_1 || qt == GGUF_Q5_1;
    for (int r0 = 0; r0 < rows; r0 += GGUF_AMX_ROWS) {
        if (has_min) gguf_amx_rows(1, t0, t1, x, r0, rows, o0, out, bias, y);
        else gguf_amx_rows(0, t0, t1, x, r0, rows, o0, out, bias, y);
    }
}
#else
#define GGUF_AMX 0
#endif
#endif
