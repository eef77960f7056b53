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
 * gguf_gemm_rows / gguf_dot32x8 runs per output, in block order:
 *     acc = fma(float(dot), dw * dx, acc); acc = fma(mw, sx, acc) (Q4_1/Q5_1)
 * then y = acc + bias: the same operations in the same order, so a row gets the same bits on
 * the few-row kernel, the AVX GEMM and this one, alone or in any batch.
 * Two C tiles take blocks u and u + 1 (one tile product runs while the other's epilogue
 * does); x's rows are padded with zero rows to a multiple of 16 (their outputs not stored).
 * Tile configuration is per thread (each OpenMP thread loads it and releases the tiles).
 */
#ifndef SHUTTLE_GGUF_AMX_H
#define SHUTTLE_GGUF_AMX_H
#include <stdint.h>

#include "gguf.h"
#include "gguf_gemm.h"
#if defined(__AMX_INT8__) && defined(__AMX_TILE__) && defined(__AVX512F__) && \
    defined(GGUF_GW) && GGUF_GW == 16
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define GGUF_AMX 1
#define GGUF_AMX_ROWS 16 /* rows of x per tile; x is padded to a multiple */

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

/* tiles 0, 1: C (16 x 16 int32); 2, 3: A (16 rows of x, 32 int8); 4, 5: B (8 x 64 bytes) */
static void gguf_amx_configure(void) {
    gguf_amx_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 2; t++) {
        c.colsb[t] = 64, c.rows[t] = 16;
        c.colsb[2 + t] = 32, c.rows[2 + t] = 16;
        c.colsb[4 + t] = 64, c.rows[4 + t] = 8;
    }
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

/* block u's 16 x 16 dots (c) into the 16 rows' accumulators */
static inline __attribute__((always_inline)) void gguf_amx_epilogue(
    int has_min, const gguf_tile_unit *tu, const int32_t *c, const gguf_xq *x, const int *rr,
    int u, __m512 *acc) {
    for (int j = 0; j < 16; j++) {
        int64_t xr = (int64_t)rr[j] * x->nu + u;
        __m512 dot = _mm512_cvtepi32_ps(_mm512_load_si512((const void *)(c + 16 * j)));
        acc[j] = _mm512_fmadd_ps(dot, _mm512_mul_ps(tu->d, _mm512_set1_ps(x->d[xr])), acc[j]);
        if (has_min) acc[j] = _mm512_fmadd_ps(tu->m, _mm512_set1_ps(x->s[xr]), acc[j]);
    }
}

/* rows [r0, r0 + 16) of x (q padded with zero rows past `rows`) against the weight tile of
 * rows [o0, o0 + 16): y[r, o0 ..] for the rows below `rows` */
static inline __attribute__((always_inline)) void gguf_amx_rows(
    int has_min, const gguf_tile_unit *tile, const gguf_xq *x, int r0, int rows, int o0,
    int out, const float *bias, float *y) {
    const int nu = x->nu;
    int rr[16];
    __m512 acc[16];
    int32_t c[2][256] __attribute__((aligned(64)));
    for (int j = 0; j < 16; j++) {
        rr[j] = r0 + j < rows ? r0 + j : rows - 1;
        acc[j] = _mm512_setzero_ps();
    }
    const int8_t *xq = x->q + (int64_t)r0 * x->in;
    int u = 0;
    for (; u + 1 < nu; u += 2) {
        _tile_loadd(2, xq + 32 * u, x->in);
        _tile_loadd(4, tile[u].t, 64);
        _tile_zero(0);
        _tile_dpbssd(0, 2, 4);
        _tile_loadd(3, xq + 32 * (u + 1), x->in);
        _tile_loadd(5, tile[u + 1].t, 64);
        _tile_zero(1);
        _tile_dpbssd(1, 3, 5);
        _tile_stored(0, c[0], 64);
        gguf_amx_epilogue(has_min, tile + u, c[0], x, rr, u, acc);
        _tile_stored(1, c[1], 64);
        gguf_amx_epilogue(has_min, tile + u + 1, c[1], x, rr, u + 1, acc);
    }
    if (u < nu) {
        _tile_loadd(2, xq + 32 * u, x->in);
        _tile_loadd(4, tile[u].t, 64);
        _tile_zero(0);
        _tile_dpbssd(0, 2, 4);
        _tile_stored(0, c[0], 64);
        gguf_amx_epilogue(has_min, tile + u, c[0], x, rr, u, acc);
    }
    for (int j = 0; j < 16 && r0 + j < rows; j++) {
        float v[16];
        _mm512_storeu_ps(v, acc[j]);
        for (int i = 0; i < 16 && o0 + i < out; i++)
            y[(int64_t)(r0 + j) * out + o0 + i] = v[i] + (bias ? bias[o0 + i] : 0.f);
    }
}

/* every row of x against the weight tile of rows [o0, o0 + 16) */
static void gguf_amx_tile(int qt, const gguf_tile_unit *tile, const gguf_xq *x, int rows, int o0,
                          int out, const float *bias, float *y) {
    const int has_min = qt == GGUF_Q4_1 || qt == GGUF_Q5_1;
    for (int r0 = 0; r0 < rows; r0 += GGUF_AMX_ROWS) {
        if (has_min) gguf_amx_rows(1, tile, x, r0, rows, o0, out, bias, y);
        else gguf_amx_rows(0, tile, x, r0, rows, o0, out, bias, y);
    }
}
#else
#define GGUF_AMX 0
#endif
#endif
