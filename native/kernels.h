/*
 * kernels.h -- the update kernel w -= lr * g as the update loop runs it
 * (4-float vectors unrolled 4 times, the compiler's loop for the tail), shared
 * with the benchmark-only variants in bench_kernels.c. Internal to native/.
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
