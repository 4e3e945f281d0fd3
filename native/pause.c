/*
 * pause.c -- stopping the update loop between two gradients, for a consistent
 * snapshot (a checkpoint) taken while learners keep pushing.
 *
 * The watchdog pauses (and `psd checkpoint`, or `psd run`'s shutdown, when no
 * watchdog lives): one pauser at a time. If it dies while the loop is paused, the loop
 * notices (pid + start time) and resumes by itself, so a dead pauser can never
 * stall training.
 *
 * A hold is the node link's: the loop stops by itself right after the update
 * that brings the clock to the hold's clock (or before any, when it is there),
 * so a node cannot run past a cross-node exchange point (--max-node-lag) by even
 * one update, which a pause requested from outside could not promise; and the
 * link reads and writes the weights under a hold, not a pause, because the
 * pause has one pauser slot that checkpoints use. A dead holder releases its
 * hold the same way.
 */
#define _GNU_SOURCE
#include <errno.h>

#include "psd.h"

#define PAUSE_SLICE_NS (20ull * 1000 * 1000)

bool psd_loop_should_pause(struct psd_map *m) {
    /* Pairs with the seq_cst store of pause_req in psd_pause. */
    return atomic_load_explicit(&psd_hdr(m)->pause_req, memory_order_acquire) != 0;
}

void psd_loop_pause(struct psd_map *m, _Atomic int *stop) {
    struct psd_header *h = psd_hdr(m);
    atomic_store(&h->paused, 1); /* read by the pauser in psd_pause */
    psd_cond_broadcast(&h->pause_cond);
    while (!atomic_load(stop)) {
        uint32_t seen = psd_cond_prepare(&h->pause_cond);
        if (!atomic_load(&h->pause_req)) {
            psd_cond_done(&h->pause_cond);
            break;
        }
        if (!psd_owner_alive(atomic_load(&h->pauser_pid), atomic_load(&h->pauser_start_time))) {
            atomic_store(&h->pause_req, 0); /* the pauser died mid-snapshot */
            psd_cond_done(&h->pause_cond);
            break;
        }
        psd_cond_wait(&h->pause_cond, seen, PAUSE_SLICE_NS);
        psd_cond_done(&h->pause_cond);
        PSD_STORE_RLX(&h->heartbeat_ns, psd_now_ns()); /* paused is not hung */
        psd_admit(m); /* claims and releases touch no weights: learners attach during a snapshot */
    }
    atomic_store(&h->paused, 0);
}

int psd_pause(struct psd_map *m, pid_t pid, uint64_t start_time, uint64_t timeout_ns) {
    struct psd_header *h = psd_hdr(m);
    atomic_store(&h->pauser_pid, pid);
    atomic_store(&h->pauser_start_time, start_time);
    atomic_store(&h->pause_req, 1); /* pairs with psd_loop_should_pause */
    psd_cond_broadcast(&h->doorbell); /* a sleeping loop wakes up to pause */
    uint64_t deadline = psd_now_ns() + timeout_ns;
    for (;;) {
        uint32_t seen = psd_cond_prepare(&h->pause_cond);
        /* Paused, or nobody is running the loop (no server, or one whose loop stopped beating:
         * hung), so nothing writes the weights; a hung loop may at most be stuck inside one
         * gradient, and a snapshot of that is still the best there is. */
        if (atomic_load(&h->paused) || PSD_LOAD_ACQ(&h->state) != PSD_ARENA_READY ||
            !psd_server_alive(m, PSD_HUNG_NS)) {
            psd_cond_done(&h->pause_cond);
            return 0;
        }
        uint64_t now = psd_now_ns();
        if (now >= deadline) {
            psd_cond_done(&h->pause_cond);
            psd_resume(m);
            return PSD_ETIMEOUT;
        }
        uint64_t left = deadline - now;
        int rc = psd_cond_wait(&h->pause_cond, seen, left < PAUSE_SLICE_NS ? left : PAUSE_SLICE_NS);
        psd_cond_done(&h->pause_cond);
        if (rc == EINTR) {
            psd_resume(m);
            return EINTR;
        }
    }
}

void psd_resume(struct psd_map *m) {
    struct psd_header *h = psd_hdr(m);
    atomic_store(&h->pause_req, 0);
    psd_cond_broadcast(&h->pause_cond);
}

void psd_hold(struct psd_map *m, pid_t pid, uint64_t start_time, int64_t clock) {
    struct psd_header *h = psd_hdr(m);
    atomic_store(&h->holder_pid, pid);
    atomic_store(&h->holder_start_time, start_time);
    /* seq_cst; pairs with the loads of hold_clock in hold_due (the loop then sees the holder's
     * identity and every weight the holder wrote before it), and with the loop's store of held
     * (see psd_loop_hold). clock < 0: no hold. */
    atomic_store(&h->hold_clock, clock < 0 ? 0 : (uint64_t)clock + 1);
    psd_cond_broadcast(&h->pause_cond); /* a held loop rechecks at once */
}

static bool hold_due(struct psd_header *h, uint64_t at) {
    return at != 0 && PSD_LOAD_RLX(&h->clock) + 1 >= at; /* clock: only the loop writes it */
}

bool psd_loop_should_hold(struct psd_map *m) {
    struct psd_header *h = psd_hdr(m);
    /* Pairs with the seq_cst store of hold_clock in psd_hold. */
    return hold_due(h, PSD_LOAD_ACQ(&h->hold_clock));
}

void psd_loop_hold(struct psd_map *m, _Atomic int *stop) {
    struct psd_header *h = psd_hdr(m);
    for (;;) {
        /* seq_cst; read by the holder after its store of hold_clock (Arena.header "held"). */
        atomic_store(&h->held, 1);
        while (!atomic_load(stop)) {
            uint32_t seen = psd_cond_prepare(&h->pause_cond);
            /* Pairs with the seq_cst store of hold_clock in psd_hold. */
            uint64_t at = PSD_LOAD_ACQ(&h->hold_clock);
            if (!hold_due(h, at)) {
                psd_cond_done(&h->pause_cond);
                break;
            }
            if (!psd_owner_alive(atomic_load(&h->holder_pid), atomic_load(&h->holder_start_time))) {
                /* The holder died: release its hold, unless a new holder set another meanwhile
                 * (seq_cst compare-exchange; pairs with psd_hold's store). */
                atomic_compare_exchange_strong(&h->hold_clock, &at, 0);
                psd_cond_done(&h->pause_cond);
                continue;
            }
            if (psd_loop_should_pause(m)) { /* a checkpoint while held: the loop writes nothing either way */
                psd_cond_done(&h->pause_cond);
                psd_loop_pause(m, stop);
                continue;
            }
            psd_cond_wait(&h->pause_cond, seen, PAUSE_SLICE_NS);
            psd_cond_done(&h->pause_cond);
            PSD_STORE_RLX(&h->heartbeat_ns, psd_now_ns()); /* held is not hung */
            psd_admit(m); /* learners attach while the loop is held */
        }
        /* seq_cst, then a seq_cst load of hold_clock: a holder that stored hold_clock and then saw
         * held == 1 has its hold seen here, so the loop holds again instead of applying. */
        atomic_store(&h->held, 0);
        if (atomic_load(stop) || !hold_due(h, atomic_load(&h->hold_clock)))
            return;
    }
}
