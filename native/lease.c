/*
 * lease.c -- telling a live learner from a dead one, with /proc or without.
 *
 * A slot records its owner's pid, start time and PID namespace. Where the
 * judge shares that namespace and can read /proc/<pid>/stat, the pid and start
 * time say at once whether the owner lives (the fast path). In another PID
 * namespace (a learner in a second container sharing /dev/shm), with /proc
 * mounted hidepid, or under --liveness lease, /proc cannot tell: a pid there
 * names some other process or none. Then the owner's lease decides: the
 * learner bumps its slot's lease_beat at every push and from a small native
 * thread started at its first claim (so a learner busy computing, waiting, or
 * holding the GIL keeps its slot); the reaper takes the slot back once the
 * beat stood still for lease_ms of the reaper's own clock. Counting beats
 * instead of comparing timestamps keeps clocks of different processes (or time
 * namespaces) out of it.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "psd.h"

uint64_t psd_pid_ns(void) {
    struct stat st;
    if (stat("/proc/self/ns/pid", &st) != 0)
        return 0;
    return (uint64_t)st.st_ino;
}

bool psd_proc_usable(const struct psd_header *h) {
    if (h && (h->cfg.cfg_flags & PSD_CFG_LEASE_ONLY))
        return false;
    const char *env = getenv("PSD_LIVENESS");
    return !(env && strcmp(env, "lease") == 0);
}

enum psd_live psd_liveness(const struct psd_header *h, pid_t pid, uint64_t start_time, uint64_t pid_ns) {
    if (pid <= 0)
        return PSD_LIVE_NO;
    if (!psd_proc_usable(h))
        return PSD_LIVE_UNKNOWN;
    uint64_t mine = psd_pid_ns();
    if (pid_ns == 0 || mine == 0 || pid_ns != mine)
        return PSD_LIVE_UNKNOWN; /* the pid means something else here, or nothing */
    /* kill(pid, 0) needs no /proc and sees through hidepid: ESRCH is certain. */
    if (kill(pid, 0) != 0 && errno == ESRCH)
        return PSD_LIVE_NO;
    uint64_t start;
    bool zombie;
    if (!psd_proc_stat(pid, &start, &zombie))
        return PSD_LIVE_UNKNOWN; /* exists (or just exited) but /proc hides it: the lease tells */
    if (zombie)
        return PSD_LIVE_NO;
    if (start_time == 0)
        return PSD_LIVE_UNKNOWN; /* the owner could not read its own start time */
    return start == start_time ? PSD_LIVE_YES : PSD_LIVE_NO;
}

uint64_t psd_lease_ns(const struct psd_header *h) {
    uint32_t ms = h->cfg.lease_ms ? h->cfg.lease_ms : PSD_LEASE_MS_DEFAULT;
    return (uint64_t)ms * 1000 * 1000;
}

/* ---- the learner's renewal thread ------------------------------------------ */

struct psd_lease {
    struct psd_map *m;
    pthread_t thread;
    pid_t owner; /* the process that started it: a forked child must not join it */
    struct psd_cond wake;
    _Atomic int stop;
};

#define LEASE_MIN_PERIOD_NS (10ull * 1000 * 1000)
#define LEASE_MAX_PERIOD_NS (500ull * 1000 * 1000)

/* Bump the beat of every slot m still holds under the token it claimed with. */
static void renew(struct psd_map *m) {
    for (uint32_t i = 0; i < m->n_held && i < m->g.n_slots; i++) {
        uint64_t token = PSD_LOAD_RLX(&m->held[i]);
        if (!token)
            continue;
        /* A slot handed on to another learner is not renewed: its beat is the new owner's. */
        if (token != UINT64_MAX && PSD_LOAD_RLX(&psd_slot_at(m, i)->claims) == token)
            PSD_ADD_RLX(&psd_lslot_at(m, i)->lease_beat, 1); /* read relaxed by psd_reap: only the change matters */
    }
}

static void *lease_main(void *arg) {
    struct psd_lease *L = arg;
    while (!atomic_load(&L->stop)) {
        renew(L->m);
        uint64_t period = psd_lease_ns(psd_hdr(L->m)) / 10;
        period = period < LEASE_MIN_PERIOD_NS ? LEASE_MIN_PERIOD_NS
                 : period > LEASE_MAX_PERIOD_NS ? LEASE_MAX_PERIOD_NS
                                                : period;
        uint32_t seen = psd_cond_prepare(&L->wake);
        if (!atomic_load(&L->stop)) /* pairs with the store of stop in psd_lease_stop */
            psd_cond_wait(&L->wake, seen, period);
        psd_cond_done(&L->wake);
    }
    return NULL;
}

/* m->lease is made once, though several threads of this process may claim through one mapping at
 * once: a lock of this process's own, never one in the arena. */
static pthread_mutex_t lease_lock = PTHREAD_MUTEX_INITIALIZER;

int psd_lease_start(struct psd_map *m) {
    int rc = 0;
    pthread_mutex_lock(&lease_lock);
    if (!m->lease) {
        struct psd_lease *L = calloc(1, sizeof *L);
        if (!L) {
            rc = ENOMEM;
        } else {
            L->m = m;
            L->owner = getpid();
            psd_cond_init(&L->wake);
            if ((rc = pthread_create(&L->thread, NULL, lease_main, L)) != 0)
                free(L);
            else
                m->lease = L;
        }
    }
    pthread_mutex_unlock(&lease_lock);
    return rc;
}

void psd_lease_stop(struct psd_map *m) {
    pthread_mutex_lock(&lease_lock);
    struct psd_lease *L = m->lease;
    m->lease = NULL;
    pthread_mutex_unlock(&lease_lock);
    if (!L)
        return;
    if (L->owner == getpid()) { /* in a forked child the thread does not exist */
        atomic_store(&L->stop, 1); /* pairs with the load in lease_main */
        psd_cond_broadcast(&L->wake);
        pthread_join(L->thread, NULL);
    }
    free(L);
}
