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

/* The Hogwild read of a changed-rows pull (as hogwild_read: the update loop may be writing these
 * weights; tests/native/tsan.supp names exactly this function). */
__attribute__((noinline)) static void hogwild_copy(float *dst, const float *weights, uint64_t n) {
    memcpy(dst, weights, n * sizeof(float));
}

uint64_t psd_pull_changed(struct psd_map *m, uint32_t slot, float *dst, uint64_t known, uint64_t *pos,
                          uint64_t *epoch, const struct psd_piece_geom *pieces, uint64_t n_pieces, uint8_t *whole,
                          uint64_t *bytes) {
    struct psd_header *h = psd_hdr(m);
    struct psd_lslot *s = psd_lslot_at(m, slot);
    const float *w = psd_weights(m);
    /* Pairs with the store-release of clock in the update loop (and the release of weights_epoch
     * by whoever wrote weights outside an update). */
    uint64_t clock = PSD_LOAD_ACQ(&h->clock), ep = PSD_LOAD_ACQ(&h->weights_epoch);
    *bytes = 0;
    if (clock == known && ep == *epoch) {
        PSD_ADD_RLX(&s->pulls_skipped, 1);
        return clock;
    }
    /* Pairs with the store-release of rowlog_head in update_weights: the entries below it, and the
     * weights they name, of every update up to `clock` are written. */
    uint64_t head = PSD_LOAD_ACQ(&h->rowlog_head), n = m->g.n_train, copied = 0;
    bool all = ep != *epoch || *pos > head || head - *pos > m->g.rowlog_cap || n_pieces != m->g.n_pieces;
    memset(whole, 0, n_pieces);
    for (uint64_t i = *pos; i < head && !all; i++) {
        struct psd_rowlog_entry *e = psd_rowlog_at(m, i);
        uint64_t seq = PSD_LOAD_ACQ(&e->seq); /* pairs with the store-release of seq in psd_rowlog_put */
        /* Pair with the field store-releases in psd_rowlog_put: a field of a later write brings its
         * WRITING mark, so the second load of seq below tells a lapped entry. */
        uint64_t piece = PSD_LOAD_ACQ(&e->piece), row = PSD_LOAD_ACQ(&e->row);
        if (seq != i || PSD_LOAD_RLX(&e->seq) != i || piece >= n_pieces) {
            all = true; /* lapped by the loop while reading (or everything changed) */
            break;
        }
        const struct psd_piece_geom *pg = &pieces[piece];
        if (row == PSD_ROWLOG_WHOLE) {
            if (!whole[piece]) {
                whole[piece] = 1;
                hogwild_copy(dst + pg->off, w + pg->off, pg->len);
                copied += pg->len;
            }
        } else if (row < pg->len / pg->row_len) {
            if (!whole[piece]) {
                hogwild_copy(dst + pg->off + row * pg->row_len, w + pg->off + row * pg->row_len, pg->row_len);
                copied += pg->row_len;
            }
        } else {
            all = true;
        }
        all = all || copied > n; /* more than everything: a full copy costs less from here */
    }
    if (all) {
        hogwild_copy(dst, w, n);
        copied = n;
    }
    *bytes = copied * sizeof(float);
    *pos = head;
    *epoch = ep;
    psd_note_pull(m, slot, clock, false);
    return clock;
}

void psd_rowlog_mark(const struct psd_map *m, uint64_t *pos, uint64_t *epoch) {
    const struct psd_header *h = psd_hdr(m);
    *epoch = PSD_LOAD_ACQ(&h->weights_epoch); /* pairs with the release of a weights writer */
    *pos = PSD_LOAD_ACQ(&h->rowlog_head);     /* pairs with the store-release in update_weights */
}

void psd_note_pull(struct psd_map *m, uint32_t slot, uint64_t clock, bool skipped) {
    struct psd_lslot *s = psd_lslot_at(m, slot);
    PSD_STORE_RLX(&s->learner_clock, clock);
    PSD_ADD_RLX(skipped ? &s->pulls_skipped : &s->pulls, 1);
}

/* The owner's measured sharpness of the loss (learner/sharpness.py), for the server's gain level. */
void psd_note_sharpness(struct psd_map *m, uint32_t slot, double sharpness) {
    uint64_t bits;
    memcpy(&bits, &sharpness, sizeof bits);
    PSD_STORE_RLX(&psd_lslot_at(m, slot)->sharpness_bits, bits);
}

uint64_t psd_take_weights(struct psd_map *m, uint32_t slot, void *dst, uint64_t known) {
    /* Pairs with the store-release of clock in the update loop: the weights hold at least every
     * update up to it. */
    uint64_t clock = PSD_LOAD_ACQ(&psd_hdr(m)->clock);
    if (!dst) {
        PSD_STORE_RLX(&psd_lslot_at(m, slot)->learner_clock, clock);
        return clock;
    }
    if (clock != known)
        memcpy(dst, psd_weights(m), (size_t)(m->g.n_train * sizeof(float)));
    psd_note_pull(m, slot, clock, clock == known);
    return clock;
}
