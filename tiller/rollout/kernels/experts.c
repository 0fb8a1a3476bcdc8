/* A mixture-of-experts block's expert matmuls for tiller's native engine on CPU (tiller.rollout.packed_experts).

   The caller sorts a block's (token, slot) pairs by expert: x holds their rows [S, H] in that order, expert e's at
   rows [off[e], off[e + 1]). For each expert e of [e0, e1) and each of its rows r:
       gu = x[r] W13_e^T                         W13_e [2I, H]: gate rows then up rows
       a  = silu(gu[:I]) * gu[I:]
       y[dest[r]] = weight[r] * (a W2_e^T)       W2_e [H, I]
   Accumulation is in fp32 and y is fp32; the caller sums each token's slots.

   Weights are packed once per weight sync into panels of 16 output columns, each panel K-major:
   W [N, K] -> P [N / 16][K][16] (P[n][k][j] = W[16 n + j][k]), so a register tile of up to MR rows x 32 columns
   streams two panels front to back: per k, two 16-wide weight loads and 2 x MR fused multiply-adds against each row's
   broadcast x[r][k]. A panel pair (2 x K x 16 x 4 bytes, 64 KiB at K = 512) stays in L2 while every row tile of
   the expert runs over it, so the weights are read from memory once per call whatever the row count, and each
   output element is summed over k in order: a row's result does not depend on the others. Panels are prefetched PF
   k-steps ahead: a decode step's experts are read from DRAM with few rows each, where the hardware prefetchers alone
   leave the loads waiting. bf16: widened to fp32 on load, or, with AVX512-BF16, panels of k pairs multiplied by its
   dot-product instruction (below).

   Compiled at run time by tiller.rollout.packed_experts with -O3 -march=native -ffast-math (a vectorised expf from
   libmvec); GCC / clang vector extensions: 512-bit vectors with AVX-512, else 256-bit ones and a smaller MR, which
   keep the tile in registers. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#define VW 16  /* floats per vector register */
#define MR 8
#else
#define VW 8
#define MR 2
#endif
typedef float vf __attribute__((vector_size(VW * 4)));
typedef uint16_t vh __attribute__((vector_size(VW * 2)));
typedef uint32_t vu __attribute__((vector_size(VW * 4)));
#define PV (16 / VW)  /* vectors per panel row */
#define PF 24

static inline vf wload_f32(const float* p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline vf wload_bf16(const uint16_t* p) {
    vh h; memcpy(&h, p, sizeof h);
    vu u = __builtin_convertvector(h, vu) << 16;
    vf v; memcpy(&v, &u, sizeof v); return v;
}
static inline float xload_f32(const float* p) { return *p; }
static inline float xload_bf16(const uint16_t* p) {
    uint32_t u = (uint32_t)*p << 16;
    float f; memcpy(&f, &u, 4); return f;
}
static inline void vstore(float* p, vf v) { memcpy(p, &v, sizeof v); }

/* out[m][0:16 np] = x[m] . panels (np = 1 or 2 panels of 16 columns), for mr rows (a compile-time constant where
   inlined from the dispatch below). */
#define DEFINE_TILE(NAME, XT, XLOAD, WT, WLOAD)                                                                    \
static inline __attribute__((always_inline)) void NAME(const int mr, const int np, const XT* x, int64_t ldx,       \
                                                        const WT* p0, int64_t K, float* out, int64_t ldo) {       \
    vf acc[MR][2 * PV];                                                                                          \
    const int nv = np * PV;                                                                                      \
    for (int m = 0; m < mr; ++m)                                                                                 \
        for (int j = 0; j < nv; ++j) acc[m][j] = (vf){0};                                                        \
    const WT* p1 = p0 + K * 16;                                                                                  \
    for (int64_t k = 0; k < K; ++k) {                                                                            \
        __builtin_prefetch(p0 + (k + PF) * 16, 0, 1);                                                             \
        if (np == 2) __builtin_prefetch(p1 + (k + PF) * 16, 0, 1);                                                \
        vf w[2 * PV];                                                                                            \
        for (int j = 0; j < nv; ++j) w[j] = WLOAD((j < PV ? p0 : p1) + k * 16 + (j % PV) * VW);                  \
        for (int m = 0; m < mr; ++m) {                                                                           \
            vf xv = (vf){0} + XLOAD(x + m * ldx + k);                                                            \
            for (int j = 0; j < nv; ++j) acc[m][j] += xv * w[j];                                                 \
        }                                                                                                        \
    }                                                                                                            \
    for (int m = 0; m < mr; ++m)                                                                                 \
        for (int j = 0; j < nv; ++j) vstore(out + m * ldo + j * VW, acc[m][j]);                                  \
}

/* out [rows, N] = x [rows, K] . P^T, P the packed [N / 16][K][16]: panel pairs outermost (each read from memory
   once), row tiles of MR inside. */
#define DEFINE_GEMM(NAME, XT, WT)                                                                                 \
static void NAME##_gemm(const XT* x, int64_t ldx, int64_t rows, const WT* P, int64_t K, int64_t N, float* out,   \
                        int64_t ldo) {                                                                           \
    const int64_t panels = N / 16;                                                                               \
    for (int64_t n = 0; n < panels; n += 2) {                                                                    \
        const WT* p = P + n * K * 16;                                                                            \
        for (int64_t r = 0; r < rows; r += MR) {                                                                 \
            const int mr = rows - r < MR ? (int)(rows - r) : MR;                                                 \
            const XT* xr = x + r * ldx;                                                                          \
            float* o = out + r * ldo + n * 16;                                                                   \
            if (n + 1 < panels) {                                                                                \
                switch (mr) {                                                                                    \
                    case 1: NAME(1, 2, xr, ldx, p, K, o, ldo); break;                                            \
                    case 2: NAME(2, 2, xr, ldx, p, K, o, ldo); break;                                            \
                    TILE_CASES(NAME, 2, xr, ldx, p, K, o, ldo)                                                   \
                }                                                                                                \
            } else {                                                                                             \
                switch (mr) {                                                                                    \
                    case 1: NAME(1, 1, xr, ldx, p, K, o, ldo); break;                                            \
                    case 2: NAME(2, 1, xr, ldx, p, K, o, ldo); break;                                            \
                    TILE_CASES(NAME, 1, xr, ldx, p, K, o, ldo)                                                   \
                }                                                                                                \
            }                                                                                                    \
        }                                                                                                        \
    }                                                                                                            \
}

#if MR == 8
#define TILE_CASES(NAME, ...)                                                                                     \
    case 3: NAME(3, __VA_ARGS__); break; case 4: NAME(4, __VA_ARGS__); break;                                     \
    case 5: NAME(5, __VA_ARGS__); break; case 6: NAME(6, __VA_ARGS__); break;                                     \
    case 7: NAME(7, __VA_ARGS__); break; case 8: NAME(8, __VA_ARGS__); break;
#else
#define TILE_CASES(NAME, ...)
#endif

DEFINE_TILE(tile_ff, float, xload_f32, float, wload_f32)
DEFINE_GEMM(tile_ff, float, float)
DEFINE_TILE(tile_hh, uint16_t, xload_bf16, uint16_t, wload_bf16)
DEFINE_GEMM(tile_hh, uint16_t, uint16_t)
DEFINE_TILE(tile_fh, float, xload_f32, uint16_t, wload_bf16)
DEFINE_GEMM(tile_fh, float, uint16_t)

/* bf16 with AVX512-BF16's dot-product instruction (where the compiler targets it): the panels hold pairs of
   consecutive k, P [N / 16][K / 2][16][2], so one 64-byte load is 16 columns x 2 k and one VDPBF16PS adds both
   products per column in fp32 (exact products, half the instructions of widening each weight). Its inputs are bf16:
   the down matmul's activations are rounded to bf16 first, as transformers' bf16 experts round them. */
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define PAIRS 1
static inline __attribute__((always_inline)) void tile_dp(const int mr, const int np, const uint16_t* x, int64_t ldx,
                                                           const uint16_t* p0, int64_t K, float* out, int64_t ldo) {
    __m512 acc[MR][2];
    for (int m = 0; m < mr; ++m) { acc[m][0] = _mm512_setzero_ps(); acc[m][1] = _mm512_setzero_ps(); }
    const uint16_t* p1 = p0 + K * 16;
    for (int64_t k = 0; k < K; k += 2) {
        __builtin_prefetch(p0 + (k + 2 * PF) * 16, 0, 1);
        __m512bh a = (__m512bh)_mm512_loadu_si512(p0 + k * 16), b = a;
        if (np == 2) {
            __builtin_prefetch(p1 + (k + 2 * PF) * 16, 0, 1);
            b = (__m512bh)_mm512_loadu_si512(p1 + k * 16);
        }
        for (int m = 0; m < mr; ++m) {
            uint32_t pair; memcpy(&pair, x + m * ldx + k, 4);
            __m512bh xv = (__m512bh)_mm512_set1_epi32((int)pair);
            acc[m][0] = _mm512_dpbf16_ps(acc[m][0], xv, a);
            if (np == 2) acc[m][1] = _mm512_dpbf16_ps(acc[m][1], xv, b);
        }
    }
    for (int m = 0; m < mr; ++m) {
        _mm512_storeu_ps(out + m * ldo, acc[m][0]);
        if (np == 2) _mm512_storeu_ps(out + m * ldo + 16, acc[m][1]);
    }
}
DEFINE_GEMM(tile_dp, uint16_t, uint16_t)
#else
#define PAIRS 0
#endif

/* 1 where the bf16 panels hold k pairs ([N / 16][K / 2][16][2], the packing the caller must use), 0 otherwise. */
int experts_bf16_pairs(void) { return PAIRS; }

/* a[r][i] = silu(g) * u over gu [rows, 2I] (gate, up), written over the gate half (row stride 2I). exp's argument is
   capped at 80 (exp(80) ~ 5.5e34, finite): -ffast-math assumes no infinities, and an overflowed exp of a gate below
   -88 gave NaN where silu is -0. */
static void silu_mul(float* gu, int64_t rows, int64_t I) {
    for (int64_t r = 0; r < rows; ++r) {
        float* g = gu + r * 2 * I;
        const float* u = g + I;
        for (int64_t i = 0; i < I; ++i) g[i] = g[i] / (1.0f + expf(fminf(-g[i], 80.0f))) * u[i];
    }
}

static inline uint16_t round_bf16(float f) {  /* round to nearest even; NaN stays NaN */
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static void scatter(const float* o, int64_t rows, int64_t H, const float* weight, const int64_t* dest, float* y) {
    for (int64_t r = 0; r < rows; ++r) {
        const float w = weight[r];
        float* d = y + dest[r] * H;
        for (int64_t h = 0; h < H; ++h) d[h] = w * o[r * H + h];
    }
}

/* scratch: fp32, (largest expert's rows) x (2I + H + I). */
#define EXPERT_HEAD                                                                                               \
        const int64_t start = off[e], rows = off[e + 1] - start;                                                 \
        if (rows <= 0) continue;                                                                                 \
        float* gu = scratch;                                                                                     \
        float* o = scratch + rows * 2 * I;

void experts_f32(const float* x, const int64_t* off, int64_t e0, int64_t e1, const float* w13, const float* w2,
                 const float* weight, const int64_t* dest, float* y, float* scratch, int64_t H, int64_t I) {
    for (int64_t e = e0; e < e1; ++e) {
        EXPERT_HEAD
        tile_ff_gemm(x + start * H, H, rows, w13 + e * 2 * I * H, H, 2 * I, gu, 2 * I);
        silu_mul(gu, rows, I);
        tile_ff_gemm(gu, 2 * I, rows, w2 + e * H * I, I, H, o, H);
        scatter(o, rows, H, weight + start, dest + start, y);
    }
}

void experts_bf16(const uint16_t* x, const int64_t* off, int64_t e0, int64_t e1, const uint16_t* w13,
                  const uint16_t* w2, const float* weight, const int64_t* dest, float* y, float* scratch, int64_t H,
                  int64_t I) {
    for (int64_t e = e0; e < e1; ++e) {
        EXPERT_HEAD
#if PAIRS
        uint16_t* act = (uint16_t*)(o + rows * H);
        tile_dp_gemm(x + start * H, H, rows, w13 + e * 2 * I * H, H, 2 * I, gu, 2 * I);
        silu_mul(gu, rows, I);
        for (int64_t r = 0; r < rows; ++r)
            for (int64_t i = 0; i < I; ++i) act[r * I + i] = round_bf16(gu[r * 2 * I + i]);
        tile_dp_gemm(act, I, rows, w2 + e * H * I, I, H, o, H);
#else
        tile_hh_gemm(x + start * H, H, rows, w13 + e * 2 * I * H, H, 2 * I, gu, 2 * I);
        silu_mul(gu, rows, I);
        tile_fh_gemm(gu, 2 * I, rows, w2 + e * H * I, I, H, o, H);
#endif
        scatter(o, rows, H, weight + start, dest + start, y);
    }
}
