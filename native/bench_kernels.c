/*
 * bench_kernels.c -- the update written four ways, for `psd bench` to measure
 * what vectorising and unrolling buy (GaDei measured unrolling): one float per
 * iteration with vectorisation turned off; the compiler's vectorised loop; and
 * 4-float vectors unrolled 4 (what the update loop runs, kernels.h) and 8
 * times by hand. Nothing here runs in a job.
 */
#include <errno.h>

#include "kernels.h"
#include "psd.h"

#if defined(__clang__)
static void sgd_scalar(float *restrict w, const float *restrict g, uint64_t n, float lr) {
#pragma clang loop vectorize(disable) interleave(disable) unroll(disable)
    for (uint64_t i = 0; i < n; i++)
        w[i] -= lr * g[i];
}
#else
__attribute__((optimize("no-tree-vectorize", "no-unroll-loops"))) static void sgd_scalar(float *restrict w,
                                                                                        const float *restrict g,
                                                                                        uint64_t n, float lr) {
    for (uint64_t i = 0; i < n; i++)
        w[i] -= lr * g[i];
}
#endif

static void sgd_unroll8(float *restrict w, const float *restrict g, uint64_t n, float lr) {
    const psd_v4 k = {lr, lr, lr, lr};
    uint64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        PSD_SGD_V16(0);
        PSD_SGD_V16(16);
    }
    psd_sgd_vectorised(w + i, g + i, n - i, lr);
}

int psd_apply_sgd_kernel(float *restrict w, const float *restrict g, uint64_t n, float lr, int kernel) {
    switch (kernel) {
    case PSD_KERNEL_SCALAR:
        sgd_scalar(w, g, n, lr);
        return 0;
    case PSD_KERNEL_VECTOR:
        psd_sgd_vectorised(w, g, n, lr);
        return 0;
    case PSD_KERNEL_UNROLL4:
        psd_sgd_unroll4(w, g, n, lr);
        return 0;
    case PSD_KERNEL_UNROLL8:
        sgd_unroll8(w, g, n, lr);
        return 0;
    default:
        return EINVAL;
    }
}
