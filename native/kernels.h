/*
 * kernels.h -- w -= lr * g: the unchecked variants bench_kernels.c measures
 * (4-float vectors unrolled 4 times, the compiler's loop for the tail), and
 * the checked reads the update loop's kernels make of a learner's ring
 * (psd_take1 and its users). Internal to native/.
 */
#ifndef PSD_KERNELS_H
#define PSD_KERNELS_H

#include <stdint.h>
#include <string.h>

typedef float psd_v4 __attribute__((vector_size(16)));

static inline psd_v4 psd_load4(const float *p) {
    psd_v4 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void psd_store4(float *p, psd_v4 v) { memcpy(p, &v, sizeof v); }

/* The compiler's (vectorised) loop. */
static inline void psd_sgd_vectorised(float *restrict w, const float *restrict g, uint64_t n, float lr) {
    for (uint64_t i = 0; i < n; i++)
        w[i] -= lr * g[i];
}

/* A bfloat16's float: its bits are the float's top half. */
static inline float psd_bf16_to_f32(uint16_t v) {
    uint32_t b = (uint32_t)v << 16;
    float f;
    memcpy(&f, &b, sizeof f);
    return f;
}

/* dst = g widened to float32. */
static inline void psd_bf16_widen(float *restrict dst, const uint16_t *restrict g, uint64_t n) {
    for (uint64_t i = 0; i < n; i++)
        dst[i] = psd_bf16_to_f32(g[i]);
}

/* The update loop reads a gradient out of a learner's ring, which the learner can still write while
 * the loop reads: every value is loaded once into a register, checked, and only that register is used,
 * so the value checked is the value used (rule VALUES). A NaN or an infinity is taken as 0 and raises
 * the caller's `bad` flag. */
#define PSD_EXP32 0x7f800000u

/* x, or 0 if x is a NaN or an infinity (then *bad |= 1). */
static inline float psd_take1(float x, uint32_t *bad) {
    uint32_t b;
    memcpy(&b, &x, sizeof b);
    uint32_t nonfinite = (b & PSD_EXP32) == PSD_EXP32;
    *bad |= nonfinite;
    b &= nonfinite - 1u; /* all ones when finite, 0 when not */
    memcpy(&x, &b, sizeof x);
    return x;
}

/* dst = src, each value taken with psd_take1; nonzero if any was not finite. */
static inline uint32_t psd_take_finite(float *restrict dst, const float *restrict src, uint64_t n) {
    uint32_t bad = 0;
    for (uint64_t i = 0; i < n; i++)
        dst[i] = psd_take1(src[i], &bad);
    return bad;
}

/* The same from a bfloat16 source, widened to float32 as it is taken. */
static inline uint32_t psd_take_finite_bf16(float *restrict dst, const uint16_t *restrict src, uint64_t n) {
    uint32_t bad = 0;
    for (uint64_t i = 0; i < n; i++) {
        uint32_t b = (uint32_t)src[i] << 16;
        float x;
        memcpy(&x, &b, sizeof x);
        dst[i] = psd_take1(x, &bad);
    }
    return bad;
}

/* w -= lr * g, g bfloat16, widened and taken as psd_take1 does; nonzero if any value was not finite. */
static inline uint32_t psd_sgd_take_bf16(float *restrict w, const uint16_t *restrict g, uint64_t n, float lr) {
    uint32_t bad = 0;
    for (uint64_t i = 0; i < n; i++) {
        uint32_t b = (uint32_t)g[i] << 16;
        float x;
        memcpy(&x, &b, sizeof x);
        w[i] -= lr * psd_take1(x, &bad);
    }
    return bad;
}

#define PSD_SGD_V4(off) psd_store4(w + i + (off), psd_load4(w + i + (off)) - k * psd_load4(g + i + (off)))
#define PSD_SGD_V16(off) (PSD_SGD_V4(off), PSD_SGD_V4((off) + 4), PSD_SGD_V4((off) + 8), PSD_SGD_V4((off) + 12))

/* What the update loop runs: 16 floats an iteration, by hand. */
static inline void psd_sgd_unroll4(float *restrict w, const float *restrict g, uint64_t n, float lr) {
    const psd_v4 k = {lr, lr, lr, lr};
    uint64_t i = 0;
    for (; i + 16 <= n; i += 16)
        PSD_SGD_V16(0);
    psd_sgd_vectorised(w + i, g + i, n - i, lr);
}

#endif
