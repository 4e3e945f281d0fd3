/*
 * sync.c -- the locks and waits that survive process death.
 *
 * Mutexes are pthread PROCESS_SHARED + ROBUST, and every lock goes through
 * psd_mutex_lock(), which turns EOWNERDEAD into repair + consistent.
 * Condition variables are futexes on a sequence word (see psd_cond in
 * psd_layout.h for why not pthread_cond_t). Every wait has a timeout.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "psd.h"

static const char *const psd_errors[] = {
    [PSD_EBADMAGIC - PSD_EFIRST] = "not a psd arena (bad magic number or foreign byte order)",
    [PSD_EVERSION - PSD_EFIRST] = "arena was made by an incompatible psd version",
    [PSD_ENOSLOT - PSD_EFIRST] = "every learner slot of the job is taken",
    [PSD_ESTATE - PSD_EFIRST] = "arena is not in the state this call needs",
    [PSD_ESPEC - PSD_EFIRST] = "parameter spec does not fit or was refused",
    [PSD_EOWNERDEAD - PSD_EFIRST] = "previous lock owner died; state repaired",
    [PSD_EEXPORTS - PSD_EFIRST] = "arena memory is still in use by buffers",
    [PSD_ESERVER - PSD_EFIRST] = "the job's server is gone or stopped",
    [PSD_ETIMEOUT - PSD_EFIRST] = "timed out",
    [PSD_ESLOT - PSD_EFIRST] = "the learner slot was taken back by the server",
    [PSD_EINIT - PSD_EFIRST] = "the arena is still being created",
    [PSD_EGEOMETRY - PSD_EFIRST] = "the arena's header describes a geometry that does not match its model or its "
                                   "size (corrupt, or overwritten by a stray process)",
    [PSD_EEVICTED - PSD_EFIRST] = "this process was evicted from the job for writing into its slot what no "
                                  "learner writes; it gets no slot again",
    [PSD_ELOST - PSD_EFIRST] = "the arena's file was truncated under this mapping, so what it held is lost to "
                               "this process (its server dies of SIGBUS and the watchdog restarts it)",
};

const char *psd_strerror(int code) {
    if (code >= PSD_EFIRST && code <= PSD_ELAST && psd_errors[code - PSD_EFIRST])
        return psd_errors[code - PSD_EFIRST];
    if (code > 0)
        return strerror(code);
    return code == 0 ? "success" : "unknown psd error";
}

uint64_t psd_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Field 22 of /proc/<pid>/stat, in clock ticks since boot. The command name
 * (field 2) may hold spaces and parentheses, so parse from its last ')'.
 * False if /proc cannot show the process (gone, hidden, or no /proc). */
bool psd_proc_stat(pid_t pid, uint64_t *start_time, bool *zombie) {
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "re");
    if (!f)
        return false;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = '\0';
    char *st = strrchr(buf, ')');
    if (!st)
        return false;
    char *p = st + 1;
    /* p now points before field 3; skip fields 3..21 */
    for (int field = 3; field <= 21; field++) {
        p = strchr(p + 1, ' ');
        if (!p)
            return false;
    }
    *start_time = (uint64_t)strtoull(p + 1, NULL, 10);
    /* A zombie has exited: its slot is dead even though /proc still lists it. */
    *zombie = st[1] == ' ' && (st[2] == 'Z' || st[2] == 'X');
    return true;
}

uint64_t psd_proc_start_time(pid_t pid) {
    uint64_t start;
    bool zombie;
    return psd_proc_stat(pid, &start, &zombie) && !zombie ? start : 0;
}

bool psd_owner_alive(pid_t pid, uint64_t start_time) {
    if (pid <= 0)
        return false;
    uint64_t now_start = psd_proc_start_time(pid);
    return now_start != 0 && now_start == start_time;
}

int psd_mutex_init(pthread_mutex_t *m) {
    pthread_mutexattr_t a;
    int rc = pthread_mutexattr_init(&a);
    if (rc)
        return rc;
    if ((rc = pthread_mutexattr_setpshared(&a, PTHREAD_PROCESS_SHARED)) == 0 &&
        (rc = pthread_mutexattr_setrobust(&a, PTHREAD_MUTEX_ROBUST)) == 0)
        rc = pthread_mutex_init(m, &a);
    pthread_mutexattr_destroy(&a);
    return rc;
}

int psd_mutex_lock(struct psd_header *h, pthread_mutex_t *m) {
    /* Bounded: a dead owner is handled by robustness (EOWNERDEAD); a live owner
     * that holds one of psd's tiny critical sections for this long is hung. */
    /* timedlock takes a CLOCK_REALTIME deadline; a clock step only stretches or
     * shortens this safety bound. (pthread_mutex_clocklock would avoid that, but
     * ThreadSanitizer does not see it as a lock.) */
    struct timespec deadline;
    clock_gettime(CLOCK_REALTIME, &deadline);
    deadline.tv_sec += PSD_LOCK_TIMEOUT_S;
    int rc = pthread_mutex_timedlock(m, &deadline);
    if (rc == ETIMEDOUT)
        return PSD_ETIMEOUT;
    if (rc == EOWNERDEAD) {
        /* Nothing is repaired here. The one arena mutex is `admission`, held while a spec is
         * offered; the offer is published by one store-release of the arena state (psd_layout.h),
         * so a dead owner left the old state or the new one. (The update loop's own multi-store
         * steps hold no lock: free_slot and evict leave `head` alone, so a server killed between
         * their stores leaves nothing to take twice.) Make the mutex usable again and report it,
         * never a quiet success. */
        pthread_mutex_consistent(m);
        PSD_ADD_RLX(&h->lock_recoveries, 1);
        return PSD_EOWNERDEAD;
    }
    return rc;
}

void psd_mutex_unlock(pthread_mutex_t *m) { pthread_mutex_unlock(m); }

static long psd_futex(_Atomic uint32_t *addr, int op, uint32_t val, const struct timespec *ts) {
    /* Shared futexes (no FUTEX_PRIVATE_FLAG): the word lives in shared memory
     * mapped by several processes. */
    return syscall(SYS_futex, (uint32_t *)addr, op, val, ts, NULL, 0);
}

void psd_cond_init(struct psd_cond *c) {
    atomic_init(&c->seq, 0);
    atomic_init(&c->waiters, 0);
}

uint32_t psd_cond_prepare(struct psd_cond *c) {
    /* seq_cst: the announcement must be visible before we read the predicate
     * (pairs with the load of `waiters` in psd_cond_broadcast_if_waiters). */
    atomic_fetch_add(&c->waiters, 1);
    return atomic_load(&c->seq);
}

void psd_cond_done(struct psd_cond *c) {
    /* Never let a counter wrap below zero, even after a repair reset it. */
    uint32_t w = atomic_load(&c->waiters);
    while (w > 0 && !atomic_compare_exchange_weak(&c->waiters, &w, w - 1)) {
    }
}

int psd_cond_wait(struct psd_cond *c, uint32_t seen, uint64_t timeout_ns) {
    struct timespec ts = {(time_t)(timeout_ns / 1000000000ull), (long)(timeout_ns % 1000000000ull)};
    long rc = psd_futex(&c->seq, FUTEX_WAIT, seen, &ts);
    if (rc == 0 || errno == EAGAIN)
        return 0; /* woken, or seq had already moved on */
    return errno;  /* ETIMEDOUT or EINTR */
}

void psd_cond_broadcast(struct psd_cond *c) {
    atomic_fetch_add(&c->seq, 1); /* pairs with the load of seq in psd_cond_prepare */
    psd_futex(&c->seq, FUTEX_WAKE, INT_MAX, NULL);
}

void psd_cond_broadcast_if_waiters(struct psd_cond *c) {
    /* seq_cst load, pairs with the fetch_add in psd_cond_prepare. */
    if (atomic_load(&c->waiters) != 0)
        psd_cond_broadcast(c);
}
