/*
 * pull.c -- the learner's pull thread, in C so it never waits for the GIL.
 *
 * GaDei's hand-off: the training thread asks for a pull after each step (a
 * queue of one: asking again before the pull happened changes nothing); this
 * thread copies the shared trainable weights (the first n of them: frozen ones
 * never move, and both buffers hold them from the start) into the back buffer
 * when the server's clock has moved, and marks it fresh; the training thread takes a fresh back
 * buffer at its next step and swaps it with the front one it trains on. The
 * thread never touches a buffer that the training thread may be reading: it
 * writes only the back buffer, and only while it is not fresh.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "psd.h"

#define PULL_CHUNK 4096 /* floats read from the shared weights at a time (16 KiB: stays in L1) */

struct psd_puller {
    struct psd_map *m;
    uint32_t slot;
    float *buf[2];
    uint64_t n;
    pthread_t thread;
    struct psd_cond want;       /* bumped by psd_puller_request */
    _Atomic uint32_t wanted;    /* requests not yet served */
    _Atomic uint32_t back;      /* index of the back buffer; flipped only by psd_puller_take */
    _Atomic uint32_t fresh;     /* back holds newer weights than front: set here (release), cleared by take */
    _Atomic uint64_t front_clock, back_clock;
    _Atomic int stop;
    float chunk[PULL_CHUNK]; /* the pull thread's own: what hogwild_read writes */
};

/* The one unlocked read of the shared weights (Hogwild: the update loop writes them meanwhile;
 * a pull holds every update up to the clock loaded before it, and maybe parts of later ones).
 * Not inlined, and it writes only the thread's own chunk, so that tests/native/tsan.supp can
 * suppress exactly this read, while a race on the buffers the learner reads is still reported. */
__attribute__((noinline)) static void hogwild_read(float *chunk, const float *weights, uint64_t n) {
    memcpy(chunk, weights, n * sizeof(float));
}

/* Copy the shared weights into dst, a chunk at a time through hogwild_read. */
static void pull_weights(struct psd_puller *P, float *dst) {
    const float *w = psd_weights(P->m);
    for (uint64_t off = 0; off < P->n; off += PULL_CHUNK) {
        uint64_t k = P->n - off < PULL_CHUNK ? P->n - off : PULL_CHUNK;
        hogwild_read(P->chunk, w + off, k);
        memcpy(dst + off, P->chunk, k * sizeof(float));
    }
}

static void *puller_main(void *arg) {
    struct psd_puller *P = arg;
    struct psd_header *h = psd_hdr(P->m);
    struct psd_lslot *s = psd_lslot_at(P->m, P->slot);
    while (!atomic_load(&P->stop)) {
        uint32_t seen = psd_cond_prepare(&P->want);
        /* Pairs with the release store of fresh = 0 in psd_puller_take: the back buffer is ours again. */
        if (!atomic_load(&P->wanted) || atomic_load_explicit(&P->fresh, memory_order_acquire)) {
            psd_cond_wait(&P->want, seen, PSD_WAIT_SLICE_NS);
            psd_cond_done(&P->want);
            continue;
        }
        psd_cond_done(&P->want);
        atomic_store(&P->wanted, 0);
        /* Pairs with the store-release of clock in the update loop. */
        uint64_t clock = PSD_LOAD_ACQ(&h->clock);
        if (clock == atomic_load(&P->front_clock)) {
            PSD_ADD_RLX(&s->pulls_skipped, 1); /* the learner's weights are current */
            continue;
        }
        pull_weights(P, P->buf[atomic_load(&P->back)]);
        PSD_ADD_RLX(&s->pulls, 1);
        atomic_store(&P->back_clock, clock);
        atomic_store_explicit(&P->fresh, 1, memory_order_release); /* pairs with the acquire in take */
    }
    return NULL;
}

int psd_puller_start(struct psd_map *m, uint32_t slot, float *a, float *b, uint64_t n, uint64_t clock,
                     struct psd_puller **out) {
    struct psd_puller *P = calloc(1, sizeof *P);
    if (!P)
        return ENOMEM;
    P->m = m;
    P->slot = slot;
    P->buf[0] = a; /* front */
    P->buf[1] = b; /* back */
    P->n = n;
    psd_cond_init(&P->want);
    atomic_init(&P->back, 1);
    atomic_init(&P->front_clock, clock);
    int rc = pthread_create(&P->thread, NULL, puller_main, P);
    if (rc) {
        free(P);
        return rc;
    }
    *out = P;
    return 0;
}

void psd_puller_request(struct psd_puller *P) {
    atomic_store(&P->wanted, 1);
    psd_cond_broadcast_if_waiters(&P->want);
}

/* If the back buffer is fresh, make it the front: returns its index, or -1. */
int psd_puller_take(struct psd_puller *P, uint64_t *clock) {
    if (!atomic_load_explicit(&P->fresh, memory_order_acquire)) /* pairs with the release in puller_main */
        return -1;
    uint32_t front = atomic_load(&P->back);
    atomic_store(&P->back, front ^ 1u);
    *clock = atomic_load(&P->back_clock);
    atomic_store(&P->front_clock, *clock);
    PSD_STORE_RLX(&psd_lslot_at(P->m, P->slot)->learner_clock, *clock); /* for psd status */
    atomic_store_explicit(&P->fresh, 0, memory_order_release); /* the old front may be written now */
    psd_puller_request(P); /* a pull may have been skipped while fresh was set */
    return (int)front;
}

void psd_puller_set_front_clock(struct psd_puller *P, uint64_t clock) {
    atomic_store(&P->front_clock, clock);
}

void psd_puller_stop(struct psd_puller *P) {
    atomic_store(&P->stop, 1);
    psd_cond_broadcast(&P->want);
    pthread_join(P->thread, NULL);
    free(P);
}
