/*
 * ring.c -- learner slots and the producer side of each SPSC ring.
 *
 * A learner is the only producer of its ring: it writes an entry, then
 * store-releases the tail past it. The update loop (update.c) is the only
 * consumer. So a gradient is either wholly pushed (tail moved past it) and will
 * be applied exactly once, or it was never pushed; a learner that dies halfway
 * through writing leaves the tail where it was.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kernels.h"
#include "psd.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#define PSD_HAVE_STREAM 1
#endif

/* The claim token m holds for `slot`, 0 if none. */
static uint64_t held_token(const struct psd_map *m, uint32_t slot) {
    return slot < m->n_held ? PSD_LOAD_RLX(&m->held[slot]) : 0;
}

/* m's table of held slots, made once (claims of one mapping may come from several threads: a lock
 * of this process's own, never one in the arena). */
static pthread_mutex_t held_lock = PTHREAD_MUTEX_INITIALIZER;

static int held_table(struct psd_map *m, uint32_t n_slots) {
    if (n_slots == 0 || n_slots > PSD_MAX_SLOTS)
        return EINVAL;
    int rc = 0;
    pthread_mutex_lock(&held_lock);
    if (!m->held) {
        m->held = calloc(n_slots, sizeof *m->held);
        if (m->held)
            m->n_held = n_slots;
        else
            rc = ENOMEM;
    }
    pthread_mutex_unlock(&held_lock);
    return rc;
}

/* Take the request line of FREE slot i for a new request (compare-exchange from an answered or
 * empty nonce to PSD_NONCE_WRITING): lock-free, so no claimer waits on anything a learner can
 * scribble. A claimer that dies while writing leaves PSD_NONCE_WRITING, which the update loop clears
 * after a second; the loop also holds the line at PSD_NONCE_WRITING while it answers. */
static bool take_request_line(struct psd_map *m, uint32_t i) {
    struct psd_lslot *l = psd_lslot_at(m, i);
    struct psd_slot *s = psd_slot_at(m, i);
    /* Pairs with the store-release of req_nonce below, and of answered in answer(). */
    uint64_t n = PSD_LOAD_ACQ(&l->req_nonce);
    if (n == PSD_NONCE_WRITING || (n != 0 && n != PSD_LOAD_ACQ(&s->answered)))
        return false; /* another claimer's, not answered yet */
    if (!atomic_compare_exchange_strong(&l->req_nonce, &n, PSD_NONCE_WRITING))
        return false;
    /* The slot may have been admitted to another claimer since it was seen FREE (the line then
     * holds that claimer's answered nonce): give the line back as it was. */
    if (PSD_LOAD_ACQ(&s->state) != PSD_SLOT_FREE) {
        uint64_t w = PSD_NONCE_WRITING;
        atomic_compare_exchange_strong(&l->req_nonce, &w, n);
        return false;
    }
    return true;
}

/* A claim request's nonce: never 0, never the same twice in one process. */
static uint64_t fresh_nonce(void) {
    static _Atomic uint64_t counter; /* relaxed: only uniqueness matters */
    uint64_t n = (psd_now_ns() ^ ((uint64_t)getpid() << 40)) + PSD_ADD_RLX(&counter, 1) * UINT64_C(0x9E3779B97F4A7C15);
    return n ? n : 1;
}

static int server_check(struct psd_map *m) {
    /* A dead server is noticed within one wait slice, not at the deadline. */
    return psd_server_alive(m, 0) ? 0 : PSD_ESERVER;
}

/* Wait for the server's answer to request `nonce` in slot i: 0 once answered. */
static int await_answer(struct psd_map *m, uint32_t i, uint64_t nonce, uint64_t deadline) {
    struct psd_slot *s = psd_slot_at(m, i);
    for (;;) {
        uint32_t seen = atomic_load(&s->not_full.seq); /* the loop bumps it after every answer */
        /* Pairs with the store-release of answered in psd_admit: the answer's fields are written. */
        if (PSD_LOAD_ACQ(&s->answered) == nonce)
            return 0;
        uint64_t now = psd_now_ns();
        int rc = server_check(m);
        if (rc == 0 && now >= deadline)
            rc = PSD_ETIMEOUT;
        if (rc)
            return rc;
        uint64_t left = deadline - now, slice = PSD_WAIT_SLICE_NS / 5;
        if ((rc = psd_cond_wait(&s->not_full, seen, left < slice ? left : slice)) == EINTR)
            return EINTR;
    }
}

/* Whether a process of this identity was evicted and a slot still keeps its record. */
static bool banned(const struct psd_map *m, int32_t pid, uint64_t start_time, uint64_t pid_ns) {
    for (uint32_t i = 0; i < m->g.n_slots; i++) {
        struct psd_slot *s = psd_slot_at(m, i);
        if (PSD_LOAD_ACQ(&s->state) == PSD_SLOT_EVICTED && PSD_LOAD_RLX(&s->evicted_pid) == pid &&
            PSD_LOAD_RLX(&s->evicted_start_time) == start_time && PSD_LOAD_RLX(&s->evicted_pid_ns) == pid_ns)
            return true;
    }
    return false;
}

static int claim_once(struct psd_map *m, pid_t pid, uint64_t start_time, int32_t rank, uint64_t deadline,
                      uint32_t *slot, uint64_t *claim);

int psd_slot_claim(struct psd_map *m, pid_t pid, uint64_t start_time, int32_t rank, uint64_t timeout_ns,
                   uint32_t *slot, uint64_t *claim) {
    struct psd_header *h = psd_hdr(m);
    /* Pairs with the store-release of READY in psd_arena_set_state. */
    if (PSD_LOAD_ACQ(&h->state) != PSD_ARENA_READY)
        return PSD_ESTATE;
    if (!psd_has_model(m))
        return PSD_ESTATE; /* not mapped at the grown size yet */
    uint64_t deadline = psd_now_ns() + timeout_ns;
    int rc = held_table(m, m->g.n_slots);
    if (rc)
        return rc;
    /* Slots this mapping lost (taken back, evicted, handed on) are not its to write any more. */
    for (uint32_t i = 0; i < m->n_held; i++) {
        uint64_t token = PSD_LOAD_RLX(&m->held[i]);
        struct psd_slot *s = psd_slot_at(m, i);
        uint32_t st = PSD_LOAD_ACQ(&s->state);
        if (token && token != UINT64_MAX &&
            (PSD_LOAD_RLX(&s->claims) != token || st == PSD_SLOT_FREE || st == PSD_SLOT_EVICTED))
            PSD_STORE_RLX(&m->held[i], 0);
    }
    /* The server refuses an evicted process; say so at once, also when no slot is free to ask in. */
    if (banned(m, pid, start_time, psd_pid_ns()))
        return PSD_EEVICTED;
    for (;;) {
        rc = claim_once(m, pid, start_time, rank, deadline, slot, claim);
        if (rc != EAGAIN)
            return rc;
        if (psd_now_ns() >= deadline)
            return PSD_ETIMEOUT;
    }
}

/* One claim request in the first FREE slot whose line this process can take: EAGAIN when its line
 * was taken from it (it stalled writing for over a second) or the server found the request garbled
 * (another claimer's stray write crossed it): the caller asks again. */
static int claim_once(struct psd_map *m, pid_t pid, uint64_t start_time, int32_t rank, uint64_t deadline,
                      uint32_t *slot, uint64_t *claim) {
    struct psd_header *h = psd_hdr(m);
    int rc;
    uint32_t i = 0;
    for (; i < m->g.n_slots; i++) {
        if (PSD_LOAD_ACQ(&psd_slot_at(m, i)->state) != PSD_SLOT_FREE || PSD_LOAD_RLX(&m->held[i]))
            continue;
        /* The request line is the learner block's: writable in this mapping from now on. */
        PSD_STORE_RLX(&m->held[i], UINT64_MAX); /* a placeholder until the claim's token */
        if ((rc = psd_arena_protect(m)) != 0) {
            PSD_STORE_RLX(&m->held[i], 0);
            psd_arena_protect(m);
            return rc;
        }
        if (take_request_line(m, i))
            break;
        PSD_STORE_RLX(&m->held[i], 0);
    }
    if (i == m->g.n_slots) {
        rc = psd_arena_protect(m);
        return rc ? rc : PSD_ENOSLOT;
    }
    struct psd_lslot *l = psd_lslot_at(m, i);
    uint64_t nonce;
    do
        nonce = fresh_nonce();
    while (nonce == PSD_NONCE_WRITING);
    int32_t req_rank = rank >= 0 && (uint32_t)rank < m->g.n_slots ? rank : -1;
    uint64_t pid_ns = psd_pid_ns();
    PSD_STORE_RLX(&l->req_pid, pid);
    PSD_STORE_RLX(&l->req_rank, req_rank);
    PSD_STORE_RLX(&l->req_start_time, start_time);
    PSD_STORE_RLX(&l->req_pid_ns, pid_ns);
    PSD_STORE_RLX(&l->req_check, psd_request_check(nonce, pid, req_rank, start_time, pid_ns));
    /* Pairs with the load-acquire of req_nonce in psd_admit: the request's fields are written. A
     * compare-exchange: if the loop freed the line from under this claimer (stalled over a second),
     * another claimer may be writing it now. */
    uint64_t writing = PSD_NONCE_WRITING;
    if (!atomic_compare_exchange_strong(&l->req_nonce, &writing, nonce)) {
        PSD_STORE_RLX(&m->held[i], 0);
        psd_arena_protect(m);
        return EAGAIN;
    }
    psd_cond_broadcast(&h->doorbell); /* the loop may be asleep */
    struct psd_slot *s = psd_slot_at(m, i);
    rc = await_answer(m, i, nonce, deadline);
    if (rc) {
        /* Withdraw the request. The loop holds the line at WRITING while it answers, so the
         * compare-exchange fails exactly when an answer is being written: wait that out (briefly;
         * the server's death ends the wait too). After either, an admitted slot is given back; one
         * that stays admitted for want of a server is reaped, as its owner never beats for it. A
         * signal (EINTR) is no failure: a slot admitted meanwhile is kept (given back, it would be
         * DRAINING, and the caller's retry of the claim find no free slot: a full job's claimer then
         * failed for a signal its handler had dealt with); else the caller asks again. */
        uint64_t mine = nonce;
        if (!atomic_compare_exchange_strong(&l->req_nonce, &mine, 0))
            await_answer(m, i, nonce, psd_now_ns() + PSD_WAIT_SLICE_NS);
        bool admitted = PSD_LOAD_ACQ(&s->answered) == nonce && PSD_LOAD_RLX(&s->refused) == PSD_REFUSE_NONE;
        if (!(admitted && rc == EINTR)) {
            if (admitted) {
                PSD_STORE_REL(&l->release, PSD_LOAD_RLX(&s->claims));
                psd_cond_broadcast(&h->doorbell);
            }
            PSD_STORE_RLX(&m->held[i], 0);
            psd_arena_protect(m);
            return rc;
        }
    }
    uint32_t refused = PSD_LOAD_RLX(&s->refused);
    if (refused != PSD_REFUSE_NONE) {
        PSD_STORE_RLX(&m->held[i], 0);
        psd_arena_protect(m);
        if (refused == PSD_REFUSE_GARBLED)
            return EAGAIN; /* what this claimer wrote is checked; something else wrote over it */
        return refused == PSD_REFUSE_EVICTED ? PSD_EEVICTED : refused == PSD_REFUSE_GONE ? ESRCH : EINVAL;
    }
    *slot = i;
    *claim = PSD_LOAD_RLX(&s->claims);
    PSD_STORE_RLX(&m->held[i], *claim); /* read by this process's pushes and lease thread */
    return psd_lease_start(m);
}

static bool still_mine(struct psd_slot *s, uint64_t claim) {
    return PSD_LOAD_RLX(&s->claims) == claim && PSD_LOAD_ACQ(&s->state) == PSD_SLOT_ACTIVE;
}

int psd_slot_release(struct psd_map *m, uint32_t slot, uint64_t claim) {
    if (slot >= m->g.n_slots || held_token(m, slot) != claim || !still_mine(psd_slot_at(m, slot), claim))
        return PSD_ESLOT;
    struct psd_header *h = psd_hdr(m);
    /* Pairs with the load-acquire of release in psd_admit: the loop drains the ring, then frees it. */
    PSD_STORE_REL(&psd_lslot_at(m, slot)->release, claim);
    psd_cond_broadcast(&h->doorbell);
    return 0;
}

/* ---- the server's side of slot ownership (the update loop's thread) ---------------------- */

/* A claim request as the loop copied it out of the learner page. */
struct request {
    int32_t req_pid, req_rank;
    uint64_t req_start_time, req_pid_ns, req_check;
};

/* Answer the request with nonce n in FREE slot i, from the copy `r` the loop took of it. */
static bool answer(struct psd_map *m, uint32_t i, uint64_t n, const struct request *r) {
    struct psd_header *h = psd_hdr(m);
    struct psd_slot *s = psd_slot_at(m, i);
    uint32_t refused = PSD_REFUSE_NONE;
    if (r->req_check != psd_request_check(n, r->req_pid, r->req_rank, r->req_start_time, r->req_pid_ns))
        refused = PSD_REFUSE_GARBLED;
    else if (r->req_rank < -1 || (r->req_rank >= 0 && (uint32_t)r->req_rank >= m->g.n_slots))
        refused = PSD_REFUSE_RANK;
    else if (banned(m, r->req_pid, r->req_start_time, r->req_pid_ns))
        refused = PSD_REFUSE_EVICTED;
    else if (r->req_pid <= 0 || psd_liveness(h, r->req_pid, r->req_start_time, r->req_pid_ns) == PSD_LIVE_NO)
        refused = PSD_REFUSE_GONE;
    PSD_STORE_RLX(&s->refused, refused);
    if (refused == PSD_REFUSE_NONE) {
        struct psd_lslot *l = psd_lslot_at(m, i);
        /* Store-releases: pair with the reaper's load-acquires of the identity. A reaper that reads
         * any of this new owner's identity also sees the slot left its last owner's ACTIVE. */
        PSD_STORE_REL(&s->pid, r->req_pid);
        PSD_STORE_REL(&s->start_time, r->req_start_time);
        PSD_STORE_REL(&s->pid_ns, r->req_pid_ns);
        PSD_STORE_RLX(&s->rank, r->req_rank);
        /* A fresh 64-bit token, not a count: a stray write into the owner's `release` (or an entry's
         * `claim`) cannot name it by chance. Never 0 or the claim placeholder. */
        uint64_t token = PSD_LOAD_RLX(&s->claims);
        do
            token = fresh_nonce() ^ (token * UINT64_C(0xBF58476D1CE4E5B9));
        while (token == 0 || token == UINT64_MAX);
        PSD_STORE_RLX(&s->claims, token);
        PSD_STORE_RLX(&s->applied, 0);
        PSD_STORE_RLX(&s->rejected, 0);
        PSD_STORE_RLX(&s->dropped, 0);
        PSD_STORE_RLX(&s->ignored, 0);
        PSD_STORE_RLX(&s->staleness_sum, 0);
        PSD_STORE_RLX(&s->staleness_max, 0);
        PSD_STORE_RLX(&s->last_loss_bits, UINT64_C(0x7ff8000000000000)); /* NaN: no loss reported yet */
        PSD_STORE_RLX(&s->round_joined, 0);
        PSD_STORE_RLX(&s->reap_reason, PSD_REAP_NONE);
        PSD_STORE_RLX(&s->lease_seen_ns, 0); /* the reaper starts the lease afresh */
        PSD_STORE_RLX(&s->lease_moved, 0);   /* the owner has yet to beat for it */
        PSD_STORE_RLX(&s->evicted_pid, 0);
        PSD_STORE_RLX(&s->evicted_rule, PSD_RULE_NONE);
        PSD_STORE_RLX(&s->evicted_start_time, 0);
        PSD_STORE_RLX(&s->evicted_pid_ns, 0);
        PSD_STORE_RLX(&s->evicted_entries, 0);
        /* The learner page starts clean, whatever was written into it while the slot was free. */
        PSD_STORE_RLX(&l->tail, 0);
        PSD_STORE_RLX(&l->release, 0);
        PSD_STORE_RLX(&l->learner_clock, 0);
        PSD_STORE_RLX(&l->pulls, 0);
        PSD_STORE_RLX(&l->pulls_skipped, 0);
        PSD_STORE_RLX(&l->full_waits, 0);
        PSD_STORE_RLX(&l->waiters, 0);
        PSD_STORE_RLX(&l->lease_beat, 0);
        PSD_STORE_RLX(&s->head, 0);
        /* ssp: join at the slowest live learner's clock: its base plus its tail, the tail taken only
         * as far as the ring holds past the loop's own head (a learner's scribble moves no base far). */
        uint64_t slowest = UINT64_MAX;
        for (uint32_t j = 0; j < m->g.n_slots; j++) {
            struct psd_slot *o = psd_slot_at(m, j);
            if (j == i || PSD_LOAD_ACQ(&o->state) != PSD_SLOT_ACTIVE)
                continue;
            uint64_t head = PSD_LOAD_RLX(&o->head), tail = PSD_LOAD_RLX(&psd_lslot_at(m, j)->tail);
            uint64_t c = PSD_LOAD_RLX(&o->ssp_base) + head +
                         (tail >= head && tail - head <= m->g.ring_k ? tail - head : 0);
            if (c < slowest && psd_slot_owner_alive(h, o))
                slowest = c;
        }
        PSD_STORE_RLX(&s->ssp_base, slowest == UINT64_MAX ? 0 : slowest);
        /* Pairs with the load-acquire of state in the learner's checks, the reaper and the loop. */
        PSD_STORE_REL(&s->state, PSD_SLOT_ACTIVE);
    }
    /* Pairs with the load-acquire of answered in await_answer and request_pending. */
    PSD_STORE_REL(&s->answered, n);
    psd_cond_broadcast(&s->not_full);
    return refused == PSD_REFUSE_NONE;
}

int psd_slot_assign(struct psd_map *m, pid_t pid, uint64_t start_time, int32_t rank, uint32_t *slot,
                    uint64_t *claim) {
    struct psd_header *h = psd_hdr(m);
    if (m->role != PSD_ROLE_FULL)
        return EPERM;
    if (PSD_LOAD_ACQ(&h->state) != PSD_ARENA_READY || !psd_has_model(m))
        return PSD_ESTATE;
    int rc = held_table(m, m->g.n_slots);
    if (rc)
        return rc;
    for (uint32_t i = 0; i < m->g.n_slots; i++) {
        /* Holding the request line, nobody else answers for this slot (the loop skips a line being written). */
        if (PSD_LOAD_ACQ(&psd_slot_at(m, i)->state) != PSD_SLOT_FREE || !take_request_line(m, i))
            continue;
        struct psd_lslot *l = psd_lslot_at(m, i);
        int32_t req_rank = rank >= 0 && (uint32_t)rank < m->g.n_slots ? rank : -1;
        uint64_t nonce = fresh_nonce(), pid_ns = psd_pid_ns();
        const struct request r = {pid, req_rank, start_time, pid_ns,
                                  psd_request_check(nonce, pid, req_rank, start_time, pid_ns)};
        bool ok = answer(m, i, nonce, &r);
        PSD_STORE_REL(&l->req_nonce, nonce); /* answered already: nothing pending */
        if (!ok)
            return PSD_EEVICTED;
        *slot = i;
        *claim = PSD_LOAD_RLX(&psd_slot_at(m, i)->claims);
        PSD_STORE_RLX(&m->held[i], *claim);
        return psd_lease_start(m); /* an owner that never beats loses the slot to the reaper */
    }
    return PSD_ENOSLOT;
}

uint32_t psd_admit(struct psd_map *m) {
    struct psd_header *h = psd_hdr(m);
    uint32_t changed = 0;
    for (uint32_t i = 0; i < m->g.n_slots; i++) {
        struct psd_slot *s = psd_slot_at(m, i);
        struct psd_lslot *l = psd_lslot_at(m, i);
        uint32_t st = PSD_LOAD_ACQ(&s->state);
        if (st == PSD_SLOT_ACTIVE) {
            uint64_t claims = PSD_LOAD_RLX(&s->claims);
            /* Pairs with the store-release of release in psd_slot_release, and of reap_claim in
             * psd_reap: the owner gave the slot back, or the reaper judged this very claim gone. */
            bool released = PSD_LOAD_ACQ(&l->release) == claims, reaped = PSD_LOAD_ACQ(&s->reap_claim) == claims;
            uint32_t want = PSD_SLOT_ACTIVE;
            if ((released || reaped) && atomic_compare_exchange_strong(&s->state, &want, PSD_SLOT_DRAINING)) {
                if (reaped && !released)
                    PSD_STORE_RLX(&s->reap_reason, PSD_LOAD_RLX(&s->reap_why));
                changed++;
                psd_cond_broadcast_if_waiters(&h->sync_cond); /* ssp: the slowest may have left */
            }
            continue;
        }
        if (st != PSD_SLOT_FREE)
            continue;
        /* Pairs with the store-release (compare-exchange) of req_nonce in claim_once. */
        uint64_t n = PSD_LOAD_ACQ(&l->req_nonce);
        if (n == PSD_NONCE_WRITING) {
            /* A claimer is writing its request, or died doing so: after a second the line is freed
             * (a claimer that was only slow finds it gone when it publishes, and asks again). */
            uint64_t now = psd_now_ns(), since = PSD_LOAD_RLX(&s->line_seen_ns);
            if (since == 0) {
                PSD_STORE_RLX(&s->line_seen_ns, now);
            } else if (now - since > UINT64_C(1000000000)) {
                atomic_compare_exchange_strong(&l->req_nonce, &n, 0);
                PSD_STORE_RLX(&s->line_seen_ns, 0);
            }
            continue;
        }
        if (PSD_LOAD_RLX(&s->line_seen_ns))
            PSD_STORE_RLX(&s->line_seen_ns, 0);
        if (n == 0 || n == PSD_LOAD_RLX(&s->answered))
            continue;
        struct request r; /* copied once; only the copy is checked and used */
        r.req_pid = PSD_LOAD_RLX(&l->req_pid);
        r.req_rank = PSD_LOAD_RLX(&l->req_rank);
        r.req_start_time = PSD_LOAD_RLX(&l->req_start_time);
        r.req_pid_ns = PSD_LOAD_RLX(&l->req_pid_ns);
        r.req_check = PSD_LOAD_RLX(&l->req_check);
        atomic_thread_fence(memory_order_acquire);
        /* Hold the line while answering (rewritten while it was read: the next pass takes it). A
         * claimer that withdraws at its deadline then fails its compare-exchange and waits for the
         * answer instead of leaving an admitted slot nobody holds. */
        if (!atomic_compare_exchange_strong(&l->req_nonce, &n, PSD_NONCE_WRITING))
            continue;
        changed += answer(m, i, n, &r);
        /* Pairs with the load-acquire in take_request_line and claim_once's withdrawal. */
        PSD_STORE_REL(&l->req_nonce, n);
    }
    return changed;
}

#define PSD_EXP_MASK 0x7f800000u /* a float's exponent bits: all ones is inf or nan */

static inline uint32_t nonfinite(uint32_t bits) { return (bits & PSD_EXP_MASK) == PSD_EXP_MASK; }

/* Scale the gradient in place (unless scale is 1); whether it is all finite. */
static bool scale_and_check(float *g, uint64_t n, float scale) {
    uint32_t bad = 0;
    if (scale != 1.0f)
        for (uint64_t i = 0; i < n; i++)
            g[i] *= scale;
    const uint32_t *bits = (const uint32_t *)g;
    for (uint64_t i = 0; i < n; i++)
        bad |= nonfinite(bits[i]);
    return !bad;
}

/* IEEE half to single, exact (subnormals, infinities and NaNs included). */
static inline float f16_to_f32(uint16_t v) {
    const uint32_t shifted_exp = UINT32_C(0x7c00) << 13;
    uint32_t o = ((uint32_t)v & 0x7fffu) << 13, exp = shifted_exp & o;
    float f;
    o += (uint32_t)(127 - 15) << 23;
    if (exp == shifted_exp) {
        o += (uint32_t)(128 - 16) << 23; /* inf or nan */
    } else if (exp == 0) {               /* zero or subnormal: renormalise */
        o += UINT32_C(1) << 23;
        memcpy(&f, &o, sizeof f);
        f -= 6.103515625e-05f; /* 2^-14 */
        memcpy(&o, &f, sizeof o);
    }
    o |= ((uint32_t)v & 0x8000u) << 16;
    memcpy(&f, &o, sizeof f);
    return f;
}

static inline size_t dtype_size(uint32_t dtype) { return dtype == PSD_DTYPE_F32 ? 4 : 2; }

/* For each of the n source values of `dtype` (float32 from `f`, bfloat16 or float16 from `half`):
 * v, the value times scale, and b, its bits; then STORE, a statement on i, v and b. */
#define PSD_CONVERT_EACH(STORE)                                                                                   \
    do {                                                                                                          \
        if (dtype == PSD_DTYPE_F32)                                                                               \
            PSD_CONVERT_LOOP(f[i], STORE)                                                                         \
        else if (dtype == PSD_DTYPE_BF16)                                                                         \
            PSD_CONVERT_LOOP(psd_bf16_to_f32(half[i]), STORE)                                                     \
        else                                                                                                      \
            PSD_CONVERT_LOOP(f16_to_f32(half[i]), STORE)                                                          \
    } while (0)
#define PSD_CONVERT_LOOP(expr, STORE)                                                                             \
    for (uint64_t i = 0; i < n; i++) {                                                                            \
        float v = (expr) * scale;                                                                                 \
        uint32_t b;                                                                                               \
        memcpy(&b, &v, sizeof b);                                                                                 \
        STORE                                                                                                     \
    }

/* dst = src * scale, src of `dtype` (NULL: zeros), checking finiteness in the
 * same pass; returns nonzero if any value is inf or nan. */
static uint32_t copy_check(float *restrict dst, const void *restrict src, uint64_t n, float scale, uint32_t dtype) {
    uint32_t bad = 0;
    if (!src) {
        memset(dst, 0, n * sizeof(float));
        return 0;
    }
    const float *f = src;
    const uint16_t *half = src;
    PSD_CONVERT_EACH({
        bad |= nonfinite(b);
        dst[i] = v;
    });
    return bad;
}

/* bfloat16 bits of a float, rounded to nearest even (as torch rounds); a NaN's bits may come out
 * as anything: the caller flags it non-finite from the float's own bits. */
static inline uint16_t f32_to_bf16(uint32_t bits) { return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16); }

/* As copy_check, storing bfloat16 (--grad-dtype bf16): a value that rounds to an infinity is
 * non-finite too. */
static uint32_t copy_check_bf16(uint16_t *restrict dst, const void *restrict src, uint64_t n, float scale,
                                uint32_t dtype) {
    uint32_t bad = 0;
    const float *f = src;
    const uint16_t *half = src;
    PSD_CONVERT_EACH({
        uint16_t r = f32_to_bf16(b);
        bad |= nonfinite(b) | nonfinite((uint32_t)r << 16);
        dst[i] = r;
    });
    return bad;
}
#undef PSD_CONVERT_EACH
#undef PSD_CONVERT_LOOP

#ifdef PSD_HAVE_STREAM
/* As copy_check for float32, with non-temporal stores: the entry goes to
 * memory without first being read into this core's cache (the update loop, on
 * another core, reads it from memory anyway once it is larger than the caches). */
static uint32_t copy_check_stream(float *restrict dst, const float *restrict src, uint64_t n, float scale) {
    uint64_t i = 0;
    uint32_t bad = 0;
    for (; i < n && ((uintptr_t)(dst + i) & 15); i++) /* up to a 16-byte boundary */
        bad |= copy_check(dst + i, src + i, 1, scale, PSD_DTYPE_F32);
    const __m128 k = _mm_set1_ps(scale);
    const __m128i exp = _mm_set1_epi32((int)PSD_EXP_MASK);
    __m128i acc = _mm_setzero_si128();
    for (; i + 8 <= n; i += 8) {
        __m128 a = _mm_mul_ps(_mm_loadu_ps(src + i), k), b = _mm_mul_ps(_mm_loadu_ps(src + i + 4), k);
        __m128i ea = _mm_and_si128(_mm_castps_si128(a), exp), eb = _mm_and_si128(_mm_castps_si128(b), exp);
        acc = _mm_or_si128(acc, _mm_or_si128(_mm_cmpeq_epi32(ea, exp), _mm_cmpeq_epi32(eb, exp)));
        _mm_stream_ps(dst + i, a);
        _mm_stream_ps(dst + i + 4, b);
    }
    bad |= (uint32_t)_mm_movemask_epi8(acc) != 0;
    return bad | copy_check(dst + i, src + i, n - i, scale, PSD_DTYPE_F32);
}

/* As copy_check_bf16 for float32, eight values at a time: the rounding add is done on the 32-bit
 * lanes and an arithmetic shift leaves each lane's top half sign-extended, which _mm_packs_epi32
 * packs unchanged (SSE2 has no unsigned 32-to-16 pack); the exponent of both the value and the
 * rounded sum is checked. `stream`: non-temporal stores (the entry goes to memory without being
 * read into this core's cache first), once dst is 16-byte aligned. */
static uint32_t copy_check_bf16_sse2(uint16_t *restrict dst, const float *restrict src, uint64_t n, float scale,
                                     bool stream) {
    uint64_t i = 0;
    uint32_t bad = 0;
    for (; i < n && ((uintptr_t)(dst + i) & 15); i++) /* up to a 16-byte boundary */
        bad |= copy_check_bf16(dst + i, src + i, 1, scale, PSD_DTYPE_F32);
    const __m128 k = _mm_set1_ps(scale);
    const __m128i exp = _mm_set1_epi32((int)PSD_EXP_MASK), one = _mm_set1_epi32(1), half = _mm_set1_epi32(0x7fff);
    __m128i acc = _mm_setzero_si128();
    for (; i + 8 <= n; i += 8) {
        __m128i a = _mm_castps_si128(_mm_mul_ps(_mm_loadu_ps(src + i), k));
        __m128i b = _mm_castps_si128(_mm_mul_ps(_mm_loadu_ps(src + i + 4), k));
        __m128i ra = _mm_add_epi32(_mm_add_epi32(a, half), _mm_and_si128(_mm_srli_epi32(a, 16), one));
        __m128i rb = _mm_add_epi32(_mm_add_epi32(b, half), _mm_and_si128(_mm_srli_epi32(b, 16), one));
        __m128i bad_a = _mm_or_si128(_mm_cmpeq_epi32(_mm_and_si128(a, exp), exp),
                                     _mm_cmpeq_epi32(_mm_and_si128(ra, exp), exp));
        __m128i bad_b = _mm_or_si128(_mm_cmpeq_epi32(_mm_and_si128(b, exp), exp),
                                     _mm_cmpeq_epi32(_mm_and_si128(rb, exp), exp));
        acc = _mm_or_si128(acc, _mm_or_si128(bad_a, bad_b));
        __m128i packed = _mm_packs_epi32(_mm_srai_epi32(ra, 16), _mm_srai_epi32(rb, 16));
        if (stream)
            _mm_stream_si128((__m128i *)(dst + i), packed);
        else
            _mm_store_si128((__m128i *)(dst + i), packed);
    }
    bad |= (uint32_t)_mm_movemask_epi8(acc) != 0;
    return bad | copy_check_bf16(dst + i, src + i, n - i, scale, PSD_DTYPE_F32);
}
#endif

/* dst = src (n doubles), checking finiteness; nonzero if any is inf or nan. */
static uint32_t copy_check_f64(double *restrict dst, const double *restrict src, uint64_t n) {
    uint32_t bad = 0;
    for (uint64_t i = 0; i < n; i++) {
        uint64_t b;
        memcpy(&b, &src[i], sizeof b);
        bad |= (b & UINT64_C(0x7ff0000000000000)) == UINT64_C(0x7ff0000000000000);
        dst[i] = src[i];
    }
    return bad;
}

/* The entry at the tail, if the slot is this learner's and the ring has room. */
static int tail_entry(struct psd_map *m, uint32_t slot, struct psd_entry **e, uint64_t *tail) {
    struct psd_slot *s = psd_slot_at(m, slot);
    uint64_t token = held_token(m, slot);
    /* Not this mapping's claim, or taken back and handed on: never write into another's ring.
     * (A push racing the hand-over carries the old token; the update loop ignores it.) */
    if (!token || PSD_LOAD_RLX(&s->claims) != token || PSD_LOAD_RLX(&s->state) != PSD_SLOT_ACTIVE)
        return PSD_ESLOT;
    *tail = PSD_LOAD_RLX(&psd_lslot_at(m, slot)->tail); /* only this process writes it */
    /* Pairs with the store-release of head in the update loop: the entry at
     * `tail` is no longer being read. */
    if (*tail - PSD_LOAD_ACQ(&s->head) >= m->g.ring_k)
        return PSD_ESTATE; /* caller must psd_wait_space() first */
    *e = psd_entry_at(m, slot, *tail);
    return 0;
}

/* Fill in the entry's metadata and move the tail past it, if the slot is still this learner's
 * (checked again here, as late as it can be: a learner the reaper took the slot from while it was
 * stopped, waking mid-push, must not move the next owner's tail; its entry is ignored by token). */
static int publish(struct psd_map *m, uint32_t slot, struct psd_entry *e, uint64_t tail, uint64_t clock,
                   uint32_t batch, double loss, uint32_t flags) {
    struct psd_header *h = psd_hdr(m);
    struct psd_lslot *s = psd_lslot_at(m, slot);
    e->seq = tail;
    e->clock = clock;
    e->batch_size = batch;
    e->flags = flags;
    e->loss = loss;
    e->claim = held_token(m, slot);
    e->applied_clock = 0;
    e->outcome = PSD_OUTCOME_PENDING;
    if (!still_mine(psd_slot_at(m, slot), e->claim))
        return PSD_ESLOT;
    /* seq_cst store (a release, pairs with the load-acquire of tail in the
     * update loop) so that the load of `sleeping` below cannot move before it:
     * with the loop's store of `sleeping` and load of tails, a Dekker pair. */
    atomic_store(&s->tail, tail + 1);
    PSD_ADD_RLX(&s->lease_beat, 1); /* a push renews the lease (psd_reap reads it relaxed) */
    if (atomic_load(&h->sleeping))
        psd_cond_broadcast(&h->doorbell);
    if (h->cfg.sync_mode == PSD_SYNC_SSP)
        psd_cond_broadcast_if_waiters(&h->sync_cond); /* a learner waiting for us may go on */
    return 0;
}

/* Copy the buffer deltas (if any) into the entry, with a partial attach's range; the entry flags they add. */
static uint32_t put_buffers(const struct psd_map *m, struct psd_entry *e, const double *bufdelta) {
    e->buf_lo = m->push_buf_lo;
    e->buf_hi = m->push_buf_hi;
    if (!bufdelta || !m->g.n_buffers)
        return 0;
    uint32_t range = m->push_buf_partial ? PSD_ENTRY_BUF_RANGE : 0;
    return PSD_ENTRY_BUFFERS | range |
           (copy_check_f64(psd_entry_bufdelta(m, e), bufdelta, m->g.n_buffers) ? PSD_ENTRY_NONFINITE : 0);
}

bool psd_ring_has_space(const struct psd_map *m, uint32_t slot) {
    return PSD_LOAD_RLX(&psd_lslot_at(m, slot)->tail) - PSD_LOAD_ACQ(&psd_slot_at(m, slot)->head) < m->g.ring_k;
}

int psd_push(struct psd_map *m, uint32_t slot, uint64_t clock, uint32_t batch, double loss, float scale,
             const double *bufdelta) {
    return psd_push_present(m, slot, clock, batch, loss, scale, NULL, NULL, bufdelta);
}

int psd_push_present(struct psd_map *m, uint32_t slot, uint64_t clock, uint32_t batch, double loss, float scale,
                     const uint8_t *present, const uint64_t *lens, const double *bufdelta) {
    if (present) {
        uint64_t total = 0;
        for (uint64_t k = 0; k < m->g.n_pieces; k++) {
            if (lens[k] > m->g.n_train - total)
                return EINVAL; /* more than the model (checked piece by piece: a sum could wrap) */
            total += lens[k];
        }
        if (total != m->g.n_train)
            return EINVAL;
    }
    struct psd_entry *e;
    uint64_t tail;
    int rc = tail_entry(m, slot, &e, &tail);
    if (rc)
        return rc;
    float *g = psd_entry_grad(e);
    uint8_t *map = psd_entry_pieces(m, e);
    bool finite = true;
    if (!present) {
        finite = scale_and_check(g, m->g.n_train, scale);
        memset(map, PSD_PIECE_DENSE, m->g.n_pieces);
    } else {
        /* Only the spans written in place are read: the others hold whatever an earlier push left there. */
        for (uint64_t k = 0; k < m->g.n_pieces; g += lens[k], k++) {
            map[k] = present[k] ? PSD_PIECE_DENSE : PSD_PIECE_ABSENT;
            if (present[k])
                finite = scale_and_check(g, lens[k], scale) && finite;
        }
    }
    uint32_t flags = put_buffers(m, e, bufdelta) | (finite ? 0 : PSD_ENTRY_NONFINITE);
    return publish(m, slot, e, tail, clock, batch, loss, flags);
}

/* A sparse gradient's rows must name rows of its tensor. */
static bool sparse_src_ok(const struct psd_src *p) {
    if (p->row_len == 0 || p->len % p->row_len || p->nnz > p->len / p->row_len || !p->rows)
        return false;
    uint64_t rows = p->len / p->row_len;
    for (uint64_t k = 0; k < p->nnz; k++)
        if (p->rows[k] < 0 || (uint64_t)p->rows[k] >= rows)
            return false;
    return true;
}

/* Store a sparse gradient in its tensor's span: as rows (count, indices,
 * values) when they take less room, else scattered densely. Returns the
 * piece kind, and ORs a non-finite value into *bad. */
static uint8_t put_sparse(float *span, const struct psd_src *p, float scale, uint32_t dtype, uint32_t *bad) {
    uint64_t nnz = p->nnz, rl = p->row_len;
    const uint8_t *vals = p->data;
    if (8 + 8 * nnz + 4 * nnz * rl <= 4 * p->len) {
        uint8_t *b = (uint8_t *)span;
        memcpy(b, &nnz, sizeof nnz);
        memcpy(b + 8, p->rows, 8 * nnz);
        *bad |= copy_check((float *)(b + 8 + 8 * nnz), vals, nnz * rl, scale, dtype);
        return PSD_PIECE_SPARSE;
    }
    memset(span, 0, p->len * sizeof(float));
    float row[256];
    for (uint64_t k = 0; k < nnz; k++) {
        float *dst = span + (uint64_t)p->rows[k] * rl;
        for (uint64_t j = 0; j < rl; j += 256) {
            uint64_t n = rl - j < 256 ? rl - j : 256;
            *bad |= copy_check(row, vals + (k * rl + j) * dtype_size(dtype), n, scale, dtype);
            for (uint64_t i = 0; i < n; i++)
                dst[j + i] += row[i]; /* rows may repeat: they add up */
        }
    }
    return PSD_PIECE_DENSE;
}

int psd_push_from(struct psd_map *m, uint32_t slot, uint64_t clock, uint32_t batch, double loss, float scale,
                  const struct psd_src *src, uint32_t count, uint32_t dtype, uint32_t store, const double *bufdelta) {
    if (count != m->g.n_pieces || dtype > PSD_DTYPE_F16 || (store != PSD_DTYPE_F32 && store != PSD_DTYPE_BF16))
        return EINVAL;
    uint64_t total = 0;
    for (uint32_t k = 0; k < count; k++) {
        if (src[k].len > m->g.n_train - total)
            return EINVAL; /* more than the model (checked piece by piece: a sum could wrap) */
        if (src[k].data && src[k].rows && !sparse_src_ok(&src[k]))
            return EINVAL;
        total += src[k].len;
    }
    if (total != m->g.n_train)
        return EINVAL;
    struct psd_entry *e;
    uint64_t tail;
    int rc = tail_entry(m, slot, &e, &tail);
    if (rc)
        return rc;
    float *dst = psd_entry_grad(e);
    uint8_t *map = psd_entry_pieces(m, e);
    uint32_t bad = 0;
#ifdef PSD_HAVE_STREAM
    bool stream = dtype == PSD_DTYPE_F32 && store == PSD_DTYPE_F32 && total * sizeof(float) >= PSD_STREAM_BYTES;
    bool stream_bf16 = dtype == PSD_DTYPE_F32 && store == PSD_DTYPE_BF16 && total * 2 >= PSD_STREAM_BYTES;
#endif
    for (uint32_t k = 0; k < count; dst += src[k].len, k++) {
        if (!src[k].data) {
            map[k] = PSD_PIECE_ABSENT;
        } else if (src[k].rows) {
            map[k] = put_sparse(dst, &src[k], scale, dtype, &bad);
        } else if (store == PSD_DTYPE_BF16) {
            map[k] = PSD_PIECE_DENSE_BF16;
#ifdef PSD_HAVE_STREAM
            if (dtype == PSD_DTYPE_F32) {
                bad |= copy_check_bf16_sse2((uint16_t *)dst, src[k].data, src[k].len, scale, stream_bf16);
                continue;
            }
#endif
            bad |= copy_check_bf16((uint16_t *)dst, src[k].data, src[k].len, scale, dtype);
        } else {
            map[k] = PSD_PIECE_DENSE;
#ifdef PSD_HAVE_STREAM
            if (stream) {
                bad |= copy_check_stream(dst, src[k].data, src[k].len, scale);
                continue;
            }
#endif
            bad |= copy_check(dst, src[k].data, src[k].len, scale, dtype);
        }
    }
#ifdef PSD_HAVE_STREAM
    if (stream || stream_bf16)
        _mm_sfence(); /* streaming stores are weakly ordered: complete them before the tail moves */
#endif
    uint32_t flags = put_buffers(m, e, bufdelta) | (bad ? PSD_ENTRY_NONFINITE : 0);
    return publish(m, slot, e, tail, clock, batch, loss, flags);
}

/* Wait until `ready(m, slot, arg)` holds, sleeping on `c` in slices of at most
 * `slice_ns`, rechecking between them that the server lives and the slot is
 * still this claim's. A waiter announces itself in `announce` (its own page's word, for the
 * read-only not_full of its record), or in c->waiters (the shared page's conditions). */
typedef bool (*ready_fn)(struct psd_map *, uint32_t, uint64_t);

static int wait_until(struct psd_map *m, uint32_t slot, uint64_t claim, struct psd_cond *c,
                      _Atomic uint32_t *announce, uint64_t slice_ns, uint64_t timeout_ns, ready_fn ready,
                      uint64_t arg) {
    struct psd_slot *s = psd_slot_at(m, slot);
    _Atomic uint32_t *w = announce ? announce : &c->waiters;
    uint64_t deadline = psd_now_ns() + timeout_ns;
    for (;;) {
        /* seq_cst: the announcement is visible before the predicate is read (pairs with the
         * signaller's load of the count after it stored the predicate). */
        atomic_fetch_add(w, 1);
        uint32_t seen = atomic_load(&c->seq);
        int rc = 0;
        if (ready(m, slot, arg))
            rc = -1;
        else if (PSD_LOAD_RLX(&s->claims) != claim)
            rc = PSD_ESLOT;
        else if (PSD_LOAD_ACQ(&s->state) == PSD_SLOT_EVICTED)
            rc = PSD_EEVICTED; /* the loop takes nothing more from it: no use waiting */
        else
            rc = server_check(m);
        uint64_t now = psd_now_ns();
        if (rc == 0 && now >= deadline)
            rc = PSD_ETIMEOUT;
        if (rc == 0) {
            uint64_t left = deadline - now;
            rc = psd_cond_wait(c, seen, left < slice_ns ? left : slice_ns);
            rc = rc == EINTR ? EINTR : 0;
        }
        uint32_t v = atomic_load(w); /* never below zero, even after the loop reset it */
        while (v > 0 && !atomic_compare_exchange_weak(w, &v, v - 1)) {
        }
        if (rc)
            return rc == -1 ? 0 : rc;
    }
}

static bool has_space(struct psd_map *m, uint32_t slot, uint64_t claim) {
    (void)claim;
    return psd_ring_has_space(m, slot);
}

bool psd_ring_drained(const struct psd_map *m, uint32_t slot) {
    /* Pairs with the store-release of head in the update loop: the weights hold every entry up to it. */
    return PSD_LOAD_RLX(&psd_lslot_at(m, slot)->tail) == PSD_LOAD_ACQ(&psd_slot_at(m, slot)->head);
}

static bool is_drained(struct psd_map *m, uint32_t slot, uint64_t claim) {
    (void)claim;
    return psd_ring_drained(m, slot);
}

static bool is_freed(struct psd_map *m, uint32_t slot, uint64_t claim) {
    struct psd_slot *s = psd_slot_at(m, slot);
    /* Pairs with the store-release of FREE in free_slot (update.c). */
    uint32_t st = PSD_LOAD_ACQ(&s->state);
    return st == PSD_SLOT_FREE || st == PSD_SLOT_EVICTED || PSD_LOAD_RLX(&s->claims) != claim;
}

/* Wait on the slot's not_full condition until ready(m, slot, arg). */
static int wait_slot(struct psd_map *m, uint32_t slot, uint64_t claim, uint64_t timeout_ns, ready_fn ready,
                     uint64_t arg) {
    if (slot >= m->g.n_slots)
        return EINVAL;
    /* The freed-slot wait may outlive the claim (claims moves on): it then holds, and never waits. */
    return wait_until(m, slot, claim, &psd_slot_at(m, slot)->not_full,
                      held_token(m, slot) ? &psd_lslot_at(m, slot)->waiters : NULL, PSD_WAIT_SLICE_NS, timeout_ns,
                      ready, arg);
}

int psd_wait_space(struct psd_map *m, uint32_t slot, uint64_t claim, uint64_t timeout_ns) {
    if (slot < m->g.n_slots && !has_space(m, slot, claim) && held_token(m, slot))
        PSD_ADD_RLX(&psd_lslot_at(m, slot)->full_waits, 1);
    return wait_slot(m, slot, claim, timeout_ns, has_space, claim);
}

static bool head_reached(struct psd_map *m, uint32_t slot, uint64_t head) {
    /* Pairs with the store-release of head in the update loop. */
    return PSD_LOAD_ACQ(&psd_slot_at(m, slot)->head) >= head;
}

int psd_wait_head(struct psd_map *m, uint32_t slot, uint64_t claim, uint64_t head, uint64_t timeout_ns) {
    if (slot >= m->g.n_slots)
        return EINVAL;
    if (head_reached(m, slot, head))
        return 0;
    if (held_token(m, slot))
        PSD_ADD_RLX(&psd_lslot_at(m, slot)->full_waits, 1);
    return wait_slot(m, slot, claim, timeout_ns, head_reached, head);
}

/* How long a wait for the slot's ring to drain polls before it sleeps: a learner waiting for its own gradient
 * (--overlap) usually has it applied within microseconds, sooner than a futex wake-up would tell it. It
 * spins for PSD_DRAIN_SPIN_NS, then checks between yields of its core (to the update loop or a learner
 * that shares it) up to PSD_DRAIN_YIELD_NS from the start: an update of a few hundred microseconds (a
 * model of ~10^5-10^6 parameters) is met without a futex wake-up, which in a VM costs about as much. */
#define PSD_DRAIN_SPIN_NS (UINT64_C(30) * 1000)
#define PSD_DRAIN_YIELD_NS (UINT64_C(300) * 1000)

int psd_wait_drained(struct psd_map *m, uint32_t slot, uint64_t claim, uint64_t timeout_ns) {
    if (slot >= m->g.n_slots)
        return EINVAL;
    uint64_t t0 = psd_now_ns();
    uint64_t until = t0 + (timeout_ns < PSD_DRAIN_SPIN_NS ? timeout_ns : PSD_DRAIN_SPIN_NS);
    while (!psd_ring_drained(m, slot) && psd_now_ns() < until)
        psd_cpu_relax();
    until = t0 + (timeout_ns < PSD_DRAIN_YIELD_NS ? timeout_ns : PSD_DRAIN_YIELD_NS);
    while (!psd_ring_drained(m, slot) && psd_now_ns() < until)
        sched_yield();
    return wait_slot(m, slot, claim, timeout_ns, is_drained, claim);
}

int psd_wait_freed(struct psd_map *m, uint32_t slot, uint64_t claim, uint64_t timeout_ns) {
    if (slot < m->g.n_slots && is_freed(m, slot, claim))
        return 0;
    return wait_slot(m, slot, claim, timeout_ns, is_freed, claim);
}

void psd_ssp_clocks(struct psd_map *m, uint32_t slot, bool strict, uint64_t *mine, uint64_t *slowest) {
    struct psd_header *h = psd_hdr(m);
    struct psd_slot *me = psd_slot_at(m, slot);
    *mine = PSD_LOAD_RLX(&me->ssp_base) + PSD_LOAD_RLX(&psd_lslot_at(m, slot)->tail);
    *slowest = UINT64_MAX;
    for (uint32_t i = 0; i < m->g.n_slots; i++) {
        if (i == slot)
            continue;
        struct psd_slot *s = psd_slot_at(m, i);
        /* Pairs with the store-release of state in psd_admit: base is set. */
        if (PSD_LOAD_ACQ(&s->state) != PSD_SLOT_ACTIVE)
            continue;
        uint64_t c = PSD_LOAD_RLX(&s->ssp_base) + PSD_LOAD_ACQ(&psd_lslot_at(m, i)->tail);
        /* A dead learner leaves the minimum at once, without waiting for the reaper.
         * Unless strict, only one that holds us back costs the liveness check (a /proc read). */
        if (c < *slowest && ((!strict && c + h->cfg.sync_param >= *mine) || psd_slot_owner_alive(h, s)))
            *slowest = c;
    }
}

/* The learner that pushed `mine` gradients may compute its next one once the
 * slowest live learner pushed at least mine - S: so while computing it is at
 * most S pushes ahead, and at most S + 1 right after its push. */
static bool ssp_may_go_on(struct psd_map *m, uint32_t slot) {
    uint64_t mine, slowest;
    psd_ssp_clocks(m, slot, false, &mine, &slowest);
    return slowest == UINT64_MAX || mine <= slowest + psd_hdr(m)->cfg.sync_param;
}

/* Sync waits sleep on the header's sync_cond in short slices: a peer that dies
 * signals nothing, so liveness is rechecked often. */
static int wait_sync(struct psd_map *m, uint32_t slot, uint64_t claim, uint64_t timeout_ns, ready_fn ready,
                     uint64_t arg) {
    return wait_until(m, slot, claim, &psd_hdr(m)->sync_cond, NULL, PSD_WAIT_SLICE_NS / 5, timeout_ns, ready, arg);
}

static bool ssp_ready(struct psd_map *m, uint32_t slot, uint64_t arg) {
    (void)arg;
    return ssp_may_go_on(m, slot);
}

static bool round_done(struct psd_map *m, uint32_t slot, uint64_t rounds) {
    (void)slot;
    /* Pairs with the store of rounds in finish_round (update.c). */
    return PSD_LOAD_ACQ(&psd_hdr(m)->rounds) > rounds;
}

int psd_wait_ssp(struct psd_map *m, uint32_t slot, uint64_t claim, uint64_t timeout_ns) {
    if (ssp_may_go_on(m, slot))
        return 0;
    return wait_sync(m, slot, claim, timeout_ns, ssp_ready, 0);
}

int psd_wait_round(struct psd_map *m, uint32_t slot, uint64_t claim, uint64_t rounds, uint64_t timeout_ns) {
    return wait_sync(m, slot, claim, timeout_ns, round_done, rounds);
}

/* Why a slot's owner (or its evicted process) is gone (enum psd_reap_reason), or PSD_REAP_NONE.
 * /proc first where it can tell; else the lease: the beat must have moved within lease_ns of
 * this (the reaper's) clock. The reaper's view of the lease is kept in the server's record, so a
 * server that takes over goes on from it. */
static uint32_t owner_gone(const struct psd_header *h, struct psd_slot *s, struct psd_lslot *l, pid_t pid,
                           uint64_t start_time, uint64_t pid_ns, uint64_t now, uint64_t lease_ns, bool owner,
                           uint64_t stall_ns) {
    uint64_t claim = PSD_LOAD_RLX(&s->claims), beat = PSD_LOAD_RLX(&l->lease_beat);
    bool fresh = PSD_LOAD_RLX(&s->lease_claim) != claim || PSD_LOAD_RLX(&s->lease_seen_ns) == 0;
    if (stall_ns && !fresh) {
        /* The beat stood still while nothing ran: the stall does not count against the lease (the silence
         * before it still does, so a dead owner's lease runs out between stalls too). */
        uint64_t seen = PSD_LOAD_RLX(&s->lease_seen_ns);
        PSD_STORE_RLX(&s->lease_seen_ns, now - seen > stall_ns ? seen + stall_ns : now);
    }
    if (fresh || PSD_LOAD_RLX(&s->lease_seen) != beat) {
        if (!fresh && owner)
            PSD_STORE_RLX(&s->lease_moved, 1); /* the owner's lease thread runs: it took the slot */
        PSD_STORE_RLX(&s->lease_claim, claim);
        PSD_STORE_RLX(&s->lease_seen, beat);
        PSD_STORE_RLX(&s->lease_seen_ns, now);
    }
    if (owner && beat != 0) /* answer() zeroes the beat: any beat since is the owner's */
        PSD_STORE_RLX(&s->lease_moved, 1);
    enum psd_live live = psd_liveness(h, pid, start_time, pid_ns);
    PSD_STORE_RLX(&s->liveness, live == PSD_LIVE_UNKNOWN ? PSD_LIVE_BY_LEASE : PSD_LIVE_BY_PROC);
    if (live == PSD_LIVE_NO)
        return PSD_REAP_EXITED;
    uint64_t seen = PSD_LOAD_RLX(&s->lease_seen_ns);
    bool ran_out = now > seen && now - seen >= lease_ns;
    if (live == PSD_LIVE_YES)
        /* A live process that never beat for the slot did not take it (a claim withdrawn as it was
         * answered, a request that named another process): the slot is not kept for it forever. */
        return owner && ran_out && !PSD_LOAD_RLX(&s->lease_moved) ? PSD_REAP_UNCLAIMED : PSD_REAP_NONE;
    return ran_out ? PSD_REAP_LEASE : PSD_REAP_NONE;
}

int psd_reap(struct psd_map *m, int32_t *pids, uint32_t max, uint32_t *n) {
    struct psd_header *h = psd_hdr(m);
    *n = 0;
    if (PSD_LOAD_ACQ(&h->state) != PSD_ARENA_READY)
        return 0;
    uint64_t now = psd_now_ns(), lease_ns = psd_lease_ns(h), last = m->reap_last_ns;
    m->reap_last_ns = now;
    /* A gap between this reaper's own runs longer than its stall allowance (half a lease, at least
     * PSD_REAP_STALL_MIN_NS past the server's polls every 0.1 s) is a stall of the whole machine: a
     * paused VM, swapping. The learners' lease threads did not run either, so the beats that stood
     * still meanwhile say nothing: every lease is extended by the gap, as the watchdog gives a server
     * time after its own stall (watchdog/supervisor.py). */
    uint64_t allowance = lease_ns / 2 > PSD_REAP_STALL_MIN_NS ? lease_ns / 2 : PSD_REAP_STALL_MIN_NS;
    uint64_t stall_ns = last != 0 && now > last && now - last > allowance ? now - last : 0;
    bool freed = false;
    for (uint32_t i = 0; i < m->g.n_slots; i++) {
        struct psd_slot *s = psd_slot_at(m, i);
        struct psd_lslot *l = psd_lslot_at(m, i);
        uint32_t st = PSD_LOAD_ACQ(&s->state);
        if (st == PSD_SLOT_EVICTED) {
            /* Quarantined while the evicted process lives: it may still write into the ring. */
            if (owner_gone(h, s, l, PSD_LOAD_RLX(&s->evicted_pid), PSD_LOAD_RLX(&s->evicted_start_time),
                           PSD_LOAD_RLX(&s->evicted_pid_ns), now, lease_ns, false, stall_ns) != PSD_REAP_NONE) {
                /* Nothing it left in its request line is a request (no claimer takes the line of a
                 * slot that is not FREE, so nobody is writing it now). Only the reaper moves an
                 * EVICTED slot. */
                uint64_t left = PSD_LOAD_RLX(&l->req_nonce);
                if (left != PSD_LOAD_RLX(&s->answered))
                    atomic_compare_exchange_strong(&l->req_nonce, &left, 0);
                uint32_t want = PSD_SLOT_EVICTED;
                freed |= atomic_compare_exchange_strong(&s->state, &want, PSD_SLOT_FREE);
            }
            continue;
        }
        uint32_t why;
        uint64_t claim = PSD_LOAD_RLX(&s->claims);
        if (st != PSD_SLOT_ACTIVE || PSD_LOAD_RLX(&s->reap_claim) == claim ||
            (why = owner_gone(h, s, l, PSD_LOAD_ACQ(&s->pid), PSD_LOAD_ACQ(&s->start_time), PSD_LOAD_ACQ(&s->pid_ns),
                              now, lease_ns, true, stall_ns)) == PSD_REAP_NONE)
            continue;
        /* The identity judged must be `claim`'s: the slot may have been released, freed (identity
         * cleared) or handed on while it was read. The identity's load-acquires pair with its
         * store-releases in answer() and free_slot: having read a later identity, this sees the
         * state move that came before it. */
        if (PSD_LOAD_ACQ(&s->state) != PSD_SLOT_ACTIVE || PSD_LOAD_RLX(&s->claims) != claim)
            continue;
        /* Everything it fully pushed is still applied; the loop moves the slot to DRAINING (if
         * `claim` is still the slot's: its owner may have released it and another been admitted
         * since the pid was read), then frees it. Pairs with the load-acquire in psd_admit. */
        PSD_STORE_RLX(&s->reap_why, why);
        PSD_STORE_REL(&s->reap_claim, claim);
        if (*n < max)
            pids[(*n)++] = PSD_LOAD_RLX(&s->pid);
    }
    if (*n || freed) {
        psd_cond_broadcast(&h->doorbell);
        psd_cond_broadcast_if_waiters(&h->sync_cond);
    }
    return 0;
}

bool psd_server_alive(struct psd_map *m, uint64_t stale_ns) {
    struct psd_header *h = psd_hdr(m);
    if (PSD_LOAD_ACQ(&h->state) == PSD_ARENA_STOPPED)
        return false;
    enum psd_live live = psd_liveness(h, atomic_load(&h->server_pid), h->server_start_time, h->server_pid_ns);
    if (live == PSD_LIVE_NO)
        return false;
    /* Where /proc cannot tell (another PID namespace), the heartbeat is all there is: a
     * running server beats at least every 100 ms, also while it sleeps or pauses. */
    if (live == PSD_LIVE_UNKNOWN && stale_ns == 0)
        stale_ns = psd_lease_ns(h);
    uint64_t hb = atomic_load(&h->heartbeat_ns), now = psd_now_ns();
    return stale_ns == 0 || hb == 0 || now <= hb || now - hb < stale_ns;
}
