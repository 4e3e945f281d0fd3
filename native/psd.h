/*
 * psd.h -- the C core's interface: arena mapping, slots and rings, robust
 * locks, and the update loop. No Python here; only the binding (native/py_*.c)
 * talks to CPython.
 *
 * Every function returns 0 on success, a positive errno, or a PSD_E* code
 * (reserved negative range); psd_strerror() describes either.
 */
#ifndef PSD_H
#define PSD_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "psd_layout.h"

/* Reserved error range, like LMDB's MDB_KEYEXIST..MDB_LAST_ERRCODE. */
#define PSD_EFIRST (-30600)
#define PSD_EBADMAGIC (-30600)  /* not an arena / foreign byte order */
#define PSD_EVERSION (-30599)   /* made by an incompatible psd */
#define PSD_ENOSLOT (-30598)    /* every learner slot is taken */
#define PSD_ESTATE (-30597)     /* arena not in the state the call needs */
#define PSD_ESPEC (-30596)      /* spec does not fit, or was refused */
#define PSD_EOWNERDEAD (-30595) /* lock acquired; its previous owner died (nothing needed repair: sync.c) */
#define PSD_EEXPORTS (-30594)   /* mapping still exported to Python buffers */
#define PSD_ESERVER (-30593)    /* the server is gone or stopped */
#define PSD_ETIMEOUT (-30592)   /* a bounded wait ran out */
#define PSD_ESLOT (-30591)      /* the slot is no longer this learner's */
#define PSD_EINIT (-30590)      /* the arena is still being created (no magic yet) */
#define PSD_EGEOMETRY (-30589)  /* the header's geometry disagrees with itself or the file's size */
#define PSD_EEVICTED (-30588)   /* this process was evicted from the job: no slot for it */
#define PSD_ELOST (-30587)      /* the arena's file was truncated under this mapping (sigbus.c's recovery) */
#define PSD_ELAST (-30587)

const char *psd_strerror(int code);

/* Named atomics: every use says which operation it pairs with. */
#define PSD_LOAD_ACQ(p) atomic_load_explicit((p), memory_order_acquire)
#define PSD_LOAD_RLX(p) atomic_load_explicit((p), memory_order_relaxed)
#define PSD_STORE_REL(p, v) atomic_store_explicit((p), (v), memory_order_release)
#define PSD_STORE_RLX(p, v) atomic_store_explicit((p), (v), memory_order_relaxed)
#define PSD_ADD_RLX(p, v) atomic_fetch_add_explicit((p), (v), memory_order_relaxed)

#define PSD_HEARTBEAT_NS (20ull * 1000 * 1000)
#define PSD_WAIT_SLICE_NS (50ull * 1000 * 1000) /* longest single futex sleep */
#define PSD_LOCK_TIMEOUT_S 5                    /* longest wait for a robust mutex */
#define PSD_HUNG_NS (1000ull * 1000 * 1000)     /* a loop that has not beaten for this long is hung */
#define PSD_REAP_STALL_MIN_NS (1000ull * 1000 * 1000) /* the least gap between reaps taken for a stall */

/* How a process maps an arena (psd_arena_open_as): what it may write. */
enum psd_role {
    PSD_ROLE_FULL = 0,    /* server, watchdog: everything read-write */
    PSD_ROLE_LEARNER = 1, /* read-only but the shared page, its claimed slots, its offer window */
    PSD_ROLE_READER = 2,  /* psd status, top, inspect: everything read-only (fd opened O_RDONLY) */
};

struct psd_lease;

/* Where everything of an arena lies: this process's own copy, computed with
 * overflow-checked arithmetic (psd_geometry) and checked against the file's
 * size whenever a mapping is made, taken over or grown (psd_arena_adopt,
 * psd_arena_grow). Nothing here is read back from shared memory afterwards,
 * so a stray write into the header cannot move what a process addresses.
 * Until the arena is grown for a model, the model fields are 0 and
 * total_size covers the header, ranks and spec only. */
struct psd_geom {
    uint32_t n_slots, ring_k, state_vectors;
    uint64_t spec_cap, ranks_off, slotrec_off, spec_off;
    uint64_t n_params, n_train, n_buffers, n_pieces;
    uint64_t total_size, weights_off, optstate_off, buffers_off, pieces_off, rowlog_off, slots_off, slot_stride,
        entry_stride;
    uint64_t weights_bytes, optstate_bytes, rowlog_cap;
};

/* A mapping of an arena in this process. */
struct psd_map {
    int fd;
    uint8_t *base;
    size_t size;       /* bytes mapped (the file's size when mapped) */
    struct psd_geom g; /* this mapping's checked geometry (above) */
    uint32_t role;           /* enum psd_role */
    uint32_t offering;       /* learner: the offer window (header, spec, weights, buffers) is writable */
    uint32_t n_held;         /* entries of `held` */
    _Atomic uint64_t *held;  /* per slot, the claim token this mapping holds (0: none); its slots
                              * are mapped writable and renewed by its lease thread */
    struct psd_lease *lease; /* the lease thread, started at the first claim */
    uint64_t reap_last_ns;   /* the server: when its last psd_reap ran (0: none yet), for a stall of the machine */
    /* learner, a partial attach (push_buf_partial): the real-valued buffers its pushes set,
     * [push_buf_lo, push_buf_hi) of the job's; otherwise all of them */
    uint32_t push_buf_partial, push_buf_lo, push_buf_hi;
};

static inline struct psd_header *psd_hdr(const struct psd_map *m) {
    return (struct psd_header *)m->base;
}
/* Whether the mapping holds the model's regions (weights, state, rings). */
static inline bool psd_has_model(const struct psd_map *m) { return m->g.n_params != 0; }
/* The server's record of slot i (read-only to learners). */
static inline struct psd_slot *psd_slot_at(const struct psd_map *m, uint32_t i) {
    return (struct psd_slot *)(m->base + m->g.slotrec_off) + i;
}
/* What learner i writes: its request line, tail and figures, then its ring. */
static inline struct psd_lslot *psd_lslot_at(const struct psd_map *m, uint32_t i) {
    return (struct psd_lslot *)(m->base + m->g.slots_off + (uint64_t)i * m->g.slot_stride);
}
static inline struct psd_entry *psd_entry_at(const struct psd_map *m, uint32_t i, uint64_t idx) {
    uint8_t *ring = (uint8_t *)psd_lslot_at(m, i) + sizeof(struct psd_lslot);
    return (struct psd_entry *)(ring + (idx & (m->g.ring_k - 1)) * m->g.entry_stride);
}
static inline float *psd_entry_grad(struct psd_entry *e) {
    return (float *)((uint8_t *)e + sizeof(struct psd_entry));
}
/* Bytes of an entry's gradient span, rounded so the buffer deltas after it are 8-aligned. */
static inline uint64_t psd_grad_span(uint64_t n_train) { return (n_train * sizeof(float) + 7) / 8 * 8; }
static inline double *psd_entry_bufdelta(const struct psd_map *m, struct psd_entry *e) {
    return (double *)((uint8_t *)psd_entry_grad(e) + psd_grad_span(m->g.n_train));
}
static inline uint8_t *psd_entry_pieces(const struct psd_map *m, struct psd_entry *e) {
    return (uint8_t *)(psd_entry_bufdelta(m, e) + m->g.n_buffers);
}
static inline double *psd_buffers(const struct psd_map *m) {
    return (double *)(m->base + m->g.buffers_off);
}
static inline struct psd_piece *psd_piece_at(const struct psd_map *m, uint64_t k) {
    return (struct psd_piece *)(m->base + m->g.pieces_off) + k;
}
static inline struct psd_rowlog_entry *psd_rowlog_at(const struct psd_map *m, uint64_t i) {
    return (struct psd_rowlog_entry *)(m->base + m->g.rowlog_off) + (i & (m->g.rowlog_cap - 1));
}
/* The update loop's writer of the rows log (its own head; stored out after each update). */
struct psd_rowlog_writer {
    const struct psd_map *m;
    uint64_t head;
};
/* Append (piece, row) as entry `head` (psd_layout.h struct psd_rowlog_entry: a seqlock of one entry,
 * without fences, which ThreadSanitizer does not model). The fields are store-released after the
 * WRITING mark: a reader whose load-acquire of a field sees this write then sees the mark too. */
static inline void psd_rowlog_put(struct psd_rowlog_writer *w, uint64_t piece, uint64_t row) {
    struct psd_rowlog_entry *e = psd_rowlog_at(w->m, w->head);
    atomic_store_explicit(&e->seq, PSD_ROWLOG_WRITING, memory_order_relaxed);
    atomic_store_explicit(&e->piece, piece, memory_order_release); /* pairs with the reader's acquire */
    atomic_store_explicit(&e->row, row, memory_order_release);
    /* Pairs with the reader's load-acquire of seq. */
    atomic_store_explicit(&e->seq, w->head, memory_order_release);
    w->head++;
}
static inline float *psd_weights(const struct psd_map *m) {
    return (float *)(m->base + m->g.weights_off);
}
/* Optimizer-state vector i (i < g.state_vectors, see psd_state_vectors), n_train floats; the
 * bsp / kasync accumulator is the last one. */
static inline uint64_t psd_state_stride(uint64_t n_train) {
    return (n_train * sizeof(float) + PSD_PAGE - 1) / PSD_PAGE * PSD_PAGE;
}
static inline float *psd_state(const struct psd_map *m, uint32_t i) {
    return (float *)(m->base + m->g.optstate_off + i * psd_state_stride(m->g.n_train));
}
/* bsp / kasync: the sum of the round's gradients, the last state vector. */
static inline float *psd_accumulator(const struct psd_map *m) {
    return psd_state(m, m->g.state_vectors - 1);
}

/* What `psd status` shows of the header and of a slot (py_inspect.c), and the
 * offsets the binding exports for fault injection, listed once. X(field, how):
 * how to read it, FIXED (the fixed geometry: this mapping's checked copy),
 * MODEL (model geometry: the checked copy once the mapping holds the model,
 * else what the header says), PLAIN (fixed before a store-release of state),
 * ATOMIC, PID (an atomic pid, shown unsigned), PLAIN_PID, REAL (a double), CFG and CFG_REAL (a
 * field of the configuration, struct psd_config `cfg`).
 * Slots: X(key, field, how), also SIGNED and BITS (a double's bits). */
#define PSD_HEADER_FIELDS(X)                                                                                     \
    X(layout_version, PLAIN) X(fingerprint, PLAIN) X(n_slots, FIXED) X(ring_k, FIXED) X(spec_cap, FIXED)        \
    X(ranks_off, FIXED) X(slotrec_off, FIXED) X(spec_off, FIXED) X(created_unix_ns, PLAIN) X(total_size, MODEL) X(n_params, MODEL)     \
    X(n_train, MODEL) X(n_buffers, MODEL) X(n_pieces, MODEL) X(buffers_off, MODEL) X(pieces_off, MODEL)          \
    X(rowlog_off, MODEL) X(rowlog_head, ATOMIC) X(weights_epoch, ATOMIC)                                          \
    X(weights_off, MODEL) X(weights_bytes, MODEL) X(optstate_off, MODEL) X(optstate_bytes, MODEL)                \
    X(slots_off, MODEL) X(slot_stride, MODEL) X(entry_stride, MODEL) X(spec_len, PLAIN) X(spec_hash, PLAIN)      \
    X(offer_pid, PLAIN_PID) X(offer_start_time, PLAIN) X(offer_pid_ns, PLAIN) X(optimizer, CFG)                  \
    X(sync_mode, CFG) X(threads, CFG) X(spin_us, CFG) X(sync_param, CFG) X(push_every, CFG) X(schedule, CFG)     \
    X(cfg_flags, CFG) X(step_size, CFG) X(t_max, CFG) X(warmup, CFG) X(max_staleness, CFG)                       \
    X(async_momentum, CFG) X(lease_ms, CFG) X(lr, CFG_REAL) X(momentum, CFG_REAL) X(dampening, CFG_REAL)         \
    X(beta1, CFG_REAL) X(beta2, CFG_REAL) X(eps, CFG_REAL) X(weight_decay, CFG_REAL) X(lr_decay, CFG_REAL)       \
    X(gamma, CFG_REAL) X(eta_min, CFG_REAL) X(nodes, CFG) X(node_lag, CFG_REAL)                                  \
    X(opt_steps, ATOMIC) X(rounds, ATOMIC) X(acc_count, ATOMIC) X(acc_members, ATOMIC)                           \
    X(acc_staleness, ATOMIC) X(round_applying, ATOMIC) X(round_applied, ATOMIC) X(round_slot, ATOMIC)         \
    X(round_head, ATOMIC) X(state, ATOMIC) X(server_pid, PID) X(server_start_time, PLAIN)                     \
    X(generation, ATOMIC) X(server_started_unix_ns, PLAIN) X(server_pid_ns, PLAIN) X(heartbeat_ns, ATOMIC)      \
    X(clock, ATOMIC) X(applied, ATOMIC) X(rejected, ATOMIC) X(retired_pushed, ATOMIC) X(staleness_sum, ATOMIC)  \
    X(staleness_max, ATOMIC) X(dropped, ATOMIC) X(reclaimed, ATOMIC) X(ignored, ATOMIC)                         \
    X(lock_recoveries, ATOMIC) X(evicted, ATOMIC) X(evicted_pid, PID) X(evicted_rank, SIGNED)                   \
    X(evicted_rule, ATOMIC) X(sleeping, ATOMIC) X(pause_req, ATOMIC) X(paused, ATOMIC) X(hold_clock, ATOMIC)     \
    X(holder_pid, PID) X(held, ATOMIC) X(watchdog_pid, PID)                                                      \
    X(watchdog_start_time, ATOMIC) X(checkpoint_clock, ATOMIC) X(checkpoint_unix_ns, ATOMIC)                     \
    X(server_restarts, ATOMIC) X(lineage, ATOMIC) X(origin_unix_ns, ATOMIC) X(origin_clock, ATOMIC)
/* Slots: X(key, field, how) for the server's record (struct psd_slot), LX(key, field, how) for what
 * the learner writes (struct psd_lslot). */
#define PSD_SLOT_FIELDS(X)                                                                                       \
    X(state, state, ATOMIC) X(pid, pid, PID) X(start_time, start_time, ATOMIC) X(claims, claims, ATOMIC)         \
    X(rank, rank, SIGNED) X(refused, refused, ATOMIC) X(answered, answered, ATOMIC) X(head, head, ATOMIC)        \
    X(applied, applied, ATOMIC) X(rejected, rejected, ATOMIC) X(staleness_sum, staleness_sum, ATOMIC)           \
    X(staleness_max, staleness_max, ATOMIC) X(dropped, dropped, ATOMIC) X(ssp_base, ssp_base, ATOMIC)           \
    X(round_joined, round_joined, ATOMIC) X(last_loss, last_loss_bits, BITS) X(pid_ns, pid_ns, ATOMIC)          \
    X(ignored, ignored, ATOMIC) X(reap_reason, reap_reason, ATOMIC) X(liveness, liveness, ATOMIC)               \
    X(evicted_pid, evicted_pid, PID) X(evicted_rule, evicted_rule, ATOMIC)                                      \
    X(evicted_start_time, evicted_start_time, ATOMIC) X(evicted_entries, evicted_entries, ATOMIC)              \
    X(evicted_pid_ns, evicted_pid_ns, ATOMIC)                                                                   \
    X(evicted_unix_ns, evicted_unix_ns, ATOMIC)
#define PSD_LSLOT_FIELDS(X)                                                                                      \
    X(tail, tail, ATOMIC) X(learner_clock, learner_clock, ATOMIC) X(pulls, pulls, ATOMIC)                        \
    X(pulls_skipped, pulls_skipped, ATOMIC) X(full_waits, full_waits, ATOMIC) X(lease_beat, lease_beat, ATOMIC) \
    X(sharpness, sharpness_bits, BITS)                                                                           \
    X(waiters, waiters, ATOMIC) X(req_nonce, req_nonce, ATOMIC) X(req_pid, req_pid, SIGNED)                      \
    X(req_rank, req_rank, SIGNED) X(req_start_time, req_start_time, ATOMIC) X(req_pid_ns, req_pid_ns, ATOMIC)   \
    X(req_check, req_check, ATOMIC) X(release, release, ATOMIC)
/* The fields of a ring entry's header (struct psd_entry), for the offsets the binding exports. */
#define PSD_ENTRY_FIELDS(X)                                                                                            \
    X(seq) X(clock) X(batch_size) X(flags) X(loss) X(claim) X(applied_clock) X(outcome) X(buf_lo) X(buf_hi)

/* sync.c: clocks and process identity */
uint64_t psd_now_ns(void);              /* CLOCK_MONOTONIC */
uint64_t psd_proc_start_time(pid_t pid); /* 0 if no such process */
bool psd_proc_stat(pid_t pid, uint64_t *start_time, bool *zombie); /* false: /proc cannot show it */
bool psd_owner_alive(pid_t pid, uint64_t start_time);

/* One step of a bounded spin: the CPU's hint that this is a busy-wait loop. */
static inline void psd_cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* lease.c: liveness with or without /proc */
enum psd_live {
    PSD_LIVE_UNKNOWN = 0, /* /proc cannot tell: another PID namespace, hidepid, no /proc, --liveness lease */
    PSD_LIVE_YES = 1,
    PSD_LIVE_NO = 2,
};
/* Inode of this process's PID namespace (/proc/self/ns/pid), 0 if it cannot be read. */
uint64_t psd_pid_ns(void);
/* Whether /proc may be asked at all: not under --liveness lease (PSD_CFG_LEASE_ONLY in h, or
 * the environment variable PSD_LIVENESS=lease of this process). */
bool psd_proc_usable(const struct psd_header *h);
/* Is pid (of PID namespace pid_ns, started at start_time) alive, as far as /proc can tell? */
enum psd_live psd_liveness(const struct psd_header *h, pid_t pid, uint64_t start_time, uint64_t pid_ns);
static inline enum psd_live psd_slot_liveness(const struct psd_header *h, struct psd_slot *s) {
    return psd_liveness(h, PSD_LOAD_RLX(&s->pid), PSD_LOAD_RLX(&s->start_time), PSD_LOAD_RLX(&s->pid_ns));
}
/* A peer learner that may hold others back: alive unless /proc says it is gone (the reaper
 * decides by the lease when /proc cannot tell; the update loop then moves the slot out of ACTIVE). */
static inline bool psd_slot_owner_alive(const struct psd_header *h, struct psd_slot *s) {
    return psd_slot_liveness(h, s) != PSD_LIVE_NO;
}
/* The lease length of an arena, in ns. */
uint64_t psd_lease_ns(const struct psd_header *h);
/* Learner: start renewing the lease of every slot m holds (a native thread, never the GIL);
 * psd_arena_close stops it. Idempotent. */
int psd_lease_start(struct psd_map *m);
void psd_lease_stop(struct psd_map *m);

/* A heartbeat that long work stores as it goes, so that one long update does not look like a hung
 * server: at most every PSD_BEAT_NS, by the one thread that owns `last` (the update loop's, or
 * the master of its OpenMP team). A NULL beat (psd bench) does nothing. */
#define PSD_BEAT_NS (2ull * 1000 * 1000)
struct psd_beat {
    _Atomic uint64_t *at; /* the header's heartbeat_ns */
    uint64_t last;
};
static inline void psd_beat_at(struct psd_beat *b, uint64_t now) {
    if (now - b->last >= PSD_BEAT_NS) {
        PSD_STORE_RLX(b->at, now); /* read by psd_server_alive: a hint, nothing is published with it */
        b->last = now;
    }
}
static inline void psd_beat(struct psd_beat *b) {
    if (b)
        psd_beat_at(b, psd_now_ns());
}
/* The update loop's optimizer kernels (optim.c) are built three times, for x86-64-v4 (AVX-512), x86-64-v3
 * (AVX2 with FMA) and the x86-64 baseline, and the loader picks the one the CPU runs (GCC's target_clones,
 * an ifunc): no -march=native in the build, full vector width where the machine has it. Other compilers
 * and CPUs: one build. The build is ISO C11 (-std=c11: no floating-point contraction), so every clone
 * rounds exactly alike; the one fused multiply-add is written out (fmaf: weight decay, as torch's
 * grad.add(param, alpha=wd) rounds it), an instruction in the v3 and v4 clones and libm's exact fmaf in the
 * baseline one. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__) && \
    !defined(__SANITIZE_THREAD__) && !defined(__SANITIZE_ADDRESS__)
/* (Not under the sanitizers: an ifunc resolver runs while the program is relocated, before their
 * runtime is up, and its instrumented code crashes. The stress test builds the one baseline version.) */
#define PSD_KERNEL __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define PSD_KERNEL
#endif

#ifdef _OPENMP
#include <omp.h>
#define PSD_OMP_MASTER() (omp_get_thread_num() == 0)
#else
#define PSD_OMP_MASTER() 1
#endif

/* sync.c: robust mutexes and futex condition variables */
int psd_mutex_init(pthread_mutex_t *m);
/* Lock, taking over from a dead owner: returns 0, or PSD_EOWNERDEAD when the
 * lock is held and was made consistent (counted in h->lock_recoveries), or
 * PSD_ETIMEOUT / an errno when it is not held. */
int psd_mutex_lock(struct psd_header *h, pthread_mutex_t *m);
static inline bool psd_locked(int rc) { return rc == 0 || rc == PSD_EOWNERDEAD; }
void psd_mutex_unlock(pthread_mutex_t *m);
void psd_cond_init(struct psd_cond *c);
/* Sleep until signalled or `timeout_ns` passes, if `c->seq` still equals
 * `seen` (read before checking the predicate). Returns 0 or ETIMEDOUT/EINTR. */
int psd_cond_wait(struct psd_cond *c, uint32_t seen, uint64_t timeout_ns);
uint32_t psd_cond_prepare(struct psd_cond *c); /* announce a waiter, return seq */
void psd_cond_done(struct psd_cond *c);        /* withdraw the announcement */
void psd_cond_broadcast(struct psd_cond *c);
void psd_cond_broadcast_if_waiters(struct psd_cond *c);

/* arena.c */
/* What a model needs of an arena (from its spec). */
struct psd_model {
    uint64_t n_params;  /* float32 weights, trainable and frozen */
    uint64_t n_train;   /* the trainable prefix, 1..n_params */
    uint64_t n_buffers; /* float64 buffer elements */
    uint64_t n_pieces;  /* trainable tensors, 1..n_train */
};
size_t psd_header_span(uint32_t n_slots, uint64_t spec_cap);
/* Overflow-checked: EINVAL for a geometry out of range or too large to address. model NULL: an
 * arena not grown yet (header, ranks and spec). */
int psd_geometry(uint32_t n_slots, uint32_t ring_k, uint64_t spec_cap, const struct psd_model *model,
                 uint32_t state_vectors, struct psd_geom *g);
/* Take the geometry the header describes into m->g, checked: recomputed from the header's shape
 * fields, equal to the offsets the header stores, within the mapping. The model's part only once
 * the arena is grown (state INIT_WEIGHTS or later) and mapped whole. PSD_EGEOMETRY otherwise. */
int psd_arena_adopt(struct psd_map *m);
int psd_arena_create(struct psd_map *m, const char *shm_name, mode_t mode, uint32_t n_slots,
                     uint32_t ring_k, uint64_t spec_cap, const char *version);
/* Map with the protections of `role` (enum psd_role). */
int psd_arena_open_as(struct psd_map *m, const char *shm_name, uint32_t role);
/* Learner: open (writable) or close (read-only) the offer window: the header's server page and
 * the spec, and, once the arena was grown, the weights and the buffers. No-op for other roles. */
int psd_arena_offer_window(struct psd_map *m, bool open);
/* Re-apply m's protections (after a claim, a release, a remap). */
int psd_arena_protect(struct psd_map *m);
/* Map the file at its size now; adopt the header's geometry unless the mapping holds its model
 * already and the size did not change. */
int psd_arena_remap(struct psd_map *m);
void psd_arena_close(struct psd_map *m);
int psd_arena_set_spec(struct psd_map *m, const void *spec, uint64_t len, uint64_t hash,
                       const struct psd_model *model, pid_t pid, uint64_t start_time);
int psd_arena_grow(struct psd_map *m);
void psd_arena_set_state(struct psd_map *m, uint32_t state);
int psd_arena_wait_state(struct psd_map *m, uint32_t not_state, uint64_t timeout_ns);

/* ring.c: the learner side, and slot bookkeeping */
/* Ask the server for a free slot for pid: post a claim request in a FREE slot's learner page
 * (mapped writable in m for that), wait up to timeout_ns for the update loop's answer; on
 * admission record the claim token that m's pushes carry and start m's lease thread.
 * PSD_ENOSLOT: no free slot; PSD_EEVICTED: refused, this process was evicted; PSD_ETIMEOUT: no
 * answer (the request is withdrawn; a slot admitted as it was withdrawn is given back). A request
 * something else wrote over, or a line taken from a claimer stalled mid-write, is asked again. */
int psd_slot_claim(struct psd_map *m, pid_t pid, uint64_t start_time, int32_t rank, uint64_t timeout_ns,
                   uint32_t *slot, uint64_t *claim);
/* Server, or a tool with the whole arena mapped (PSD_ROLE_FULL): take a free slot for pid at once,
 * as the update loop would admit its request (benchmarks, tests without a running loop). */
int psd_slot_assign(struct psd_map *m, pid_t pid, uint64_t start_time, int32_t rank, uint32_t *slot,
                    uint64_t *claim);
/* Give the slot back: the owner writes its token into its page's `release` and rings the loop. */
int psd_slot_release(struct psd_map *m, uint32_t slot, uint64_t claim);
/* Server (update loop): answer every new claim request of a FREE slot, and take every release an
 * owner asked for and every claim the reaper judged gone. Returns how many slots changed hands. */
uint32_t psd_admit(struct psd_map *m);
/* Whether the slot's ring has a free entry (pairs with the store-release of head in the update loop). */
bool psd_ring_has_space(const struct psd_map *m, uint32_t slot);
/* Whether the server has applied (or dropped) every entry this slot's learner pushed. */
bool psd_ring_drained(const struct psd_map *m, uint32_t slot);
/* Publish the entry at the tail, whose gradient was written in place (every
 * piece dense). The gradient is first multiplied by `scale` (unless 1) and
 * checked: a NaN or infinity marks it PSD_ENTRY_NONFINITE, and the update
 * loop rejects it. `bufdelta` (n_buffers doubles, or NULL) is copied along. */
int psd_push(struct psd_map *m, uint32_t slot, uint64_t clock, uint32_t batch, double loss, float scale,
             const double *bufdelta);
/* psd_push for a learner that wrote some tensors' gradients in place (a partial attach on a GPU):
 * `present` (n_pieces bytes; NULL: every tensor) says which, `lens` (n_pieces, adding up to
 * n_train, else EINVAL) how long each tensor's span is. The others are marked PSD_PIECE_ABSENT and
 * neither read nor checked. */
int psd_push_present(struct psd_map *m, uint32_t slot, uint64_t clock, uint32_t batch, double loss, float scale,
                     const uint8_t *present, const uint64_t *lens, const double *bufdelta);
/* One trainable tensor's gradient, for psd_push_from. */
struct psd_src {
    const void *data;    /* dense: len elements; sparse: nnz rows of row_len; NULL: no gradient */
    const int64_t *rows; /* sparse: nnz row indices (NULL: dense) */
    uint64_t len;        /* the tensor's elements */
    uint64_t nnz;        /* sparse: rows given */
    uint64_t row_len;    /* sparse: elements per row (divides len) */
};
/* Copy a gradient given tensor by tensor (`count` == n_pieces, in spec
 * order, elements of `dtype`) into the entry at the tail as `store`
 * (float32, or bfloat16 for the dense tensors: PSD_PIECE_DENSE_BF16), times
 * `scale`, checking it in the same pass, and publish it. A sparse tensor is
 * stored as rows when they take less room than the dense tensor, else
 * scattered densely (float32 either way). The lengths must be the job's
 * (EINVAL). Dense float32 gradients of PSD_STREAM_BYTES or more stored as
 * float32 are written with non-temporal stores. */
int psd_push_from(struct psd_map *m, uint32_t slot, uint64_t clock, uint32_t batch, double loss, float scale,
                  const struct psd_src *src, uint32_t count, uint32_t dtype, uint32_t store, const double *bufdelta);
#define PSD_STREAM_BYTES (UINT64_C(1) << 20)
/* bsp: wait until more than `rounds` rounds are complete. */
int psd_wait_round(struct psd_map *m, uint32_t slot, uint64_t claim, uint64_t rounds, uint64_t timeout_ns);
/* ssp: wait until this learner (after a push) is at most sync_param pushes
 * ahead of the slowest live learner, so it may compute its next gradient. */
int psd_wait_ssp(struct psd_map *m, uint32_t slot, uint64_t claim, uint64_t timeout_ns);
/* ssp: this learner's clock (pushes + base) and the slowest other live
 * learner's (UINT64_MAX: none). Unless strict, a dead learner may be counted
 * where it does not hold this one back. */
void psd_ssp_clocks(struct psd_map *m, uint32_t slot, bool strict, uint64_t *mine, uint64_t *slowest);
int psd_wait_space(struct psd_map *m, uint32_t slot, uint64_t claim, uint64_t timeout_ns);
/* Wait until the server took the slot's ring entries up to `head` (its head reached it): a learner whose
 * copies into the ring are still in flight (a GPU's) waits for the entry it will write next alone, not
 * for every copy to land. */
int psd_wait_head(struct psd_map *m, uint32_t slot, uint64_t claim, uint64_t head, uint64_t timeout_ns);
int psd_wait_drained(struct psd_map *m, uint32_t slot, uint64_t claim, uint64_t timeout_ns);
int psd_wait_freed(struct psd_map *m, uint32_t slot, uint64_t claim, uint64_t timeout_ns);
/* Server: judge ACTIVE slots' owners, and post each claim whose owner is dead (/proc), whose lease
 * ran out (where /proc cannot tell), or who never beat for it (psd_slot.reap_claim: the update loop
 * moves the slot to DRAINING); their pids in pids[0..*n). EVICTED slots whose process is gone
 * become FREE. */
int psd_reap(struct psd_map *m, int32_t *pids, uint32_t max, uint32_t *n);
bool psd_server_alive(struct psd_map *m, uint64_t stale_ns);

static inline struct psd_rank *psd_rank_at(const struct psd_map *m, uint32_t r) {
    return (struct psd_rank *)(m->base + m->g.ranks_off) + r;
}

/* pause.c: consistent snapshots */
int psd_pause(struct psd_map *m, pid_t pid, uint64_t start_time, uint64_t timeout_ns);
void psd_resume(struct psd_map *m);
/* pause.c: holding the loop at a clock (the node link's exchange points) */
void psd_hold(struct psd_map *m, pid_t pid, uint64_t start_time, int64_t clock);
bool psd_loop_should_hold(struct psd_map *m);
void psd_loop_hold(struct psd_map *m, _Atomic int *stop);
bool psd_loop_should_pause(struct psd_map *m);
void psd_loop_pause(struct psd_map *m, _Atomic int *stop);

/* pull.c: a learner's pull thread */
struct psd_puller;
struct psd_piece_geom;
int psd_puller_start(struct psd_map *m, uint32_t slot, float *front, float *back, uint64_t n, uint64_t clock,
                     struct psd_puller **out);
void psd_puller_request(struct psd_puller *P);
int psd_puller_take(struct psd_puller *P, uint64_t *clock);
/* A learner's pull of what changed (pull.c): copy into dst (its copy of the trainable weights, as of
 * clock `known`, rows-log position *pos and weights epoch *epoch) only the tensors and rows the
 * updates since changed, as the rows log names them (`pieces`: the job's trainable tensors, tiling
 * n_train; `whole`: n_pieces bytes of scratch), or everything when the log cannot tell (lapped, a
 * new epoch, an update of every tensor). Returns the clock the copy holds at least; advances *pos
 * and *epoch; *bytes: the bytes copied. */
uint64_t psd_pull_changed(struct psd_map *m, uint32_t slot, float *dst, uint64_t known, uint64_t *pos,
                          uint64_t *epoch, const struct psd_piece_geom *pieces, uint64_t n_pieces, uint8_t *whole,
                          uint64_t *bytes);
/* Where the rows log and the weights epoch stand: read both before copying all the weights, so
 * that a later psd_pull_changed takes everything changed from then on. */
void psd_rowlog_mark(const struct psd_map *m, uint64_t *pos, uint64_t *epoch);
void psd_puller_set_front_clock(struct psd_puller *P, uint64_t clock);
/* The weights as of the clock now, for slot's learner: the trainable ones copied into dst (n_train
 * float32) unless the learner already holds that clock (`known`), or with dst NULL (pull="view": the
 * learner computes on the shared weights) only recorded as the slot's learner clock. The frozen weights
 * are not copied: nothing moves them once the job is READY (the update loop and the node link write the
 * trainable prefix alone), and the learner filled them in when it mapped the job. Returns the clock. */
uint64_t psd_take_weights(struct psd_map *m, uint32_t slot, void *dst, uint64_t known);
/* Record a pull of the weights as of `clock` in the slot's figures (skipped: the learner held them). */
void psd_note_pull(struct psd_map *m, uint32_t slot, uint64_t clock, bool skipped);
void psd_note_sharpness(struct psd_map *m, uint32_t slot, double sharpness);
void psd_puller_stop(struct psd_puller *P);

/* update.c: the server's update loop */
struct psd_loop;
/* A trainable tensor as the update loop sees it: `len` elements from `off`
 * in the trainable prefix, rows of `row_len` (sparse gradients). The server
 * derives these from the spec and hands the loop its own copy. */
struct psd_piece_geom {
    uint64_t off, len, row_len;
};
/* `pieces` (n_pieces of them, adding up to n_train; NULL: one tensor of n_train). The first
 * `buffers_set` buffer elements of an entry are values that replace the job's (real-valued
 * statistics); the rest are deltas added to them (counters). */
int psd_loop_start(struct psd_map *m, uint32_t threads, uint32_t spin_us, const struct psd_piece_geom *pieces,
                   uint64_t n_pieces, uint64_t buffers_set, struct psd_loop **out);
int psd_loop_stop(struct psd_loop *loop);
#define PSD_CHUNK (UINT64_C(1) << 14) /* floats per OpenMP work item of the update kernels (optim.c) */
/* The update kernels read a gradient in a learner's ring one value at a time, each loaded once into
 * a register, checked and used (psd_take1, kernels.h): a NaN or an infinity moves nothing and is
 * counted into *nonfinite (unless NULL), which the update loop reads after the call (rule VALUES). */
/* optim.c: w -= lr * g, g n float32 or bfloat16 (gdtype, enum psd_dtype), on `threads` threads. */
void psd_apply_sgd(float *restrict w, const void *restrict g, uint32_t gdtype, uint64_t n, float lr, int threads,
                   struct psd_beat *beat, _Atomic uint64_t *nonfinite);
/* bench_kernels.c: one thread, one way of writing the loop (psd bench's unrolling measure). */
enum psd_kernel { PSD_KERNEL_SCALAR, PSD_KERNEL_VECTOR, PSD_KERNEL_UNROLL4, PSD_KERNEL_UNROLL8 };
int psd_apply_sgd_kernel(float *restrict w, const float *restrict g, uint64_t n, float lr, int kernel);

/* optim.c: optimizers, schedules, weight prediction */
double psd_scheduled_lr(const struct psd_config *c, uint64_t t);
/* The explicit momentum of the next update under --async-momentum, tau the running mean staleness
 * (see optim.c). */
double psd_gain_level(const struct psd_header *h);
/* The share, 0 to 1, of the damping of staler-than-mean gradients (psd_async_lr_factor) the update loop
 * applies (damping_bits: 1 outside [0, 1]). */
double psd_damping(const struct psd_header *h);
void psd_async_rule(const struct psd_config *c, double tau, double level, double *mu, double *lr_factor);
double psd_node_staleness(const struct psd_config *c, double tau);
double psd_async_momentum(const struct psd_config *c, double tau, double level);
/* The lr factor of one gradient of the given staleness under --async-momentum (see optim.c). */
double psd_async_lr_factor(const struct psd_config *c, double tau, double staleness);
/* Adagrad's young updates under --async-momentum auto: the lr factor of update `update` (0 the job's
 * first) whose gradient has the given staleness (see optim.c). */
#define PSD_ADAGRAD_YOUNG 16
double psd_adagrad_start_factor(const struct psd_config *c, uint64_t update, double staleness);
/* The running mean of staleness the update loop stored in the header (0 if it holds no valid one). */
double psd_staleness_avg(const struct psd_header *h);
/* The staleness held since the job last lost a learner (0 if none, or no valid one), and the one the
 * momentum rule reads: the larger of the two. */
double psd_staleness_held(const struct psd_header *h);
double psd_rule_staleness(const struct psd_header *h);
/* One update of the configured optimizer with gradient g * gscale (n float32, or bfloat16 when
 * gdtype is PSD_DTYPE_BF16: widened a chunk at a time) and momentum `momentum` (momentum / nesterov:
 * psd_async_momentum's); t is the 1-based step (Adam's bias correction, the momentum buffer's first
 * step), but for a kasync round of Adam whose moments took its gradients (PSD_CFG_LOOP_SQUARES_TAKEN) the
 * number of them the tensors took, the steps of AdamW's decay. Beats `beat` every PSD_CHUNK floats (of the master thread's share) at most. */
void psd_optimizer_step(const struct psd_config *c, double momentum, float *w, const void *g, uint32_t gdtype,
                        float gscale, float *s0, float *s1, uint64_t n, double lr, uint64_t t, int threads,
                        struct psd_beat *beat, _Atomic uint64_t *nonfinite);
/* Whether the configured optimizer takes sparse gradients (as torch.optim: sgd, with or without
 * momentum, and adagrad, without weight decay). */
bool psd_sparse_ok(const struct psd_config *c);
/* Check a sparse piece stored in `span` (cap float32 of room) of a tensor of
 * rows x row_len; returns its row count, or -1 if it is malformed. */
int64_t psd_sparse_rows(const void *span, uint64_t cap, uint64_t rows, uint64_t row_len);
/* One update of the rows given in a sparse piece (tensor `piece`) of len elements (checked; a count
 * or row that no longer fits is skipped), each row it moves logged in `log` (the piece whole when
 * the rows would fill a quarter of the log). */
void psd_sparse_step(struct psd_rowlog_writer *log, uint64_t piece, const struct psd_config *c, float *w,
                     const void *span, uint64_t len, uint64_t row_len, float gscale, float *s0, double lr,
                     uint64_t t, _Atomic uint64_t *nonfinite);
/* acc (a tensor of len elements, rows of row_len) += the sparse piece's rows; where `squares` is not NULL
 * (kasync with Adagrad: psd_adagrad_take), squares += each value squared, row by row. */
void psd_sparse_add(float *acc, const void *span, uint64_t len, uint64_t row_len, float *squares,
                    _Atomic uint64_t *nonfinite);
/* kasync with Adagrad: one gradient of a round taken into the round's sum and its square into Adagrad's
 * state, `n` float32 (or bfloat16, gdtype) values each read once, with the weight decay a step of one
 * process adds (the weights w do not move within a round): d = g + weight_decay * w; acc = d (first) or
 * acc + d; sum += d^2. One process takes K steps, each adding its own gradient's square; the round's
 * update (with PSD_CFG_LOOP_SQUARES_TAKEN) then adds no square and no decay, so a step stays within
 * sqrt(K) x the lr (the square of the sum counted K correlated gradients up to K times over). Runs on
 * `threads` as psd_optimizer_step does, beating `beat`; a non-finite value is taken as 0 and counted in
 * *nonfinite. */
void psd_adagrad_take(float *acc, float *sum, const void *g, uint32_t gdtype, const float *w, double weight_decay,
                      uint64_t n, int first, int threads, struct psd_beat *beat, _Atomic uint64_t *nonfinite);
/* The gradients one update takes: kasync's K (more than 1), else 1. */
static inline uint64_t psd_kasync_k(const struct psd_config *c) {
    return c->sync_mode == PSD_SYNC_KASYNC && c->sync_param > 1 ? c->sync_param : 1;
}
/* kasync with Adam or AdamW: one gradient of a round taken as the step of one process it is: the moments m
 * and v take it (with Adam's L2 weight decay, d = g + weight_decay * w; the weights do not move within a
 * round), and acc = (first) or += its step direction m_hat / (sqrt(v_hat) + eps) at bias-correction step
 * `t` (the tensor's own step: one more than the gradients it took, struct psd_piece's taken); AdamW's sum
 * weighs each earlier direction by the decay (1 - lr weight_decay, `lr` the round's) of each step since. The
 * round's update (with PSD_CFG_LOOP_SQUARES_TAKEN) then moves the weights by lr times that sum (after AdamW's
 * decoupled decay once for each gradient the tensor took, round_taken), touching no moment: the K steps one process makes, on gradients the round's weights gave. Adam
 * of the sum of K gradients instead normalises it to one step's size (m and v of the sum are K and K^2
 * times a gradient's), K times fewer weight moves. Runs as psd_adagrad_take does. */
void psd_adam_take(float *acc, float *m, float *v, const void *g, uint32_t gdtype, const float *w,
                   const struct psd_config *c, double lr, uint64_t t, uint64_t n, int first, int threads,
                   struct psd_beat *beat, _Atomic uint64_t *nonfinite);
/* A flag of the update loop's own copy of the configuration, never stored in an arena (psd_layout.h's
 * PSD_CFG_* are): the update being applied finds the state already holding its gradients (kasync: Adagrad's
 * squares, psd_adagrad_take; Adam's moments and step directions, psd_adam_take). */
#define PSD_CFG_LOOP_SQUARES_TAKEN (1u << 31)
/* dst (weights) -= lr * staleness * the optimizer's update direction. */
int psd_predict(const struct psd_map *m, float *dst, uint64_t n, uint64_t lo, uint64_t hi, double staleness);

#endif
