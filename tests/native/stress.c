/*
 * stress.c -- the C core on its own, built with sanitizers by tests/test_native.py.
 *
 * 1. a process dies holding a robust mutex: the next locker gets
 *    PSD_EOWNERDEAD, the lock works again, and the recovery is counted;
 * 2. a process dies while waiting on a psd_cond: broadcasting afterwards
 *    returns (glibc's pthread_cond_t can hang here);
 * 3. producer threads push through their rings while the update loop applies
 *    them: every gradient applied exactly once, all slots taken means ENOSLOT;
 *    meanwhile a pauser takes snapshots (weights consistent with the clock),
 *    a learner's pull thread hands over weights (clocks never go back), and a
 *    learner pulls what the rows log names (at the end, exactly the weights);
 * 4. bsp: learners that wait for each round see every round average exactly
 *    one gradient from each of them;
 * 5. ssp:1 with one slow learner: no learner ever runs more than 2 pushes
 *    ahead of the slowest, and everything is applied;
 * 6. kasync:2 with Adagrad: every gradient applied, two a round, and Adagrad's
 *    sum holds each gradient's square (taken as the loop accumulates it while
 *    learners push), not the square of a round's sum.
 * Prints one line per check and "N passed, M failed" at the end.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "psd.h"

static int passed, failed;
#define CHECK(cond, ...)                                                                           \
    do {                                                                                           \
        if (cond) {                                                                                \
            passed++;                                                                              \
        } else {                                                                                   \
            failed++;                                                                              \
            printf("FAIL %s:%d: ", __FILE__, __LINE__);                                            \
            printf(__VA_ARGS__);                                                                   \
            printf("\n");                                                                          \
        }                                                                                          \
    } while (0)

enum { SLOTS = 4, RING = 4, N = 257, PUSHES = 20000 };

static struct psd_map map = {.fd = -1};
/* The model as three tensors: the slots' own elements, a middle nobody pushes, the shared last one. */
static const struct psd_model model = {N, N, 0, 3};
static const struct psd_piece_geom pieces[] = {{0, SLOTS, 1}, {SLOTS, N - SLOTS - 1, 1}, {N - 1, 1, 1}};
static char name[64];

static void setup(void) {
    snprintf(name, sizeof name, "/psd.stress-%d", (int)getpid());
    int rc = psd_arena_create(&map, name, 0600, SLOTS, RING, 4096, "stress");
    CHECK(rc == 0, "create: %s", psd_strerror(rc));
    const char spec[] = "[]";
    pid_t me = getpid();
    rc = psd_arena_set_spec(&map, spec, sizeof spec, 1, &model, me, psd_proc_start_time(me));
    CHECK(rc == 0, "set_spec: %s", psd_strerror(rc));
    rc = psd_arena_grow(&map);
    CHECK(rc == 0, "grow: %s", psd_strerror(rc));
    psd_hdr(&map)->cfg.lr = 1.0;
    /* sgd's steps are exact under auto too; the loop keeps its running staleness and the hold as learners
     * come and go (note_staleness, note_learners) beside the producers */
    psd_hdr(&map)->cfg.async_momentum = PSD_ASYNC_MOMENTUM_AUTO;
    atomic_store(&psd_hdr(&map)->server_pid, me);
    psd_hdr(&map)->server_start_time = psd_proc_start_time(me);
    psd_arena_set_state(&map, PSD_ARENA_READY);
}

static void test_dead_mutex_owner(void) {
    pthread_mutex_t *mu = &psd_hdr(&map)->admission; /* the one mutex left: learners' claims */
    pid_t child = fork();
    if (child == 0) {
        psd_mutex_lock(psd_hdr(&map), mu);
        _exit(0); /* dies holding it */
    }
    int status;
    waitpid(child, &status, 0);
    int rc = psd_mutex_lock(psd_hdr(&map), mu);
    CHECK(rc == PSD_EOWNERDEAD, "lock after dead owner gave %d (%s)", rc, psd_strerror(rc));
    psd_mutex_unlock(mu);
    rc = psd_mutex_lock(psd_hdr(&map), mu);
    CHECK(rc == 0, "lock after recovery gave %d", rc);
    psd_mutex_unlock(mu);
    CHECK(atomic_load(&psd_hdr(&map)->lock_recoveries) == 1, "recovery not counted");
}

static void test_dead_cond_waiter(void) {
    struct psd_cond *c = &psd_hdr(&map)->sync_cond;
    pid_t child = fork();
    if (child == 0) {
        uint32_t seen = psd_cond_prepare(c);
        psd_cond_wait(c, seen, 10ull * 1000 * 1000 * 1000);
        _exit(0);
    }
    uint64_t deadline = psd_now_ns() + 5ull * 1000 * 1000 * 1000;
    while (atomic_load(&c->waiters) == 0 && psd_now_ns() < deadline)
        usleep(1000);
    CHECK(atomic_load(&c->waiters) == 1, "child never announced itself as a waiter");
    kill(child, SIGKILL);
    int status;
    waitpid(child, &status, 0);
    CHECK(WIFSIGNALED(status), "child was not killed");
    uint64_t t0 = psd_now_ns();
    for (int i = 0; i < 3; i++)
        psd_cond_broadcast_if_waiters(c); /* the dead waiter's announcement is still there */
    CHECK(psd_now_ns() - t0 < 1000ull * 1000 * 1000, "broadcast after a dead waiter took over 1 s");
    uint32_t seen = psd_cond_prepare(c);
    int rc = psd_cond_wait(c, seen, 1000 * 1000);
    psd_cond_done(c);
    CHECK(rc == ETIMEDOUT, "a wait with nobody signalling must time out, got %d", rc);
    atomic_store(&c->waiters, 0);
}

/* Detach learner i and wait until the update loop has drained and freed its slot. */
static void release_and_wait(struct psd_map *m, int i, uint32_t slot, uint64_t claim) {
    int rc = psd_slot_release(m, slot, claim);
    CHECK(rc == 0, "release %d: %s", i, psd_strerror(rc));
    rc = psd_wait_freed(m, slot, claim, 5ull * 1000 * 1000 * 1000);
    CHECK(rc == 0, "wait freed %d: %s", i, psd_strerror(rc));
}

struct producer {
    pthread_t thread;
    uint32_t slot;
    uint64_t claim;
    int rc;
};

static void *produce(void *arg) {
    struct producer *p = arg;
    for (uint64_t i = 0; i < PUSHES; i++) {
        int rc = psd_wait_space(&map, p->slot, p->claim, 5ull * 1000 * 1000 * 1000);
        if (rc) {
            p->rc = rc;
            return NULL;
        }
        if (p->slot % 2) {
            /* Odd slots push from private tensors (what Learner.step does): the slots' piece
             * with this slot's 1, no gradient for the middle, and the last float. */
            float mine[SLOTS] = {0};
            mine[p->slot] = 1.0f;
            float last = 1.0f;
            const struct psd_src src[] = {{mine, NULL, SLOTS, 0, 0}, {NULL, NULL, N - SLOTS - 1, 0, 0},
                                          {&last, NULL, 1, 0, 0}};
            /* Slots 3, 7, ... store them as bfloat16 (--grad-dtype bf16; 1.0 is exact). */
            uint32_t store = p->slot % 4 == 3 ? PSD_DTYPE_BF16 : PSD_DTYPE_F32;
            rc = psd_push_from(&map, p->slot, i, 1, 0.0, 1.0f, src, 3, PSD_DTYPE_F32, store, NULL);
        } else {
            struct psd_lslot *l = psd_lslot_at(&map, p->slot);
            float *g = psd_entry_grad(psd_entry_at(&map, p->slot, atomic_load_explicit(&l->tail, memory_order_relaxed)));
            memset(g, 0, N * sizeof(float));
            g[p->slot] = 1.0f;
            g[N - 1] = 1.0f;
            rc = psd_push(&map, p->slot, i, 1, 0.0, 1.0f, NULL);
        }
        if (rc) {
            p->rc = rc;
            return NULL;
        }
    }
    p->rc = psd_wait_drained(&map, p->slot, p->claim, 5ull * 1000 * 1000 * 1000);
    return NULL;
}

static void test_rings(void) {
    struct psd_loop *loop;
    int rc = psd_loop_start(&map, 1, 20, pieces, 3, 0, &loop);
    CHECK(rc == 0, "loop start: %s", psd_strerror(rc));
    struct producer prods[SLOTS];
    pid_t me = getpid();
    for (int i = 0; i < SLOTS; i++) {
        memset(&prods[i], 0, sizeof prods[i]);
        rc = psd_slot_claim(&map, me, psd_proc_start_time(me), i, 5ull * 1000 * 1000 * 1000, &prods[i].slot,
                            &prods[i].claim);
        CHECK(rc == 0, "claim %d: %s", i, psd_strerror(rc));
    }
    uint32_t extra;
    uint64_t extra_claim;
    rc = psd_slot_claim(&map, me, psd_proc_start_time(me), -1, 5ull * 1000 * 1000 * 1000, &extra, &extra_claim);
    CHECK(rc == PSD_ENOSLOT, "claim beyond the slots gave %d", rc);
    for (int i = 0; i < SLOTS; i++)
        pthread_create(&prods[i].thread, NULL, produce, &prods[i]);
    /* While they push: consistent snapshots (w[N-1] counts every applied gradient), and a pull thread. */
    static float front[N], back[N];
    struct psd_puller *puller;
    rc = psd_puller_start(&map, prods[0].slot, front, back, N, 0, &puller);
    CHECK(rc == 0, "puller start: %s", psd_strerror(rc));
    uint64_t last_clock = 0;
    int snapshots = 0, swaps = 0;
    /* A learner pulling only what changed (psd_pull_changed), as a model with sparse gradients does. */
    static float rows_copy[N];
    uint8_t whole[3];
    uint64_t rows_clock = 0, rows_pos, rows_epoch, rows_bytes, rows_pulled = 0;
    psd_rowlog_mark(&map, &rows_pos, &rows_epoch);
    memcpy(rows_copy, psd_weights(&map), sizeof rows_copy); /* no update yet: no race */
    while (atomic_load(&psd_hdr(&map)->applied) < (uint64_t)SLOTS * PUSHES / 2) {
        rc = psd_pause(&map, getpid(), psd_proc_start_time(getpid()), 5ull * 1000 * 1000 * 1000);
        CHECK(rc == 0, "pause: %s", psd_strerror(rc));
        uint64_t clock = atomic_load(&psd_hdr(&map)->clock);
        float total = psd_weights(&map)[N - 1];
        psd_resume(&map);
        CHECK(total == -(float)clock, "snapshot torn: w[N-1] = %g at clock %llu", total, (unsigned long long)clock);
        snapshots++;
        uint64_t c;
        int idx = psd_puller_take(puller, &c);
        if (idx >= 0) {
            CHECK(c >= last_clock, "pulled clock went back from %llu to %llu", (unsigned long long)last_clock,
                  (unsigned long long)c);
            last_clock = c;
            swaps++;
            /* Read the whole new front, as a learner trains on it: a pull thread still writing it
             * is a race that ThreadSanitizer reports (only the read of the shared weights is
             * suppressed). w[N-1] counts updates down: the pull holds at least those up to c. */
            const float *fb = idx == 0 ? front : back;
            float sum = 0.0f;
            for (int j = 0; j < N; j++)
                sum += fb[j];
            CHECK(fb[N - 1] <= -(float)c && sum == sum, "front buffer at clock %llu holds w[N-1] = %g",
                  (unsigned long long)c, fb[N - 1]);
        }
        psd_puller_request(puller);
        uint64_t rc_clock = psd_pull_changed(&map, prods[1].slot, rows_copy, rows_clock, &rows_pos, &rows_epoch,
                                             pieces, 3, whole, &rows_bytes);
        CHECK(rc_clock >= rows_clock, "changed-rows pull went back from %llu to %llu",
              (unsigned long long)rows_clock, (unsigned long long)rc_clock);
        rows_clock = rc_clock;
        rows_pulled += rows_bytes;
    }
    psd_puller_stop(puller);
    CHECK(snapshots > 0 && swaps > 0, "no snapshot (%d) or no pull (%d) happened", snapshots, swaps);
    for (int i = 0; i < SLOTS; i++) {
        pthread_join(prods[i].thread, NULL);
        CHECK(prods[i].rc == 0, "producer %d: %s", i, psd_strerror(prods[i].rc));
    }
    for (int i = 0; i < SLOTS; i++)
        release_and_wait(&map, i, prods[i].slot, prods[i].claim);
    psd_loop_stop(loop);
    struct psd_header *h = psd_hdr(&map);
    float *w = psd_weights(&map);
    psd_pull_changed(&map, prods[1].slot, rows_copy, rows_clock, &rows_pos, &rows_epoch, pieces, 3, whole,
                     &rows_bytes);
    CHECK(memcmp(rows_copy, w, sizeof rows_copy) == 0 && rows_pulled > 0,
          "the changed-rows pulls do not end at the weights (%llu bytes pulled)", (unsigned long long)rows_pulled);
    for (int i = 0; i < SLOTS; i++)
        CHECK(w[i] == -(float)PUSHES, "w[%d] = %g, expected %d", i, w[i], -PUSHES);
    CHECK(w[N - 1] == -(float)(SLOTS * PUSHES), "w[N-1] = %g", w[N - 1]);
    for (int i = SLOTS; i < N - 1; i++)
        CHECK(w[i] == 0.0f, "w[%d] = %g, expected 0", i, w[i]);
    CHECK(atomic_load(&h->applied) == SLOTS * PUSHES, "applied %llu", (unsigned long long)atomic_load(&h->applied));
    CHECK(atomic_load(&h->retired_pushed) == SLOTS * PUSHES, "retired %llu",
          (unsigned long long)atomic_load(&h->retired_pushed));
    CHECK(atomic_load(&h->clock) == SLOTS * PUSHES, "clock");
    for (int i = 0; i < SLOTS; i++)
        CHECK(atomic_load(&psd_rank_at(&map, (uint32_t)i)->applied) == PUSHES, "rank %d progress", i);
}

/* -- sync modes, each on an arena of its own -------------------------------- */

enum { SYNC_PUSHES = 2000 };

static void setup_sync(struct psd_map *m, char *nm, size_t len, uint32_t mode, uint32_t param) {
    snprintf(nm, len, "/psd.stress-%d-sync%u", (int)getpid(), mode);
    int rc = psd_arena_create(m, nm, 0600, SLOTS, RING, 4096, "stress");
    CHECK(rc == 0, "create: %s", psd_strerror(rc));
    struct psd_header *h = psd_hdr(m);
    h->cfg.sync_mode = mode; /* before grow: bsp needs the accumulator */
    h->cfg.sync_param = param;
    if (mode == PSD_SYNC_KASYNC) { /* kasync with Adagrad: each gradient's square taken as it is accumulated */
        h->cfg.optimizer = PSD_OPT_ADAGRAD;
        h->cfg.eps = 1e-10;
    }
    const char spec[] = "[]";
    pid_t me = getpid();
    rc = psd_arena_set_spec(m, spec, sizeof spec, 1, &model, me, psd_proc_start_time(me));
    CHECK(rc == 0, "set_spec: %s", psd_strerror(rc));
    rc = psd_arena_grow(m);
    CHECK(rc == 0, "grow: %s", psd_strerror(rc));
    h = psd_hdr(m);
    h->cfg.lr = 1.0;
    atomic_store(&h->server_pid, me);
    h->server_start_time = psd_proc_start_time(me);
    psd_arena_set_state(m, PSD_ARENA_READY);
}

struct sync_learner {
    pthread_t thread;
    struct psd_map *m;
    uint32_t slot;
    uint64_t claim;
    int slow;
    int rc;
};

static void *sync_learn(void *arg) {
    struct sync_learner *p = arg;
    struct psd_header *h = psd_hdr(p->m);
    struct psd_lslot *l = psd_lslot_at(p->m, p->slot);
    const uint64_t second = 1000ull * 1000 * 1000;
    for (uint64_t i = 0; i < SYNC_PUSHES && !p->rc; i++) {
        if ((p->rc = psd_wait_space(p->m, p->slot, p->claim, 5 * second)))
            break;
        for (volatile int spin = 0; spin < p->slow * 2000; spin++) {
        }
        uint64_t rounds = atomic_load(&h->rounds);
        float *g = psd_entry_grad(psd_entry_at(p->m, p->slot, atomic_load_explicit(&l->tail, memory_order_relaxed)));
        memset(g, 0, N * sizeof(float));
        g[p->slot] = 1.0f;
        g[N - 1] = 1.0f;
        if ((p->rc = psd_push(p->m, p->slot, atomic_load(&h->clock), 1, 0.0, 1.0f, NULL)))
            break;
        if (h->cfg.sync_mode == PSD_SYNC_BSP)
            p->rc = psd_wait_round(p->m, p->slot, p->claim, rounds, 5 * second);
        else
            p->rc = psd_wait_ssp(p->m, p->slot, p->claim, 5 * second);
    }
    if (!p->rc)
        p->rc = psd_wait_drained(p->m, p->slot, p->claim, 5 * second);
    return NULL;
}

/* The largest gap (fastest - slowest) among active learners: maxima read first, then minima. */
static uint64_t ssp_gap(struct psd_map *m) {
    uint64_t hi = 0, lo = UINT64_MAX;
    for (int pass = 0; pass < 2; pass++)
        for (uint32_t i = 0; i < SLOTS; i++) {
            struct psd_slot *s = psd_slot_at(m, i);
            if (atomic_load(&s->state) != PSD_SLOT_ACTIVE)
                continue;
            uint64_t c = atomic_load(&s->ssp_base) + atomic_load(&psd_lslot_at(m, i)->tail);
            if (pass == 0 && c > hi)
                hi = c;
            if (pass == 1 && c < lo)
                lo = c;
        }
    return lo == UINT64_MAX || hi < lo ? 0 : hi - lo;
}

static void test_sync_mode(uint32_t mode) {
    struct psd_map m = {.fd = -1};
    char nm[96];
    setup_sync(&m, nm, sizeof nm, mode, mode == PSD_SYNC_KASYNC ? 2 : 1);
    struct psd_loop *loop;
    int rc = psd_loop_start(&m, 1, 20, pieces, 3, 0, &loop);
    CHECK(rc == 0, "loop start: %s", psd_strerror(rc));
    struct sync_learner ls[SLOTS];
    pid_t me = getpid();
    for (int i = 0; i < SLOTS; i++) {
        memset(&ls[i], 0, sizeof ls[i]);
        ls[i].m = &m;
        ls[i].slow = i == 0 ? 5 : 1;
        rc = psd_slot_claim(&m, me, psd_proc_start_time(me), i, 5ull * 1000 * 1000 * 1000, &ls[i].slot,
                            &ls[i].claim);
        CHECK(rc == 0, "claim %d: %s", i, psd_strerror(rc));
    }
    for (int i = 0; i < SLOTS; i++)
        pthread_create(&ls[i].thread, NULL, sync_learn, &ls[i]);
    uint64_t worst = 0, deadline = psd_now_ns() + 60ull * 1000 * 1000 * 1000;
    while (atomic_load(&psd_hdr(&m)->applied) < (uint64_t)SLOTS * SYNC_PUSHES * 9 / 10 && psd_now_ns() < deadline) {
        uint64_t gap = ssp_gap(&m);
        worst = gap > worst ? gap : worst;
    }
    for (int i = 0; i < SLOTS; i++) {
        pthread_join(ls[i].thread, NULL);
        CHECK(ls[i].rc == 0, "sync learner %d: %s", i, psd_strerror(ls[i].rc));
    }
    for (int i = 0; i < SLOTS; i++)
        release_and_wait(&m, i, ls[i].slot, ls[i].claim);
    psd_loop_stop(loop);
    struct psd_header *h = psd_hdr(&m);
    float *w = psd_weights(&m);
    CHECK(atomic_load(&h->applied) == SLOTS * SYNC_PUSHES, "applied %llu", (unsigned long long)atomic_load(&h->applied));
    if (mode == PSD_SYNC_BSP) {
        /* Every round averaged one gradient from each learner: each w[i] moved 1/SLOTS per round. */
        CHECK(atomic_load(&h->rounds) == SYNC_PUSHES, "rounds %llu", (unsigned long long)atomic_load(&h->rounds));
        CHECK(atomic_load(&h->clock) == SYNC_PUSHES, "bsp clock %llu", (unsigned long long)atomic_load(&h->clock));
        for (int i = 0; i < SLOTS; i++)
            CHECK(w[i] == -(float)SYNC_PUSHES / SLOTS, "bsp w[%d] = %g", i, w[i]);
        CHECK(w[N - 1] == -(float)SYNC_PUSHES, "bsp w[N-1] = %g", w[N - 1]);
        CHECK(atomic_load(&h->staleness_max) == 0, "bsp staleness %llu",
              (unsigned long long)atomic_load(&h->staleness_max));
    } else if (mode == PSD_SYNC_KASYNC) {
        /* kasync:2, Adagrad: two gradients a round, each gradient's square in the sum (the square of a round's
         * sum would make the last element's 4 a round, not 2); every weight finite and moved the right way. */
        const float *sum = psd_state(&m, 0);
        CHECK(atomic_load(&h->clock) == SLOTS * SYNC_PUSHES / 2, "kasync clock %llu",
              (unsigned long long)atomic_load(&h->clock));
        for (int i = 0; i < SLOTS; i++)
            CHECK(sum[i] == (float)SYNC_PUSHES && isfinite(w[i]) && w[i] < 0.0f, "kasync sum[%d] = %g, w %g", i,
                  sum[i], w[i]);
        CHECK(sum[N - 1] == (float)(SLOTS * SYNC_PUSHES), "kasync sum[N-1] = %g", sum[N - 1]);
        CHECK(w[SLOTS] == 0.0f && isfinite(w[N - 1]) && w[N - 1] < 0.0f, "kasync w %g %g", w[SLOTS], w[N - 1]);
    } else {
        CHECK(worst <= 2 && worst >= 1, "ssp:1 gap reached %llu (bound 2)", (unsigned long long)worst);
        CHECK(atomic_load(&h->clock) == SLOTS * SYNC_PUSHES, "ssp clock");
        for (int i = 0; i < SLOTS; i++)
            CHECK(w[i] == -(float)SYNC_PUSHES, "ssp w[%d] = %g", i, w[i]);
    }
    psd_arena_close(&m);
    shm_unlink(nm);
}

/* -- claims racing their own deadlines, the reaper and each other ------------ */

enum { CHURN_CLAIMS = 3000 };

struct churner {
    pthread_t thread;
    struct psd_map *m;
    uint32_t seed;
    int admitted, timed_out, rc;
};

/* Claim with deadlines from 0 to a few answers long, so that many run out while the loop answers; give
 * back every slot admitted. */
static void *churn(void *arg) {
    struct churner *c = arg;
    pid_t me = getpid();
    uint64_t start = psd_proc_start_time(me);
    for (int i = 0; i < CHURN_CLAIMS && !c->rc; i++) {
        c->seed = c->seed * 1103515245u + 12345u;
        uint64_t timeout = (uint64_t)((c->seed >> 8) % 400) * 1000; /* 0 .. 400 us */
        uint32_t slot;
        uint64_t claim;
        int rc = psd_slot_claim(c->m, me, start, -1, timeout, &slot, &claim);
        if (rc == 0) {
            c->admitted++;
            if ((rc = psd_slot_release(c->m, slot, claim)) == 0)
                rc = psd_wait_freed(c->m, slot, claim, 5ull * 1000 * 1000 * 1000);
            if (rc)
                c->rc = rc;
        } else if (rc == PSD_ETIMEOUT || rc == PSD_ENOSLOT) {
            c->timed_out++;
        } else {
            c->rc = rc;
        }
    }
    return NULL;
}

struct reaper {
    pthread_t thread;
    struct psd_map *m;
    _Atomic int stop;
    int passes;
    int32_t reaped; /* the first pid it judged gone, 0 if none */
};

static void *reap_loop(void *arg) {
    struct reaper *r = arg;
    while (!atomic_load(&r->stop)) {
        int32_t pids[SLOTS];
        uint32_t n;
        psd_reap(r->m, pids, SLOTS, &n);
        if (n && !r->reaped)
            r->reaped = pids[0];
        r->passes++;
    }
    return NULL;
}

/* Two claimers whose deadlines run out while the loop answers, beside the reaper: no slot is left
 * ACTIVE for nobody (an answer crossing a withdrawal is given back), no live owner is reaped, and once
 * the churn stops every slot comes FREE again. */
static void test_claim_churn(void) {
    struct psd_map m = {.fd = -1};
    char nm[96];
    setup_sync(&m, nm, sizeof nm, PSD_SYNC_ASP, 0);
    struct psd_loop *loop;
    int rc = psd_loop_start(&m, 1, 20, pieces, 3, 0, &loop);
    CHECK(rc == 0, "loop start: %s", psd_strerror(rc));
    struct reaper r = {.m = &m};
    pthread_create(&r.thread, NULL, reap_loop, &r);
    struct churner cs[2] = {{.m = &m, .seed = 1}, {.m = &m, .seed = 2}};
    for (int i = 0; i < 2; i++)
        pthread_create(&cs[i].thread, NULL, churn, &cs[i]);
    for (int i = 0; i < 2; i++) {
        pthread_join(cs[i].thread, NULL);
        CHECK(cs[i].rc == 0, "churner %d: %s", i, psd_strerror(cs[i].rc));
    }
    atomic_store(&r.stop, 1);
    pthread_join(r.thread, NULL);
    CHECK(r.passes > 0 && r.reaped == 0, "the reaper judged a live claimer gone (pid %d)", r.reaped);
    CHECK(cs[0].admitted + cs[1].admitted > 0 && cs[0].timed_out + cs[1].timed_out > 0,
          "the churn never raced a deadline (admitted %d, timed out %d)", cs[0].admitted + cs[1].admitted,
          cs[0].timed_out + cs[1].timed_out);
    uint64_t deadline = psd_now_ns() + 2ull * 1000 * 1000 * 1000;
    uint32_t busy;
    do {
        busy = 0;
        for (uint32_t i = 0; i < SLOTS; i++)
            busy += atomic_load(&psd_slot_at(&m, i)->state) != PSD_SLOT_FREE;
        if (busy)
            usleep(1000);
    } while (busy && psd_now_ns() < deadline);
    CHECK(busy == 0, "%u slots stayed in use after every claimer gave its slot back or withdrew", busy);
    psd_loop_stop(loop);
    psd_arena_close(&m);
    shm_unlink(nm);
}

int main(void) {
    setup();
    test_dead_mutex_owner(); /* fork-based checks first, before any thread exists */
    test_dead_cond_waiter();
    test_rings();
    test_sync_mode(PSD_SYNC_BSP);
    test_sync_mode(PSD_SYNC_SSP);
    test_sync_mode(PSD_SYNC_KASYNC);
    test_claim_churn();
    psd_arena_close(&map);
    shm_unlink(name);
    printf("%d passed, %d failed\n", passed, failed);
    return failed != 0;
}
