/*
 * update.c -- the server's update loop, the consumer side of every ring.
 *
 * One native thread, never holding the GIL, visits the rings round-robin and
 * applies one gradient per ring per round (so a fast learner cannot starve a
 * slow one), in place, Hogwild style: w -= lr * g with OpenMP across the
 * vector. It spins for a short while after the last gradient it found, then
 * sleeps on the doorbell, so an idle server costs (almost) no CPU and a busy
 * one reacts in microseconds.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "psd.h"

struct psd_loop {
    struct psd_map *m;
    pthread_t thread;
    _Atomic int stop; /* set by psd_loop_stop, read each round */
    uint32_t threads;
    uint32_t cpus;
    uint64_t spin_ns;
};

void psd_apply_sgd(float *restrict w, const float *restrict g, uint64_t n, float lr, int threads) {
    /* Small vectors are not worth waking a team. */
    if (threads <= 1 || n < (UINT64_C(1) << 16)) {
        for (uint64_t i = 0; i < n; i++)
            w[i] -= lr * g[i];
        return;
    }
#pragma omp parallel for simd num_threads(threads) schedule(static)
    for (int64_t i = 0; i < (int64_t)n; i++)
        w[i] -= lr * g[i];
}

static void atomic_max(_Atomic uint64_t *p, uint64_t v) {
    uint64_t cur = PSD_LOAD_RLX(p);
    while (v > cur && !atomic_compare_exchange_weak_explicit(p, &cur, v, memory_order_relaxed,
                                                             memory_order_relaxed)) {
    }
}

static void apply_entry(struct psd_loop *L, uint32_t i, struct psd_slot *s, uint64_t head) {
    struct psd_map *m = L->m;
    struct psd_header *h = psd_hdr(m);
    struct psd_entry *e = psd_entry_at(m, i, head);
    uint64_t clock = PSD_LOAD_RLX(&h->clock); /* only this thread writes it */
    psd_apply_sgd(psd_weights(m), psd_entry_grad(e), h->n_params, (float)h->lr, (int)L->threads);
    uint64_t staleness = clock > e->clock ? clock - e->clock : 0;
    double loss = e->loss;
    uint64_t loss_bits;
    memcpy(&loss_bits, &loss, sizeof loss_bits);
    PSD_STORE_RLX(&s->last_loss_bits, loss_bits);
    PSD_ADD_RLX(&s->applied, 1);
    PSD_ADD_RLX(&s->staleness_sum, staleness);
    atomic_max(&s->staleness_max, staleness);
    PSD_ADD_RLX(&h->applied, 1);
    int32_t rank = PSD_LOAD_RLX(&s->rank);
    if (rank >= 0)
        PSD_ADD_RLX(&psd_rank_at(m, (uint32_t)rank)->applied, 1);
    PSD_ADD_RLX(&h->staleness_sum, staleness);
    atomic_max(&h->staleness_max, staleness);
    uint32_t bucket = staleness == 0 ? 0 : 64 - (uint32_t)__builtin_clzll(staleness);
    PSD_ADD_RLX(&h->staleness_hist[bucket < PSD_HIST_BUCKETS ? bucket : PSD_HIST_BUCKETS - 1], 1);
    /* Pairs with the load-acquire of clock before a learner's pull. */
    PSD_STORE_REL(&h->clock, clock + 1);
    /* The entry is free again: pairs with the load-acquire of head in
     * psd_push / has_space. seq_cst so the load of waiters below stays after it. */
    atomic_store(&s->head, head + 1);
    psd_cond_broadcast_if_waiters(&s->not_full);
}

/* A draining slot whose ring is empty: account for it and hand it back. */
static void free_slot(struct psd_map *m, struct psd_slot *s) {
    struct psd_header *h = psd_hdr(m);
    if (!psd_locked(psd_mutex_lock(h, &s->mutex)))
        return; /* try again next round */
    /* Pairs with the store of tail in psd_push. */
    uint64_t tail = PSD_LOAD_ACQ(&s->tail);
    if (PSD_LOAD_ACQ(&s->state) == PSD_SLOT_DRAINING && tail == PSD_LOAD_RLX(&s->head)) {
        PSD_ADD_RLX(&h->retired_pushed, tail);
        if (!psd_slot_owner_alive(s))
            PSD_ADD_RLX(&h->reclaimed, 1);
        PSD_STORE_RLX(&s->tail, 0);
        atomic_store(&s->head, 0);
        PSD_STORE_RLX(&s->not_full.waiters, 0); /* a dead waiter's announcement */
        PSD_STORE_RLX(&s->pid, 0);
        PSD_STORE_RLX(&s->rank, -1);
        PSD_STORE_RLX(&s->start_time, 0);
        /* Pairs with the load-acquire of state in psd_slot_claim. */
        PSD_STORE_REL(&s->state, PSD_SLOT_FREE);
    }
    psd_mutex_unlock(&s->mutex);
    psd_cond_broadcast_if_waiters(&s->not_full); /* a detaching learner waits for this */
}

/* One round over all rings; returns how many gradients it applied, and in
 * *busy how many learner slots are in use. */
static uint32_t round_robin(struct psd_loop *L, uint32_t *busy) {
    struct psd_map *m = L->m;
    struct psd_header *h = psd_hdr(m);
    uint32_t applied = 0;
    *busy = 0;
    for (uint32_t i = 0; i < h->n_slots; i++) {
        struct psd_slot *s = psd_slot_at(m, i);
        /* Pairs with the store-release of state in claim / release / reap. */
        uint32_t st = PSD_LOAD_ACQ(&s->state);
        if (st == PSD_SLOT_FREE)
            continue;
        ++*busy;
        uint64_t head = PSD_LOAD_RLX(&s->head); /* only this thread writes it */
        /* Pairs with the store of tail in psd_push: the entry is whole. */
        if (head != PSD_LOAD_ACQ(&s->tail)) {
            apply_entry(L, i, s, head);
            applied++;
        } else if (st == PSD_SLOT_DRAINING) {
            free_slot(m, s);
        }
    }
    return applied;
}

static bool any_pending(struct psd_map *m) {
    struct psd_header *h = psd_hdr(m);
    for (uint32_t i = 0; i < h->n_slots; i++) {
        struct psd_slot *s = psd_slot_at(m, i);
        uint32_t st = atomic_load(&s->state);
        /* seq_cst load: the other half of the Dekker pair in psd_push. */
        if (st == PSD_SLOT_DRAINING || (st == PSD_SLOT_ACTIVE && atomic_load(&s->tail) != atomic_load(&s->head)))
            return true;
    }
    return false;
}

/* Adaptive spinning: after a gradient, keep spinning for about twice the
 * recent gap between gradients (so a steady learner never finds the loop
 * asleep and pays for waking it), but only while the learners and this loop
 * fit on the cores; otherwise the spin would steal a learner's core. */
#define PSD_SPIN_MAX_NS (2ull * 1000 * 1000)

static uint64_t spin_budget(const struct psd_loop *L, uint64_t gap_ewma, uint32_t busy) {
    uint64_t spin = L->spin_ns;
    if (busy + L->threads <= L->cpus && 2 * gap_ewma > spin)
        spin = 2 * gap_ewma < PSD_SPIN_MAX_NS ? 2 * gap_ewma : PSD_SPIN_MAX_NS;
    return spin;
}

static void *loop_main(void *arg) {
    struct psd_loop *L = arg;
    struct psd_header *h = psd_hdr(L->m);
    uint64_t now = psd_now_ns(), last_work = now, last_beat = 0, gap_ewma = 0;
    uint32_t busy = 0;
    while (!atomic_load_explicit(&L->stop, memory_order_acquire)) {
        if (psd_loop_should_pause(L->m)) {
            psd_loop_pause(L->m, &L->stop);
            continue;
        }
        uint32_t applied = round_robin(L, &busy);
        now = psd_now_ns();
        if (now - last_beat >= PSD_HEARTBEAT_NS) {
            PSD_STORE_RLX(&h->heartbeat_ns, now);
            last_beat = now;
        }
        if (applied) {
            uint64_t gap = now - last_work;
            gap_ewma = gap_ewma ? (7 * gap_ewma + gap) / 8 : gap;
            last_work = now;
            continue;
        }
        if (now - last_work < spin_budget(L, gap_ewma, busy)) {
            __builtin_ia32_pause();
            continue;
        }
        uint32_t seen = atomic_load(&h->doorbell.seq);
        atomic_store(&h->sleeping, 1); /* seq_cst: the loop's half of the Dekker pair */
        if (!any_pending(L->m) && !atomic_load(&L->stop) && !psd_loop_should_pause(L->m))
            psd_cond_wait(&h->doorbell, seen, PSD_HEARTBEAT_NS * 5);
        atomic_store(&h->sleeping, 0);
        PSD_STORE_RLX(&h->heartbeat_ns, psd_now_ns());
        last_work = psd_now_ns() - L->spin_ns + L->spin_ns / 8; /* a short spin after waking */
    }
    return NULL;
}

int psd_loop_start(struct psd_map *m, uint32_t threads, uint32_t spin_us, struct psd_loop **out) {
    struct psd_loop *L = calloc(1, sizeof *L);
    if (!L)
        return ENOMEM;
    L->m = m;
    L->threads = threads ? threads : 1;
    L->spin_ns = (uint64_t)spin_us * 1000;
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    L->cpus = cpus > 0 ? (uint32_t)cpus : 1;
    atomic_init(&L->stop, 0);
    PSD_STORE_RLX(&psd_hdr(m)->heartbeat_ns, psd_now_ns());
    int rc = pthread_create(&L->thread, NULL, loop_main, L);
    if (rc) {
        free(L);
        return rc;
    }
    *out = L;
    return 0;
}

int psd_loop_stop(struct psd_loop *L) {
    atomic_store_explicit(&L->stop, 1, memory_order_release);
    psd_cond_broadcast(&psd_hdr(L->m)->doorbell);
    int rc = pthread_join(L->thread, NULL);
    free(L);
    return rc;
}
