/*
 * kernels.h -- the update kernel w -= lr * g as the update loop runs it
 * (4-float vectors unrolled 4 times, the compiler's loop for the tail), shared
 * with the benchmark-only variants in bench_kernels.c, and its bfloat16-gradient
 * twin. Internal to native/.
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

/* w -= lr * g with g bfloat16 (--grad-dtype bf16): widened as it is read, half the bytes of g. */
static inline void psd_sgd_bf16(float *restrict w, const uint16_t *restrict g, uint64_t n, float lr) {
    for (uint64_t i = 0; i < n; i++)
        w[i] -= lr * psd_bf16_to_f32(g[i]);
}

/* dst = g widened to float32. */
static inline void psd_bf16_widen(float *restrict dst, const uint16_t *restrict g, uint64_t n) {
    for (uint64_t i = 0; i < n; i++)
        dst[i] = psd_bf16_to_f32(g[i]);
}

/* Floats a kernel takes out of a learner's ring at a time (psd_take_finite): a block that stays in
 * L1 between its copy and its use. */
#define PSD_TAKE_BLOCK 1024

/* dst = src, each value loaded once; a NaN or an infinity becomes 0 in dst. Returns how many there
 * were. The update loop reads a gradient only this way: src is a learner's ring, which the learner
 * can still write while the loop reads, so the value checked is the value used (rule VALUES). */
static inline uint64_t psd_take_finite(float *restrict dst, const float *restrict src, uint64_t n) {
    uint64_t bad = 0;
    for (uint64_t i = 0; i < n; i++) {
        uint32_t b;
        memcpy(&b, &src[i], sizeof b);
        uint32_t nonfinite = (b & 0x7f800000u) == 0x7f800000u;
        bad += nonfinite;
        b &= nonfinite - 1u; /* all ones when finite, 0 when not */
        memcpy(&dst[i], &b, sizeof b);
    }
    return bad;
}

/* The same for a bfloat16 source, widened to float32 as it is taken. */
static inline uint64_t psd_take_finite_bf16(float *restrict dst, const uint16_t *restrict src, uint64_t n) {
    uint64_t bad = 0;
    for (uint64_t i = 0; i < n; i++) {
        uint32_t b = (uint32_t)src[i] << 16;
        uint32_t nonfinite = (b & 0x7f800000u) == 0x7f800000u;
        bad += nonfinite;
        b &= nonfinite - 1u;
        memcpy(&dst[i], &b, sizeof b);
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
