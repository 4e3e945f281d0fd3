/*
 * optim.c -- the server-side optimizers, learning-rate schedules and weight
 * prediction.
 *
 * Every kernel of the update loop lives here (sgd's in AVX2 where the CPU has it), each run over
 * PSD_CHUNK-float work items by run_chunks, the one loop that spreads them over OpenMP threads and
 * beats the heartbeat. Each optimizer follows the arithmetic of PyTorch's single-tensor
 * implementation (torch/optim/{sgd,adam,adagrad}.py, foreach=False) operation
 * by operation in float32, with the scalars computed in double as Python does,
 * so that a single learner in bsp mode matches torch.optim to float rounding.
 * The state (momentum buffer; Adam's m and v; Adagrad's sum) lives in the
 * arena's optimizer-state region, so a restarted server and a checkpoint
 * carry it; no learner keeps optimizer state.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <math.h>
#include <string.h>

#include "kernels.h"
#include "psd.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

/* The scalars of one update, computed once per step. */
struct step_scalars {
    float lr, neg_lr, wd, mom, one_minus_damp, b1_weight, b2, one_minus_b2, eps;
    float neg_step_size, bc2_sqrt, decay_mul, neg_clr;
    float gscale;
    int first; /* the momentum buffer starts as the first gradient */
    int squares_taken; /* the state already holds this update's gradients (kasync: psd_adagrad_take's
                          squares; psd_adam_take's moments, g then the sum of the steps' directions) */
    float inv_k;       /* and 1 / K, K gradients a round: the sum's floor (adagrad_body) */
    float decay_mul_k; /* AdamW, taken: decay_mul^K, the decoupled decay of a round's K steps */
};

double psd_scheduled_lr(const struct psd_config *c, uint64_t t) {
    double lr = c->lr;
    switch (c->schedule) {
    case PSD_SCHED_STEP:
        if (c->step_size)
            lr *= pow(c->gamma, (double)(t / c->step_size));
        break;
    case PSD_SCHED_COSINE: {
        uint64_t tt = c->t_max && t > c->t_max ? c->t_max : t;
        if (c->t_max)
            lr = c->eta_min + (lr - c->eta_min) * (1.0 + cos(M_PI * (double)tt / (double)c->t_max)) / 2.0;
        break;
    }
    default:
        break;
    }
    if (c->warmup && t < c->warmup)
        lr *= (double)(t + 1) / (double)c->warmup;
    return lr;
}

/* A staleness the update loop stored in the header as a double's bits, loaded relaxed (only the loop writes
 * it); 0 where it is not a number in [0, 1e18). */
static double stored_staleness(const _Atomic uint64_t *field) {
    uint64_t bits = PSD_LOAD_RLX(field);
    double tau;
    memcpy(&tau, &bits, sizeof tau);
    return tau >= 0.0 && tau < 1e18 ? tau : 0.0;
}

/* The running mean of staleness in the header (staleness_avg_bits): what the loop started with, and
 * what psd status shows. */
double psd_staleness_avg(const struct psd_header *h) {
    return stored_staleness(&h->staleness_avg_bits);
}

/* The staleness held since the job last lost a learner (staleness_held_bits; update.c note_learners says
 * why): what the loop started with; 0 for none. */
double psd_staleness_held(const struct psd_header *h) {
    return stored_staleness(&h->staleness_held_bits);
}

/* The staleness the momentum rule reads (psd_async_rule): the running mean, or the held one where larger. */
double psd_rule_staleness(const struct psd_header *h) {
    double held = psd_staleness_held(h), tau = psd_staleness_avg(h);
    return held > tau ? held : tau;
}

/* A double in [0, 1] the server steers (psd_layout.h: gain_level_bits, damping_bits), loaded relaxed; `outside`
 * where it is not in [0, 1] (NaN included). */
static double steered(const _Atomic uint64_t *field, double outside) {
    uint64_t bits = PSD_LOAD_RLX(field);
    double v;
    memcpy(&v, &bits, sizeof v);
    return v >= 0.0 && v <= 1.0 ? v : outside;
}

/* The gain level in the header (gain_level_bits, psd/gain.py): 0 outside [0, 1]. */
double psd_gain_level(const struct psd_header *h) {
    return steered(&h->gain_level_bits, 0.0);
}

/* The share of the damping of staler-than-mean gradients in the header (damping_bits, psd/gain.py): 1 (all
 * of it) outside [0, 1]. */
double psd_damping(const struct psd_header *h) {
    return steered(&h->damping_bits, 1.0);
}

/* The staleness of a job of cfg nodes > 1 nodes that exchange every few updates, from this node's `tau`: the
 * other nodes apply as many updates as this one meanwhile (nodes x tau), and the exchange's lag adds
 * node_lag more (psd/gain.py node_staleness; the server sets both, node_terms). One node, or nodes that
 * train apart between rare exchanges (nodes 0 or 1): tau. */
double psd_node_staleness(const struct psd_config *c, double tau) {
    if (c->nodes <= 1)
        return tau;
    double lag = c->node_lag >= 0.0 && c->node_lag < 1e18 ? c->node_lag : 0.0;
    return (double)c->nodes * (tau > 0.0 ? tau : 0.0) + lag;
}

/* With --async-momentum auto, the momentum factor (*mu) and learning-rate factor (*lr_factor) of the next
 * update, `level` (in [0, 1]: psd_gain_level's, checked there) of the way from the staleness rule (0) to
 * the gain-keeping rule (1):
 *
 * - the staleness rule: the implicit momentum that asynchrony adds (Mitliagkas et al., "Asynchrony begets
 *   momentum", 2016: 1 - 1/M with M workers; for a mean staleness tau, tau / (1 + tau)) is taken off the
 *   configured momentum, down to 0, the lr kept. Stable near one process's edge, but a tenth of the gain
 *   (lr / (1 - mu)) along flat directions at momentum 0.9;
 * - the gain-keeping rule: a gradient's mean age stays one process's, mu' / (1 - mu') = mu / (1 - mu) - tau,
 *   and the lr rises so that lr' / (1 - mu') = lr / (1 - mu). One process's gain, stable only where the
 *   job's lr times the loss's sharpness is small (benchmarks/delay_stability.py).
 *
 * The server picks the level from the sharpness the learners measure (psd/gain.py); without one it is 0.
 * tau is the running mean of the staleness the update loop measured (staleness_avg_bits); it is 0 without
 * staleness (one learner, bsp), and then this is the configured momentum and lr exactly. Where several
 * nodes train as one job (cfg nodes > 1: they exchange every few updates), the staleness is the job's:
 * psd_node_staleness. */
void psd_async_rule(const struct psd_config *c, double tau, double level, double *mu, double *lr_factor) {
    double m = c->momentum;
    *mu = m;
    *lr_factor = 1.0;
    tau = psd_node_staleness(c, tau);
    if (c->async_momentum != PSD_ASYNC_MOMENTUM_AUTO || !(tau > 0.0))
        return;
    double cut = m - tau / (1.0 + tau);
    cut = cut > 0.0 ? cut : 0.0;
    double age = m < 1.0 ? m / (1.0 - m) - tau : 0.0;
    double keep = age > 0.0 ? age / (1.0 + age) : 0.0;
    double keep_lr = m < 1.0 ? (1.0 - keep) / (1.0 - m) : 1.0;
    *mu = (1.0 - level) * cut + level * keep;
    if (c->optimizer == PSD_OPT_MOMENTUM || c->optimizer == PSD_OPT_NESTEROV)
        *lr_factor = (1.0 - level) + level * keep_lr;
}

/* The momentum factor of the next update (psd_async_rule). */
double psd_async_momentum(const struct psd_config *c, double tau, double level) {
    double mu, f;
    psd_async_rule(c, tau, level, &mu, &f);
    return mu;
}

/* The learning-rate factor of one gradient under --async-momentum auto: a gradient staler than the
 * running mean tau is damped by (1 + tau) / (1 + staleness); at or below the mean it is 1. Taking the
 * implicit momentum off (above) matches asynchrony's mean effect; a learner descheduled for a while
 * (an oversubscribed or noisy machine) comes back with gradients far staler than that mean, and at
 * one process's learning rate those alone could throw a momentum job off (measured: README). Only
 * momentum and nesterov, as for the momentum itself. The update loop applies as much of it as the header's
 * damping says (psd_damping: 1 - d + d x this), which the server sets from the measured sharpness. */
double psd_async_lr_factor(const struct psd_config *c, double tau, double staleness) {
    if (c->async_momentum != PSD_ASYNC_MOMENTUM_AUTO ||
        (c->optimizer != PSD_OPT_MOMENTUM && c->optimizer != PSD_OPT_NESTEROV))
        return 1.0;
    if (!(tau >= 0.0) || staleness <= tau)
        return 1.0;
    return (1.0 + tau) / (1.0 + staleness);
}

/* Adagrad's first updates are each about the lr in every coordinate (its sum holds only a few squared
 * gradients), and a gradient several updates old repeats steps the job has already taken; the overshoot
 * then stays in the sum, a smaller step for the rest of the run. So under --async-momentum auto the
 * first PSD_ADAGRAD_YOUNG updates of an Adagrad job (the job's optimizer steps, restored with its state)
 * take lr / (1 + staleness), like --staleness-lr for a whole run (which divides by the staleness itself,
 * above 1), where that flag is not set; after them, and without staleness, the lr as given. The staleness
 * is the one the update loop measured for this gradient: on several nodes, the node's own. The matrix's
 * language model at 8 learners: +2.1 to +5.7% of loss without it, -0.5 to +2.1% with it over two rounds of
 * 3 seeds (benchmarks/results/matrix/README.md, "Adagrad's young updates").
 * Adam's first updates are as large, but there the same damping cost loss (the same README). */
double psd_adagrad_start_factor(const struct psd_config *c, uint64_t update, double staleness) {
    if (c->optimizer != PSD_OPT_ADAGRAD || c->async_momentum != PSD_ASYNC_MOMENTUM_AUTO ||
        (c->cfg_flags & PSD_CFG_STALENESS_LR) || update >= PSD_ADAGRAD_YOUNG || !(staleness > 0.0))
        return 1.0;
    return 1.0 / (1.0 + staleness);
}

/* w[lo, hi) -= lr * g[lo, hi), g float32 or bfloat16 (enum psd_dtype), each value of g loaded once and
 * checked (kernels.h psd_take1: a non-finite one moves nothing); nonzero if any was not finite. */
#if defined(__x86_64__) && defined(__GNUC__)
#define PSD_HAVE_AVX2_TAKE 1
/* sgd_chunk's float32 body in AVX2 (chosen at run time): the check is an and, a compare, an and-not and an
 * or a vector, 16 floats an iteration. */
__attribute__((target("avx2"))) static uint32_t sgd_take_avx2(float *restrict w, const float *restrict g, uint64_t n,
                                                              float lr) {
    const __m256 k = _mm256_set1_ps(lr);
    const __m256i e = _mm256_set1_epi32((int)PSD_EXP32);
    __m256i any = _mm256_setzero_si256();
    uint64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256i b0 = _mm256_loadu_si256((const __m256i *)(const void *)(g + i)); /* the one load of each */
        __m256i b1 = _mm256_loadu_si256((const __m256i *)(const void *)(g + i + 8));
        __m256i m0 = _mm256_cmpeq_epi32(_mm256_and_si256(b0, e), e); /* all ones: a NaN or an infinity */
        __m256i m1 = _mm256_cmpeq_epi32(_mm256_and_si256(b1, e), e);
        any = _mm256_or_si256(any, _mm256_or_si256(m0, m1));
        __m256 g0 = _mm256_castsi256_ps(_mm256_andnot_si256(m0, b0));
        __m256 g1 = _mm256_castsi256_ps(_mm256_andnot_si256(m1, b1));
        _mm256_storeu_ps(w + i, _mm256_sub_ps(_mm256_loadu_ps(w + i), _mm256_mul_ps(k, g0)));
        _mm256_storeu_ps(w + i + 8, _mm256_sub_ps(_mm256_loadu_ps(w + i + 8), _mm256_mul_ps(k, g1)));
    }
    uint32_t bad = !_mm256_testz_si256(any, any);
    for (; i < n; i++)
        w[i] -= lr * psd_take1(g[i], &bad);
    return bad;
}
#endif

static uint32_t sgd_chunk(float *restrict w, const void *restrict g, uint32_t gdtype, uint64_t lo, uint64_t hi,
                          float lr) {
    if (gdtype == PSD_DTYPE_BF16)
        return psd_sgd_take_bf16(w + lo, (const uint16_t *)g + lo, hi - lo, lr);
    const float *restrict gf = (const float *)g;
#ifdef PSD_HAVE_AVX2_TAKE
    static _Atomic int avx2 = -1; /* the kernel threads may all ask first: each stores the same answer */
    int have = PSD_LOAD_RLX(&avx2);
    if (have < 0) {
        have = __builtin_cpu_supports("avx2") ? 1 : 0;
        PSD_STORE_RLX(&avx2, have);
    }
    if (have)
        return sgd_take_avx2(w + lo, gf + lo, hi - lo, lr);
#endif
    uint32_t bad = 0;
    for (uint64_t i = lo; i < hi; i++) /* the compiler's vectors */
        w[i] -= lr * psd_take1(gf[i], &bad);
    return bad;
}

/* Run `chunk` over [0, n) in PSD_CHUNK-float work items, on `threads` OpenMP threads for a long vector
 * (small ones are not worth waking a team), beating `beat` after each item of the calling thread's: the
 * one chunked heartbeat loop of every kernel. Nonzero if any item met a non-finite value, which is then
 * added to *nonfinite (only the loop's thread reads it, after the call). */
typedef uint32_t (*chunk_fn)(const void *ctx, uint64_t lo, uint64_t hi);

static void run_chunks(uint64_t n, int threads, struct psd_beat *beat, _Atomic uint64_t *nonfinite, chunk_fn chunk,
                       const void *ctx) {
    int64_t chunks = (int64_t)((n + PSD_CHUNK - 1) / PSD_CHUNK);
    uint32_t bad = 0;
    if (threads <= 1 || n < (UINT64_C(1) << 16)) {
        for (int64_t j = 0; j < chunks; j++) {
            uint64_t lo = (uint64_t)j * PSD_CHUNK, hi = lo + PSD_CHUNK < n ? lo + PSD_CHUNK : n;
            bad |= chunk(ctx, lo, hi);
            psd_beat(beat);
        }
    } else {
#pragma omp parallel for num_threads(threads) schedule(static) reduction(| : bad)
        for (int64_t j = 0; j < chunks; j++) {
            uint64_t lo = (uint64_t)j * PSD_CHUNK, hi = lo + PSD_CHUNK < n ? lo + PSD_CHUNK : n;
            bad |= chunk(ctx, lo, hi);
            if (PSD_OMP_MASTER()) /* the beat's `last` is the master's alone */
                psd_beat(beat);
        }
    }
    if (bad && nonfinite)
        PSD_ADD_RLX(nonfinite, bad);
}

struct sgd_args {
    float *w;
    const void *g;
    uint32_t gdtype;
    float lr;
};

static uint32_t sgd_item(const void *ctx, uint64_t lo, uint64_t hi) {
    const struct sgd_args *a = ctx;
    return sgd_chunk(a->w, a->g, a->gdtype, lo, hi, a->lr);
}

/* The update loop's sgd kernel: sgd_chunk over PSD_CHUNK-float work items, each value of g checked as it
 * is read (the unchecked variants it is measured against are in bench_kernels.c: `psd bench`,
 * benchmarks/values_check.py); a bfloat16 gradient is widened as it is read. */
void psd_apply_sgd(float *restrict w, const void *restrict g, uint32_t gdtype, uint64_t n, float lr, int threads,
                   struct psd_beat *beat, _Atomic uint64_t *nonfinite) {
    const struct sgd_args a = {w, g, gdtype, lr};
    run_chunks(n, threads, beat, nonfinite, sgd_item, &a);
}

/* The range kernels below read each value of g once (psd_take1: a NaN or an infinity is taken as 0 and
 * raises the returned flag): g may be a learner's ring, still writable by it. Each is one fused pass
 * (w, g and the state read once and written once per element) written so that the compiler vectorises
 * it: the scalars are copied into locals and every per-job choice (weight decay, the first step,
 * Nesterov, AdamW's decoupled decay, torch.lerp's side) is a compile-time constant of an always-inlined
 * body, picked once per range, so no branch is left in the loop; with -fno-math-errno, sqrtf is the
 * packed square root; weight decay is one fused multiply-add (fmaf), rounded as torch's
 * grad.add(param, alpha=wd) rounds it, which decides Adam's and Adagrad's first step where the gradient and
 * wd * w nearly cancel. PSD_KERNEL (psd.h) builds each range kernel for x86-64-v4 (AVX-512), v3 (AVX2,
 * FMA) and the baseline, picked at load time by the CPU (GCC's target_clones). */
#define PSD_INLINE static inline __attribute__((always_inline))

PSD_INLINE uint32_t sgd_body(const struct step_scalars *k, const int wd_on, float *restrict w,
                             const float *restrict g, uint64_t lo, uint64_t hi) {
    const float gs = k->gscale, wd = k->wd, neg_lr = k->neg_lr;
    uint32_t bad = 0;
    for (uint64_t i = lo; i < hi; i++) {
        float d = psd_take1(g[i], &bad) * gs;
        if (wd_on)
            d = fmaf(wd, w[i], d);
        w[i] = w[i] + neg_lr * d;
    }
    return bad;
}

PSD_KERNEL static uint32_t sgd_range(const struct step_scalars *k, float *restrict w, const float *restrict g,
                                     uint64_t lo, uint64_t hi) {
    return k->wd != 0.0f ? sgd_body(k, 1, w, g, lo, hi) : sgd_body(k, 0, w, g, lo, hi);
}

PSD_INLINE uint32_t momentum_body(const struct step_scalars *k, const int nesterov, const int wd_on, const int first,
                                  float *restrict w, const float *restrict g, float *restrict buf, uint64_t lo,
                                  uint64_t hi) {
    const float gs = k->gscale, wd = k->wd, mom = k->mom, omd = k->one_minus_damp, neg_lr = k->neg_lr;
    uint32_t bad = 0;
    for (uint64_t i = lo; i < hi; i++) {
        float d = psd_take1(g[i], &bad) * gs;
        if (wd_on)
            d = fmaf(wd, w[i], d);
        float b = first ? d : buf[i] * mom + omd * d;
        buf[i] = b;
        float u = nesterov ? d + mom * b : b;
        w[i] = w[i] + neg_lr * u;
    }
    return bad;
}

PSD_KERNEL static uint32_t momentum_range(const struct step_scalars *k, int nesterov, float *restrict w,
                                          const float *restrict g, float *restrict buf, uint64_t lo, uint64_t hi) {
    const int wd_on = k->wd != 0.0f, first = k->first;
#define PSD_MOM(n, d, f) momentum_body(k, n, d, f, w, g, buf, lo, hi)
    if (nesterov)
        return first ? (wd_on ? PSD_MOM(1, 1, 1) : PSD_MOM(1, 0, 1)) : (wd_on ? PSD_MOM(1, 1, 0) : PSD_MOM(1, 0, 0));
    return first ? (wd_on ? PSD_MOM(0, 1, 1) : PSD_MOM(0, 0, 1)) : (wd_on ? PSD_MOM(0, 1, 0) : PSD_MOM(0, 0, 0));
#undef PSD_MOM
}

/* decay: 0 none, 1 L2 (Adam's weight_decay), 2 decoupled (AdamW); low: torch.lerp's side (weight < 0.5). */
PSD_INLINE uint32_t adam_body(const struct step_scalars *k, const int decay, const int low, float *restrict w,
                              const float *restrict g, float *restrict m, float *restrict v, uint64_t lo,
                              uint64_t hi) {
    const float gs = k->gscale, wd = k->wd, dm = k->decay_mul, b1w = k->b1_weight, b1w_c = 1.0f - k->b1_weight;
    const float b2 = k->b2, omb2 = k->one_minus_b2, bc2 = k->bc2_sqrt, eps = k->eps, nss = k->neg_step_size;
    uint32_t bad = 0;
    for (uint64_t i = lo; i < hi; i++) {
        float d = psd_take1(g[i], &bad) * gs;
        float p = w[i];
        if (decay == 2)
            p = p * dm;
        else if (decay == 1)
            d = fmaf(wd, p, d);
        float a = m[i];
        float mi = low ? a + b1w * (d - a) : d - (d - a) * b1w_c; /* torch.lerp(m, d, b1w), both sides exact */
        float vi = v[i] * b2 + omb2 * (d * d);
        m[i] = mi;
        v[i] = vi;
        float denom = sqrtf(vi) / bc2 + eps;
        w[i] = p + nss * (mi / denom);
    }
    return bad;
}

/* Taken (kasync, psd_adam_take): g is the round's sum of its K steps' directions, the moments hold them
 * already; the weights move by lr times it, after AdamW's decoupled decay of K steps. */
PSD_INLINE uint32_t adam_taken_body(const struct step_scalars *k, const int decoupled, float *restrict w,
                                    const float *restrict g, uint64_t lo, uint64_t hi) {
    const float dmk = k->decay_mul_k, neg_lr = k->neg_lr;
    uint32_t bad = 0;
    for (uint64_t i = lo; i < hi; i++) {
        float u = psd_take1(g[i], &bad);
        float p = decoupled ? w[i] * dmk : w[i];
        w[i] = p + neg_lr * u;
    }
    return bad;
}

PSD_KERNEL static uint32_t adam_range(const struct step_scalars *k, int decoupled, float *restrict w,
                                      const float *restrict g, float *restrict m, float *restrict v, uint64_t lo,
                                      uint64_t hi) {
    const int decay = k->wd == 0.0f ? 0 : decoupled ? 2 : 1, low = k->b1_weight < 0.5f;
    if (k->squares_taken)
        return decay == 2 ? adam_taken_body(k, 1, w, g, lo, hi) : adam_taken_body(k, 0, w, g, lo, hi);
#define PSD_ADAM(d, l) adam_body(k, d, l, w, g, m, v, lo, hi)
    switch (decay) {
    case 2:
        return low ? PSD_ADAM(2, 1) : PSD_ADAM(2, 0);
    case 1:
        return low ? PSD_ADAM(1, 1) : PSD_ADAM(1, 0);
    default:
        return low ? PSD_ADAM(0, 1) : PSD_ADAM(0, 0);
    }
#undef PSD_ADAM
}

/* taken: the state already holds the squares (kasync, psd_adagrad_take) and g the weight decay of each of
 * its gradients; the step reads the state and adds neither. */
PSD_INLINE uint32_t adagrad_body(const struct step_scalars *k, const int wd_on, const int taken, float *restrict w,
                                 const float *restrict g, float *restrict sum, uint64_t lo, uint64_t hi) {
    const float gs = k->gscale, wd = k->wd, neg_clr = k->neg_clr, eps = k->eps;
    uint32_t bad = 0;
    for (uint64_t i = lo; i < hi; i++) {
        float d = psd_take1(g[i], &bad) * gs;
        if (wd_on)
            d = fmaf(wd, w[i], d);
        /* Taken: K gradients' squares are at least their sum's square over K (Cauchy-Schwarz), so the floor
         * changes nothing but where a round's first squares are missing (a round begun by a build before
         * psd_adagrad_take, restored mid-round), and a step stays within sqrt(K) x the lr there too. */
        float s = taken ? fmaxf(sum[i], d * d * k->inv_k) : sum[i] + d * d;
        if (!taken)
            sum[i] = s;
        w[i] = w[i] + neg_clr * (d / (sqrtf(s) + eps));
    }
    return bad;
}

PSD_KERNEL static uint32_t adagrad_range(const struct step_scalars *k, float *restrict w, const float *restrict g,
                                         float *restrict sum, uint64_t lo, uint64_t hi) {
#define PSD_ADAGRAD(d, t) adagrad_body(k, d, t, w, g, sum, lo, hi)
    if (k->squares_taken)
        return PSD_ADAGRAD(0, 1);
    return k->wd != 0.0f ? PSD_ADAGRAD(1, 0) : PSD_ADAGRAD(0, 0);
#undef PSD_ADAGRAD
}

/* psd_adagrad_take's body over [lo, hi) of float32 values (a bfloat16 chunk widened first, as step_chunk does):
 * each value of g read once and taken (psd_take1), with the weight decay a step of one process adds to it. */
PSD_KERNEL static uint32_t adagrad_take_range(float *restrict acc, float *restrict sum, const float *restrict g,
                                              const float *restrict w, float wd, int first, uint64_t lo,
                                              uint64_t hi) {
    uint32_t bad = 0;
    for (uint64_t i = lo; i < hi; i++) {
        float d = psd_take1(g[i], &bad);
        if (wd != 0.0f)
            d = fmaf(wd, w[i], d);
        acc[i] = first ? d : acc[i] + d;
        sum[i] = sum[i] + d * d;
    }
    return bad;
}

struct take_args {
    float *acc, *sum;
    const void *g;
    uint32_t gdtype;
    const float *w;
    float wd;
    int first;
};

static uint32_t take_item(const void *ctx, uint64_t lo, uint64_t hi) {
    const struct take_args *a = ctx;
    if (a->gdtype != PSD_DTYPE_BF16)
        return adagrad_take_range(a->acc, a->sum, a->g, a->w, a->wd, a->first, lo, hi);
    float wide[PSD_CHUNK];
    psd_bf16_widen(wide, (const uint16_t *)a->g + lo, hi - lo);
    return adagrad_take_range(a->acc + lo, a->sum + lo, wide, a->w + lo, a->wd, a->first, 0, hi - lo);
}

void psd_adagrad_take(float *acc, float *sum, const void *g, uint32_t gdtype, const float *w, double weight_decay,
                      uint64_t n, int first, int threads, struct psd_beat *beat, _Atomic uint64_t *nonfinite) {
    const struct take_args a = {acc, sum, g, gdtype, w, (float)weight_decay, first};
    run_chunks(n, threads, beat, nonfinite, take_item, &a);
}

/* psd_adam_take's body over [lo, hi) of float32 values: the moments as adam_body takes them (torch.lerp's
 * side `low`, Adam's L2 decay `l2`), acc the step direction (first) or plus it. */
PSD_INLINE uint32_t adam_take_body(const struct step_scalars *k, const int l2, const int low, const int first,
                                   float *restrict acc, float *restrict m, float *restrict v, const float *restrict g,
                                   const float *restrict w, uint64_t lo, uint64_t hi) {
    const float wd = k->wd, b1w = k->b1_weight, b1w_c = 1.0f - k->b1_weight, b2 = k->b2, omb2 = k->one_minus_b2;
    const float bc2 = k->bc2_sqrt, eps = k->eps, inv_bc1 = -k->neg_step_size; /* 1 / bc1 (lr 1) */
    const float dm = k->decay_mul; /* AdamW: 1 - lr wd, the decay of the steps before this one; else 1 */
    uint32_t bad = 0;
    for (uint64_t i = lo; i < hi; i++) {
        float d = psd_take1(g[i], &bad);
        if (l2)
            d = fmaf(wd, w[i], d);
        float a = m[i];
        float mi = low ? a + b1w * (d - a) : d - (d - a) * b1w_c;
        float vi = v[i] * b2 + omb2 * (d * d);
        m[i] = mi;
        v[i] = vi;
        float u = inv_bc1 * (mi / (sqrtf(vi) / bc2 + eps));
        acc[i] = first ? u : acc[i] * dm + u;
    }
    return bad;
}

PSD_KERNEL static uint32_t adam_take_range(const struct step_scalars *k, int l2, int first, float *restrict acc,
                                           float *restrict m, float *restrict v, const float *restrict g,
                                           const float *restrict w, uint64_t lo, uint64_t hi) {
    const int low = k->b1_weight < 0.5f;
#define PSD_TAKE(d, l, f) adam_take_body(k, d, l, f, acc, m, v, g, w, lo, hi)
    if (first)
        return l2 ? (low ? PSD_TAKE(1, 1, 1) : PSD_TAKE(1, 0, 1)) : (low ? PSD_TAKE(0, 1, 1) : PSD_TAKE(0, 0, 1));
    return l2 ? (low ? PSD_TAKE(1, 1, 0) : PSD_TAKE(1, 0, 0)) : (low ? PSD_TAKE(0, 1, 0) : PSD_TAKE(0, 0, 0));
#undef PSD_TAKE
}

struct adam_take_args {
    const struct step_scalars *k;
    float *acc, *m, *v;
    const void *g;
    uint32_t gdtype;
    const float *w;
    int l2, first;
};

static uint32_t adam_take_item(const void *ctx, uint64_t lo, uint64_t hi) {
    const struct adam_take_args *a = ctx;
    if (a->gdtype != PSD_DTYPE_BF16)
        return adam_take_range(a->k, a->l2, a->first, a->acc, a->m, a->v, a->g, a->w, lo, hi);
    float wide[PSD_CHUNK];
    psd_bf16_widen(wide, (const uint16_t *)a->g + lo, hi - lo);
    return adam_take_range(a->k, a->l2, a->first, a->acc + lo, a->m + lo, a->v + lo, wide, a->w + lo, 0, hi - lo);
}

/* Adam's scalars at step t: the moments' weights, eps, the bias corrections, the step size -lr / bc1. */
static void adam_scalars(struct step_scalars *k, const struct psd_config *c, double lr, uint64_t t) {
    k->wd = (float)c->weight_decay;
    k->b1_weight = (float)(1.0 - c->beta1);
    k->b2 = (float)c->beta2;
    k->one_minus_b2 = (float)(1.0 - c->beta2);
    k->eps = (float)c->eps;
    double bc1 = 1.0 - pow(c->beta1, (double)t), bc2 = 1.0 - pow(c->beta2, (double)t);
    k->neg_step_size = (float)-(lr / bc1);
    k->bc2_sqrt = (float)sqrt(bc2);
}

void psd_adam_take(float *acc, float *m, float *v, const void *g, uint32_t gdtype, const float *w,
                   const struct psd_config *c, double lr, uint64_t t, uint64_t n, int first, int threads,
                   struct psd_beat *beat, _Atomic uint64_t *nonfinite) {
    struct step_scalars k = {0};
    adam_scalars(&k, c, 1.0, t); /* the direction alone: acc is multiplied by the round's lr */
    /* AdamW: one process's later steps decay what the earlier ones moved (x = x (1 - lr wd) - lr u each), so
     * the sum weighs an earlier direction by the decay since: acc = acc (1 - lr wd) + u. Adam: acc + u. */
    k.decay_mul = c->optimizer == PSD_OPT_ADAMW ? (float)(1.0 - lr * c->weight_decay) : 1.0f;
    const int l2 = c->optimizer == PSD_OPT_ADAM && c->weight_decay != 0.0;
    const struct adam_take_args a = {&k, acc, m, v, g, gdtype, w, l2, first};
    run_chunks(n, threads, beat, nonfinite, adam_take_item, &a);
}

static uint32_t step_range(const struct psd_config *c, const struct step_scalars *k, float *w, const float *g,
                           float *s0, float *s1, uint64_t lo, uint64_t hi) {
    switch (c->optimizer) {
    case PSD_OPT_MOMENTUM:
    case PSD_OPT_NESTEROV:
        return momentum_range(k, c->optimizer == PSD_OPT_NESTEROV, w, g, s0, lo, hi);
    case PSD_OPT_ADAM:
    case PSD_OPT_ADAMW:
        return adam_range(k, c->optimizer == PSD_OPT_ADAMW, w, g, s0, s1, lo, hi);
    case PSD_OPT_ADAGRAD:
        return adagrad_range(k, w, g, s0, lo, hi);
    default:
        return sgd_range(k, w, g, lo, hi);
    }
}

/* step_range over [lo, hi) with a float32 or a bfloat16 gradient: a bfloat16 chunk is widened (each
 * value loaded once) into a buffer of the calling thread's first (at most PSD_CHUNK floats: it stays in
 * cache). Nonzero if any value was not finite (each moved nothing, as a zero gradient would). */
static uint32_t step_chunk(const struct psd_config *c, const struct step_scalars *k, float *w, const void *g,
                           uint32_t gdtype, float *s0, float *s1, uint64_t lo, uint64_t hi) {
    if (gdtype != PSD_DTYPE_BF16)
        return step_range(c, k, w, g, s0, s1, lo, hi);
    float wide[PSD_CHUNK];
    psd_bf16_widen(wide, (const uint16_t *)g + lo, hi - lo);
    return step_range(c, k, w + lo, wide, s0 + lo, s1 + lo, 0, hi - lo);
}

struct step_args {
    const struct psd_config *c;
    const struct step_scalars *k;
    float *w;
    const void *g;
    uint32_t gdtype;
    float *s0, *s1;
};

static uint32_t step_item(const void *ctx, uint64_t lo, uint64_t hi) {
    const struct step_args *a = ctx;
    return step_chunk(a->c, a->k, a->w, a->g, a->gdtype, a->s0, a->s1, lo, hi);
}

void psd_optimizer_step(const struct psd_config *c, double momentum, float *w, const void *g, uint32_t gdtype,
                        float gscale, float *s0, float *s1, uint64_t n, double lr, uint64_t t, int threads,
                        struct psd_beat *beat, _Atomic uint64_t *nonfinite) {
    struct step_scalars k = {0};
    k.gscale = gscale;
    k.lr = (float)lr;
    k.neg_lr = (float)-lr;
    k.wd = (float)c->weight_decay;
    k.mom = (float)momentum;
    k.one_minus_damp = (float)(1.0 - c->dampening);
    k.first = t == 1;
    k.squares_taken = (c->cfg_flags & PSD_CFG_LOOP_SQUARES_TAKEN) != 0;
    k.inv_k = 1.0f / (float)(c->sync_param > 1 ? c->sync_param : 1);
    adam_scalars(&k, c, lr, t);
    k.decay_mul = (float)(1.0 - lr * c->weight_decay);
    if (k.squares_taken) /* a kasync round of Adam: the decoupled decay of the t steps it took (adam_taken_body) */
        k.decay_mul_k = (float)pow(1.0 - lr * c->weight_decay, (double)t);
    k.neg_clr = (float)-(lr / (1.0 + (double)(t - 1) * c->lr_decay));
    if (c->optimizer == PSD_OPT_SGD && c->weight_decay == 0.0 && gscale == 1.0f) {
        psd_apply_sgd(w, g, gdtype, n, (float)lr, threads, beat, nonfinite); /* the plain, fastest path */
        return;
    }
    const struct step_args a = {c, &k, w, g, gdtype, s0, s1};
    run_chunks(n, threads, beat, nonfinite, step_item, &a);
}

int psd_predict(const struct psd_map *m, float *dst, uint64_t n, uint64_t lo, uint64_t hi, double staleness) {
    const struct psd_header *h = psd_hdr(m);
    if (n != m->g.n_params || lo > hi || hi > m->g.n_train)
        return EINVAL;
    uint64_t t = PSD_LOAD_ACQ(&h->opt_steps);
    uint64_t bits = PSD_LOAD_RLX(&h->lr_bits);
    double lr;
    memcpy(&lr, &bits, sizeof lr);
    if (t == 0 || staleness <= 0.0 || lr == 0.0)
        return 0; /* nothing to predict from yet */
    const float *s0 = psd_state(m, 0), *s1 = psd_state(m, 1);
    /* The optimizer is read from the header: its direction must lie in the state this mapping
     * was grown with (momentum: one vector, Adam: two). */
    uint32_t needs = h->cfg.optimizer == PSD_OPT_ADAM || h->cfg.optimizer == PSD_OPT_ADAMW ? 2 : 1;
    if (m->g.state_vectors < needs)
        return PSD_ESTATE;
    /* [lo, hi) within the trainable weights (the optimizer state covers them; frozen ones never move). */
    switch (h->cfg.optimizer) {
    case PSD_OPT_MOMENTUM:
    case PSD_OPT_NESTEROV: {
        /* Momentum SGD moves lr * buf per step once the buffer settles. */
        float scale = (float)(lr * staleness);
        for (uint64_t i = lo; i < hi; i++)
            dst[i] -= scale * s0[i];
        return 0;
    }
    case PSD_OPT_ADAM:
    case PSD_OPT_ADAMW: {
        /* Adam moves lr * m_hat / (sqrt(v_hat) + eps) per step; under kasync:K an update is K steps, the
         * moments K steps on (psd_adam_take). */
        double k = (double)psd_kasync_k(&h->cfg);
        double bc1 = 1.0 - pow(h->cfg.beta1, (double)t * k), bc2 = 1.0 - pow(h->cfg.beta2, (double)t * k);
        float scale = (float)(lr * staleness * k / bc1), bc2_sqrt = (float)sqrt(bc2), eps = (float)h->cfg.eps;
        for (uint64_t i = lo; i < hi; i++)
            dst[i] -= scale * (s0[i] / (sqrtf(s1[i]) / bc2_sqrt + eps));
        return 0;
    }
    default:
        return PSD_ESTATE; /* sgd and adagrad publish no update direction */
    }
}

bool psd_sparse_ok(const struct psd_config *c) {
    return c->optimizer != PSD_OPT_ADAM && c->optimizer != PSD_OPT_ADAMW && c->weight_decay == 0.0;
}

/* A sparse piece: a uint64 row count, the int64 row indices, then the rows
 * (float32). Read with memcpy: the span is only 4-byte aligned. */
static uint64_t sparse_count(const void *span) {
    uint64_t nnz;
    memcpy(&nnz, span, sizeof nnz);
    return nnz;
}

static int64_t sparse_row(const void *span, uint64_t k) {
    int64_t r;
    memcpy(&r, (const uint8_t *)span + 8 + 8 * k, sizeof r);
    return r;
}

static const float *sparse_values(const void *span, uint64_t nnz) {
    return (const float *)((const uint8_t *)span + 8 + 8 * nnz);
}

int64_t psd_sparse_rows(const void *span, uint64_t cap, uint64_t rows, uint64_t row_len) {
    uint64_t nnz = sparse_count(span);
    /* nnz <= rows and rows * row_len == cap < 2^40 bound every product below. */
    if (row_len == 0 || nnz > rows || rows * row_len != cap || 8 + 8 * nnz + 4 * nnz * row_len > 4 * cap)
        return -1;
    for (uint64_t k = 0; k < nnz; k++) {
        int64_t r = sparse_row(span, k);
        if (r < 0 || (uint64_t)r >= rows)
            return -1;
    }
    return (int64_t)nnz;
}

/* The row count of a sparse piece of a tensor of len elements, 0 if it does not fit: the entry
 * was checked (psd_sparse_rows), but a learner can still write into it, so the kernels below
 * bound every count and row index they read again. */
static uint64_t sparse_count_within(const void *span, uint64_t len, uint64_t row_len) {
    uint64_t nnz = sparse_count(span);
    return nnz <= len / row_len && 8 + 8 * nnz + 4 * nnz * row_len <= 4 * len ? nnz : 0;
}

/* A sparse row's value, loaded once: a NaN or an infinity raises *bad and reads as 0. */
static inline float sparse_value(const float *v, uint64_t at, uint32_t *bad) { return psd_take1(v[at], bad); }

void psd_sparse_step(struct psd_rowlog_writer *log, uint64_t piece, const struct psd_config *c, float *w,
                     const void *span, uint64_t len, uint64_t row_len, float gscale, float *s0, double lr,
                     uint64_t t, _Atomic uint64_t *nonfinite) {
    uint64_t nnz = sparse_count_within(span, len, row_len), rows = len / row_len;
    uint32_t bad = 0;
    const float *v = sparse_values(span, nnz);
    if (nnz > log->m->g.rowlog_cap / 4) { /* too many rows to log: the piece whole */
        psd_rowlog_put(log, piece, PSD_ROWLOG_WHOLE);
        log = NULL;
    }
    if (c->optimizer == PSD_OPT_ADAGRAD) {
        /* torch's sparse Adagrad: sum[rows] += g^2; w[rows] -= clr * g / (sqrt(sum[rows]) + eps). */
        float neg_clr = (float)-(lr / (1.0 + (double)(t - 1) * c->lr_decay)), eps = (float)c->eps;
        for (uint64_t k = 0; k < nnz; k++) {
            uint64_t r = (uint64_t)sparse_row(span, k), base = r * row_len;
            if (log && r < rows)
                psd_rowlog_put(log, piece, r); /* the row read once: what is logged is what moves */
            for (uint64_t j = 0; r < rows && j < row_len; j++) {
                float d = sparse_value(v, k * row_len + j, &bad) * gscale, s = s0[base + j] + d * d;
                s0[base + j] = s;
                w[base + j] = w[base + j] + neg_clr * (d / (sqrtf(s) + eps));
            }
        }
    } else {
        float neg_lr = (float)-lr; /* torch's SGD: w[rows] += -lr * g */
        for (uint64_t k = 0; k < nnz; k++) {
            uint64_t r = (uint64_t)sparse_row(span, k), base = r * row_len;
            if (log && r < rows)
                psd_rowlog_put(log, piece, r);
            for (uint64_t j = 0; r < rows && j < row_len; j++)
                w[base + j] = w[base + j] + neg_lr * (sparse_value(v, k * row_len + j, &bad) * gscale);
        }
    }
    if (bad && nonfinite)
        PSD_ADD_RLX(nonfinite, bad);
}

void psd_sparse_add(float *acc, const void *span, uint64_t len, uint64_t row_len, float *squares,
                    _Atomic uint64_t *nonfinite) {
    uint64_t nnz = sparse_count_within(span, len, row_len), rows = len / row_len;
    uint32_t bad = 0;
    const float *v = sparse_values(span, nnz);
    for (uint64_t k = 0; k < nnz; k++) {
        uint64_t r = (uint64_t)sparse_row(span, k);
        float *row = acc + r * row_len;
        for (uint64_t j = 0; r < rows && j < row_len; j++) {
            float x = sparse_value(v, k * row_len + j, &bad); /* read once: the sum and the square agree */
            row[j] += x;
            if (squares)
                squares[r * row_len + j] += x * x;
        }
    }
    if (bad && nonfinite)
        PSD_ADD_RLX(nonfinite, bad);
}
