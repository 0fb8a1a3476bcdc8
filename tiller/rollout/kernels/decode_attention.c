/* One-token (decode) attention for tiller's native engine on CPU.

   For each row b and kv head h: the G query heads of that kv head (grouped-query attention) attend over the
   row's L cached keys / values, with an additive float mask per row and column:
       s[g, l] = scale * q[g] . k[l] + mask[l];   p = softmax_l(s);   out[g] = sum_l p[g, l] v[l]
   Keys and values are read once per (row, kv head) for all G query heads. Accumulation is in fp32 (bf16
   inputs are widened on load, the output rounded to nearest even, as torch does).

   Compiled at run time by tiller.rollout.decode_kernel for the model at hand: -DKG=<group> -DKD=<head dim, a
   multiple of 16>, -O3 -march=native -ffast-math (vectorised exp from libmvec; the mask is clamped to finite
   values by the caller). GCC / clang vector extensions: 512-bit vectors, split by the compiler where the CPU
   has narrower ones. Strides are in elements; the head dim is contiguous. Rows [b0, b1) only, so callers can
   split rows over threads; `s` is a caller-owned fp32 scratch of KG * L floats. `start` (may be NULL): per row,
   the first column to read; the caller passes the first unmasked column (a right-aligned prompt's padding is a
   masked prefix, whose softmax weights are exactly 0), so those keys / values are never read. */
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef float vf __attribute__((vector_size(64)));
typedef uint16_t vh __attribute__((vector_size(32)));
typedef uint32_t vu __attribute__((vector_size(64)));
#define NV (KD / 16)

static inline vf load_f32(const float* p) { vf x; memcpy(&x, p, 64); return x; }
static inline vf load_bf16(const uint16_t* p) {
    vh h; memcpy(&h, p, 32);
    vu u = __builtin_convertvector(h, vu) << 16;
    vf x; memcpy(&x, &u, 64); return x;
}
static inline float hsum(vf x) {
    float s = 0.f;
    for (int i = 0; i < 16; ++i) s += x[i];
    return s;
}
/* The four horizontal sums of a[0..3] at once (lanes 0, 4, 8, 12 of the result): 8 shuffles and 5 adds instead
   of four separate 16-lane reductions. */
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
#define HAVE_HSUM4 1
static inline vf hsum4(vf a0, vf a1, vf a2, vf a3) {
    vf t0 = __builtin_shufflevector(a0, a1, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
          + __builtin_shufflevector(a0, a1, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    vf t1 = __builtin_shufflevector(a2, a3, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
          + __builtin_shufflevector(a2, a3, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    vf u = __builtin_shufflevector(t0, t1, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27)
         + __builtin_shufflevector(t0, t1, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    u += __builtin_shufflevector(u, u, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    return u + __builtin_shufflevector(u, u, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
}
#define HSUM4 hsum4
#else
#define HAVE_HSUM4 0
#define HSUM4(a, b, c, d) (a)  /* never reached: the loop above it does not run */
#endif
static inline float store_f32(float f) { return f; }
static inline uint16_t store_bf16(float f) {  /* round to nearest even; NaN stays NaN */
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* Software prefetch of one key / value row (KD elements) into L2: each (row, kv head) reads two short streams
   (keys, then values) that the hardware prefetchers only ramp up on late; requesting the values while the keys
   are read, and the next head's keys while the values are read, keeps DRAM busy (measured ~1.4x on a 2-core
   AMD EPYC, 10 layers x 64 rows of a 30M model's cache, cold). */
#define PREFETCH(p) do { for (int pj = 0; pj < KD * (int)sizeof(*(p)); pj += 64)                              \
                             __builtin_prefetch((const char*)(p) + pj, 0, 1); } while (0)
static inline int64_t first_column(const int64_t* start, int64_t b, int64_t L) {  /* row b's first column read */
    return start && start[b] < L ? start[b] : 0;
}

/* bf16 scores with AVX512-BF16's dot-product instruction (where the compiler targets it): pairs of bf16 products
   summed in fp32 straight from the cache's bf16 keys, half the instructions of widening every key to fp32 first.
   The products are exact in fp32 as before; the sums are associated differently and the scale comes after the dot
   product (VDPBF16PS also flushes denormals). s[g * L + l] = scale * q[g] . k[l] + m[l]; values are prefetched as
   in the generic loop. */
#if defined(__AVX512BF16__) && defined(__AVX512F__) && KD % 32 == 0 && HAVE_HSUM4
#include <immintrin.h>
#define HAVE_DPBF16 1
static inline void qk_dpbf16(const uint16_t* restrict q, int64_t qg, const uint16_t* restrict kr, int64_t kl,
                             const uint16_t* vr, int64_t vl, int64_t L, float scale, const float* restrict m,
                             float* restrict s) {
    __m512bh qv[KG][KD / 32];
    for (int g = 0; g < KG; ++g)
        for (int j = 0; j < KD / 32; ++j) qv[g][j] = (__m512bh)_mm512_loadu_si512(q + g * qg + 32 * j);
    for (int64_t l = 0; l < L; ++l) {
        __m512bh kv[KD / 32];
        for (int j = 0; j < KD / 32; ++j) kv[j] = (__m512bh)_mm512_loadu_si512(kr + l * kl + 32 * j);
        PREFETCH(vr + l * vl);
        int g0 = 0;
        for (; g0 + 4 <= KG; g0 += 4) {
            vf a[4];
            for (int i = 0; i < 4; ++i) {
                __m512 acc = _mm512_setzero_ps();
                for (int j = 0; j < KD / 32; ++j) acc = _mm512_dpbf16_ps(acc, qv[g0 + i][j], kv[j]);
                a[i] = (vf)acc;
            }
            vf r = hsum4(a[0], a[1], a[2], a[3]);
            for (int i = 0; i < 4; ++i) s[(g0 + i) * L + l] = r[4 * i] * scale + m[l];
        }
        for (int g = g0; g < KG; ++g) {
            __m512 acc = _mm512_setzero_ps();
            for (int j = 0; j < KD / 32; ++j) acc = _mm512_dpbf16_ps(acc, qv[g][j], kv[j]);
            s[g * L + l] = hsum((vf)acc) * scale + m[l];
        }
    }
}
#else
#define HAVE_DPBF16 0
static inline void qk_dpbf16(const uint16_t* q, int64_t qg, const uint16_t* kr, int64_t kl, const uint16_t* vr,
                             int64_t vl, int64_t L, float scale, const float* m, float* s) {
    (void)q; (void)qg; (void)kr; (void)kl; (void)vr; (void)vl; (void)L; (void)scale; (void)m; (void)s;
}
#endif

#define DEFINE_KERNEL(NAME, T, LOADV, STORE, FAST)                                                          \
void NAME(const T* restrict q, int64_t qb, int64_t qh, int64_t qg,                                          \
          const T* restrict k, int64_t kb, int64_t kh, int64_t kl,                                          \
          const T* restrict v, int64_t vb, int64_t vh_, int64_t vl,                                         \
          const float* restrict mask, int64_t mb, const int64_t* restrict start,                            \
          T* restrict out, int64_t ob, int64_t oh, int64_t og,                                              \
          int64_t b0, int64_t b1, int64_t H, int64_t L0, float scale, float* restrict s) {                  \
    for (int64_t b = b0; b < b1; ++b) {                                                                     \
        const int64_t l0 = first_column(start, b, L0), L = L0 - l0;                                         \
        const float* m = mask + b * mb + l0;                                                                \
        for (int64_t h = 0; h < H; ++h) {                                                                   \
            vf qv[KG][NV];                                                                                  \
            for (int g = 0; g < KG; ++g)                                                                    \
                for (int j = 0; j < NV; ++j) qv[g][j] = LOADV(q + b * qb + h * qh + g * qg + 16 * j) * scale;\
            const T* kr = k + b * kb + h * kh + l0 * kl;                                                    \
            const T* vr = v + b * vb + h * vh_ + l0 * vl;                                                   \
            /* the next (row, kv head)'s keys, fetched while this one's values are read */                 \
            const T* kn = h + 1 < H ? kr + kh : b + 1 < b1 ? k + (b + 1) * kb + first_column(start, b + 1, L0) * kl : 0; \
            if (FAST) qk_dpbf16((const uint16_t*)(q + b * qb + h * qh), qg, (const uint16_t*)kr, kl,          \
                                (const uint16_t*)vr, vl, L, scale, m, s);                                   \
            else for (int64_t l = 0; l < L; ++l) {                                                          \
                vf kv[NV];                                                                                  \
                for (int j = 0; j < NV; ++j) kv[j] = LOADV(kr + l * kl + 16 * j);                           \
                PREFETCH(vr + l * vl);                                                                      \
                int g0 = 0;                                                                                 \
                for (; HAVE_HSUM4 && g0 + 4 <= KG; g0 += 4) {                                               \
                    vf a[4];                                                                                \
                    for (int i = 0; i < 4; ++i) {                                                           \
                        a[i] = qv[g0 + i][0] * kv[0];                                                       \
                        for (int j = 1; j < NV; ++j) a[i] += qv[g0 + i][j] * kv[j];                         \
                    }                                                                                       \
                    vf r = HSUM4(a[0], a[1], a[2], a[3]);                                                   \
                    for (int i = 0; i < 4; ++i) s[(g0 + i) * L + l] = r[4 * i] + m[l];                      \
                }                                                                                           \
                for (int g = g0; g < KG; ++g) {                                                             \
                    vf a = qv[g][0] * kv[0];                                                                \
                    for (int j = 1; j < NV; ++j) a += qv[g][j] * kv[j];                                     \
                    s[g * L + l] = hsum(a) + m[l];                                                          \
                }                                                                                           \
            }                                                                                               \
            float inv[KG];                                                                                  \
            for (int g = 0; g < KG; ++g) {                                                                  \
                float sum = 0.f, *sg = s + g * L, mx = sg[0];                                               \
                for (int64_t l = 1; l < L; ++l) mx = sg[l] > mx ? sg[l] : mx;                               \
                for (int64_t l = 0; l < L; ++l) { sg[l] = expf(sg[l] - mx); sum += sg[l]; }                 \
                inv[g] = 1.f / sum;                                                                         \
            }                                                                                               \
            vf acc[KG][NV];                                                                                 \
            memset(acc, 0, sizeof(acc));                                                                    \
            for (int64_t l = 0; l < L; ++l) {                                                               \
                vf vv[NV];                                                                                  \
                for (int j = 0; j < NV; ++j) vv[j] = LOADV(vr + l * vl + 16 * j);                           \
                if (kn) PREFETCH(kn + l * kl);                                                              \
                for (int g = 0; g < KG; ++g) {                                                              \
                    float p = s[g * L + l];                                                                 \
                    for (int j = 0; j < NV; ++j) acc[g][j] += p * vv[j];                                    \
                }                                                                                           \
            }                                                                                               \
            for (int g = 0; g < KG; ++g) {                                                                  \
                T* o = out + b * ob + h * oh + g * og;                                                      \
                for (int j = 0; j < NV; ++j) {                                                              \
                    vf r = acc[g][j] * inv[g];                                                              \
                    for (int i = 0; i < 16; ++i) o[16 * j + i] = STORE(r[i]);                               \
                }                                                                                           \
            }                                                                                               \
        }                                                                                                   \
    }                                                                                                       \
}

DEFINE_KERNEL(decode_attention_f32, float, load_f32, store_f32, 0)
DEFINE_KERNEL(decode_attention_bf16, uint16_t, load_bf16, store_bf16, HAVE_DPBF16)
