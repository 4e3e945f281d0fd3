/*
 * sigbus.c -- a SIGBUS on an arena becomes a clear message and an exit status, never a core dump.
 *
 * An arena is a file in /dev/shm. If another process truncates it (or replaces it and truncates the
 * old one), the next access to a page past the new end raises SIGBUS in whichever process touches it:
 * the server's update loop, a learner's push or pull, the watchdog's snapshot. Nothing can recover
 * that mapping, so the handler says what happened -- which file, which address, what to do -- with
 * write(2), and ends the process with a status of its own, which the watchdog reads as "arena lost"
 * (it restarts the server from the last checkpoint) and `psd run` as a learner to restart.
 *
 * The handler names the file by looking the faulting address up in /proc/self/maps (open, read and
 * close are async-signal-safe). A SIGBUS outside a psd arena is not ours to explain: the handler
 * puts back whatever handled SIGBUS before it (the default action, Python's faulthandler) and
 * raises it again, so it meets that, as it would have without psd.
 *
 * The processes that supervise a job -- the watchdog, `psd run`, `psd status` -- must outlive its
 * arena: the watchdog is what restarts the server from a checkpoint when a learner truncates the file,
 * and it reads the header between its check of the file's size and the truncation as often as not.
 * They ask for recovery (psd_sigbus_install's `recover`): the handler replaces the faulting mapping
 * (the one VMA, as /proc/self/maps lists it) with anonymous zero pages of the same protection, notes
 * its range in `lost`, and returns, so the faulting load runs again and reads zeros. The binding asks
 * psd_sigbus_lost after every read of a mapping and raises ArenaLost instead of handing the zeros on
 * (py_arena.c check_lost). A later unmap of the range forgets it (psd_sigbus_forget), so a new
 * mapping at the same address is not taken for the lost one.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>
#include <sched.h>
#include <sys/mman.h>
#include <unistd.h>

#include "psd_sigbus.h"

static volatile sig_atomic_t exit_status = 1; /* set before the handler is installed */
static struct sigaction previous;               /* what SIGBUS did before: faults outside arenas go there */

/* Whether a fault on an arena is recovered (psd_sigbus_recover) rather than the end of the process. */
static atomic_bool recover;

/* The ranges of arena mappings replaced after a fault, [start, end); a free entry has start 0. The
 * handler claims an entry by compare-exchange of start (pairs with the loads in psd_sigbus_lost and
 * the stores in psd_sigbus_forget); `n_lost` counts the claims ever made, so that a process that
 * never lost a mapping reads one word a check. */
#define PSD_SIGBUS_LOST_MAX 64
static struct {
    _Atomic uintptr_t start, end;
} lost[PSD_SIGBUS_LOST_MAX];
static atomic_uint n_lost;

/* Held by the handler of one thread while it looks the fault up and replaces the mapping: the threads of a
 * parallel copy (torch's clone in a checkpoint) fault on the same mapping at once, and one that read
 * /proc/self/maps after another replaced it would find an anonymous mapping, "not an arena", and die. Under
 * it, a fault inside a range already replaced returns at once (its load runs again, on the zero pages). Its
 * holder runs a bounded handler (one read of /proc/self/maps, one mmap) and cannot fault inside it: the
 * handler touches no arena, and SIGBUS is blocked while it runs. */
static atomic_flag recovering = ATOMIC_FLAG_INIT;

static size_t put(char *buf, size_t at, size_t cap, const char *s) {
    while (*s && at + 1 < cap)
        buf[at++] = *s++;
    return at;
}

static size_t put_hex(char *buf, size_t at, size_t cap, uintptr_t v) {
    char tmp[2 + 2 * sizeof v + 1];
    size_t n = sizeof tmp - 1;
    tmp[n] = '\0';
    do {
        tmp[--n] = "0123456789abcdef"[v & 15];
        v >>= 4;
    } while (v && n > 2);
    tmp[--n] = 'x';
    tmp[--n] = '0';
    return put(buf, at, cap, tmp + n);
}

static size_t put_dec(char *buf, size_t at, size_t cap, unsigned v) {
    char tmp[12];
    size_t n = sizeof tmp - 1;
    tmp[n] = '\0';
    do {
        tmp[--n] = (char)('0' + v % 10);
        v /= 10;
    } while (v && n > 0);
    return put(buf, at, cap, tmp + n);
}

static uintptr_t parse_hex(const char **p) {
    uintptr_t v = 0;
    for (;; (*p)++) {
        char c = **p;
        if (c >= '0' && c <= '9')
            v = v * 16 + (uintptr_t)(c - '0');
        else if (c >= 'a' && c <= 'f')
            v = v * 16 + (uintptr_t)(c - 'a' + 10);
        else
            return v;
    }
}

/* One mapping of /proc/self/maps: its range, protection and path. */
struct vma {
    uintptr_t start, end;
    int prot;
    char path[256];
};

/* The path of the mapping that holds `addr`, from one line of /proc/self/maps
 * ("start-end perms offset dev inode   path"), with its range and protection into `v`; false if the
 * line does not hold it. */
static bool line_holds(const char *line, uintptr_t addr, const char **path, struct vma *v) {
    const char *p = line;
    uintptr_t start = parse_hex(&p);
    if (*p++ != '-')
        return false;
    uintptr_t end = parse_hex(&p);
    if (addr < start || addr >= end)
        return false;
    v->start = start;
    v->end = end;
    v->prot = (p[1] == 'r' ? PROT_READ : 0) | (p[2] == 'w' ? PROT_WRITE : 0);
    for (int field = 0; field < 4; field++) { /* perms, offset, dev, inode */
        while (*p == ' ')
            p++;
        while (*p && *p != ' ')
            p++;
    }
    while (*p == ' ')
        p++;
    *path = p;
    return true;
}

/* The mapping holding `addr`, into v (an empty path if none is found). */
static void mapping_at(uintptr_t addr, struct vma *v) {
    char *out = v->path;
    size_t cap = sizeof v->path;
    out[0] = '\0';
    int fd = open("/proc/self/maps", O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return;
    char buf[4096], line[512];
    size_t len = 0;
    bool overlong = false;
    for (;;) {
        ssize_t n = read(fd, buf, sizeof buf);
        if (n <= 0)
            break;
        for (ssize_t i = 0; i < n; i++) {
            if (buf[i] != '\n') {
                if (len + 1 < sizeof line)
                    line[len++] = buf[i];
                else
                    overlong = true;
                continue;
            }
            line[len] = '\0';
            const char *path;
            if (!overlong && line_holds(line, addr, &path, v)) {
                size_t k = 0;
                while (path[k] && k + 1 < cap) {
                    out[k] = path[k];
                    k++;
                }
                out[k] = '\0';
                close(fd);
                return;
            }
            len = 0;
            overlong = false;
        }
    }
    close(fd);
}

static bool in_lost(uintptr_t addr) {
    for (int i = 0; i < PSD_SIGBUS_LOST_MAX; i++) {
        uintptr_t start = atomic_load(&lost[i].start);
        if (start && start <= addr && addr < atomic_load(&lost[i].end))
            return true;
    }
    return false;
}

/* Replace the lost mapping `v` with anonymous zero pages and note its range; false if it cannot be
 * (no free entry, or mmap failed): the process then ends as without recovery. */
static bool recover_mapping(const struct vma *v) {
    for (int i = 0; i < PSD_SIGBUS_LOST_MAX; i++) {
        uintptr_t free_ = 0;
        if (!atomic_compare_exchange_strong(&lost[i].start, &free_, v->start))
            continue;
        atomic_store(&lost[i].end, v->end);
        atomic_fetch_add(&n_lost, 1);
        void *p = mmap((void *)v->start, v->end - v->start, v->prot ? v->prot : PROT_READ,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
        return p != MAP_FAILED;
    }
    return false;
}

static void on_sigbus(int sig, siginfo_t *info, void *ctx) {
    (void)ctx;
    uintptr_t addr = (uintptr_t)info->si_addr;
    bool recovers = atomic_load(&recover);
    if (recovers) {
        while (atomic_flag_test_and_set(&recovering))
            sched_yield(); /* another thread of this process is replacing a mapping: bounded, see `recovering` */
        if (in_lost(addr)) {
            atomic_flag_clear(&recovering);
            return; /* replaced by another thread since this one faulted: the load runs again, on zeros */
        }
    }
    struct vma v;
    mapping_at(addr, &v);
    const char *path = v.path;
    if (recovers && strstr(path, "/dev/shm/psd.") == path && recover_mapping(&v)) {
        atomic_flag_clear(&recovering);
        return; /* the load runs again, on zeros; the binding raises ArenaLost (psd_sigbus_lost) */
    }
    if (recovers)
        atomic_flag_clear(&recovering);
    if (strstr(path, "/dev/shm/psd.") != path) {
        /* Not an arena: put back what was there before (the default action, or Python's faulthandler)
         * and send the signal again; it is blocked until we return (and a fault repeats anyway). */
        sigaction(sig, &previous, NULL);
        raise(sig);
        return;
    }
    char msg[1024];
    size_t n = 0;
    n = put(msg, n, sizeof msg, "psd: SIGBUS at address ");
    n = put_hex(msg, n, sizeof msg, addr);
    n = put(msg, n, sizeof msg, " in the arena ");
    n = put(msg, n, sizeof msg, path);
    n = put(msg, n, sizeof msg,
            ": the file was truncated or replaced by another process, so this process's mapping of it is "
            "lost. Under `psd serve` or `psd run` the watchdog restarts the server from the last checkpoint "
            "and `psd run` restarts the learners; otherwise restart the server with `psd serve --resume` "
            "and the learners after it. Do not truncate or remove /dev/shm/psd.* of a live job (`psd clean` "
            "removes only dead jobs' arenas). Exiting with status ");
    n = put_dec(msg, n, sizeof msg, (unsigned)exit_status);
    n = put(msg, n, sizeof msg, ".\n");
    ssize_t w = write(STDERR_FILENO, msg, n);
    (void)w; /* nothing to do if stderr is gone: the exit status still says it */
    _exit(exit_status);
}

int psd_sigbus_install(int status) {
    exit_status = status;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_sigbus;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    struct sigaction old;
    if (sigaction(SIGBUS, &sa, &old) != 0)
        return errno;
    if (old.sa_sigaction != on_sigbus) /* installed twice: keep the first one's predecessor */
        previous = old;
    return 0;
}

void psd_sigbus_recover(bool on) { atomic_store(&recover, on); }

bool psd_sigbus_lost(const void *base, size_t size) {
    if (!base || atomic_load(&n_lost) == 0)
        return false;
    uintptr_t lo = (uintptr_t)base, hi = lo + size;
    for (int i = 0; i < PSD_SIGBUS_LOST_MAX; i++) {
        uintptr_t start = atomic_load(&lost[i].start);
        if (start && start < hi && lo < atomic_load(&lost[i].end))
            return true;
    }
    return false;
}

void psd_sigbus_forget(const void *base, size_t size) {
    if (!base || atomic_load(&n_lost) == 0)
        return;
    uintptr_t lo = (uintptr_t)base, hi = lo + size;
    for (int i = 0; i < PSD_SIGBUS_LOST_MAX; i++) {
        uintptr_t start = atomic_load(&lost[i].start);
        if (start && start < hi && lo < atomic_load(&lost[i].end)) {
            atomic_store(&lost[i].end, 0);
            atomic_store(&lost[i].start, 0); /* free: the handler may claim it again */
        }
    }
}
