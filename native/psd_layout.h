/*
 * psd_layout.h -- the one definition of psd's shared-memory arena.
 *
 * Every process that maps an arena (server, learners, `psd status`) sees these
 * structs at the same offsets. Nothing else in psd defines shared layout; the
 * Python side reads it through the extension module built from this header
 * (offsets, constants, header() and slot_info()), except two regions it views
 * as tensors at offsets the header gives: the piece table as int64 pairs
 * (psd/state.py pieces_view) and the optimizer state vectors (watchdog/
 * checkpoint.py _state_views). Offsets, never pointers, are stored in shared memory.
 *
 * Arena (one POSIX shared-memory object per job, /dev/shm/psd.<job>):
 *
 *   [0, PSD_PAGE)                    struct psd_header, the server's page: identity,
 *                                     geometry, configuration, progress, counters
 *   [PSD_PAGE, PSD_HEADER_SIZE)      struct psd_header, the shared page: the words any
 *                                     attached process writes (admission mutex, condition
 *                                     words, lock recoveries); a learner maps only this
 *                                     page of the header writable
 *   [ranks_off, +n_slots lines)      struct psd_rank per learner rank (progress)
 *   [slotrec_off, +n_slots records)  struct psd_slot: the server's record of each learner
 *                                     slot (state, owner, claim token, head, counters,
 *                                     eviction record); only the server process writes it
 *   [spec_off, +spec_cap)            parameter spec, JSON text (names, shapes, dtypes)
 *   [weights_off, +weights_bytes)    float32 weights, PSD_PAGE aligned: the n_train
 *                                     trainable elements first (n_pieces tensors, the
 *                                     ones gradients cover), then the frozen ones
 *   [optstate_off, +optstate_bytes)  optimizer state: psd_state_vectors() vectors of
 *                                     n_train floats, each PSD_PAGE aligned (momentum
 *                                     buffer; Adam's m, v; Adagrad's sum; then the
 *                                     gradient accumulator of bsp / kasync)
 *   [buffers_off, +n_buffers*8)      the model's buffers (BatchNorm statistics, counters),
 *                                     float64, merged from the learners' deltas
 *   [pieces_off, +32*n_pieces)       struct psd_piece: per trainable tensor, its own
 *                                     optimizer step count, bsp/kasync round mark and
 *                                     (kasync with Adam) the gradients it took
 *   [rowlog_off, +24*rowlog cap)     struct psd_rowlog_entry: the rows log, what each update
 *                                     changed (a sparse tensor's rows, a dense tensor whole),
 *                                     so that a learner pulls only those (psd_rowlog_cap)
 *   [slots_off + i*slot_stride, ...) learner block i: struct psd_lslot (claim request,
 *                                     release, tail, the learner's figures), then its
 *                                     ring of ring_k entries, each a struct psd_entry
 *                                     followed by the payload (see psd_entry); only
 *                                     the learner holding slot i writes it
 *
 * Field comments say who writes a field, who reads it, and what always holds.
 * Each atomic operation in the .c files names the operation it pairs with.
 *
 * Protections (arena.c psd_arena_open_as): the server and the watchdog map the
 * whole arena read-write; `psd status` and other readers map it read-only; a
 * learner maps it read-only except the header's shared page, its own learner
 * block (with its ring), and, only while it offers a spec and writes the
 * initial weights, the header's server page, the spec, the weights and the
 * buffers. A stray write anywhere else faults in the learner's own process.
 * Nothing the server relies on lives in learner-writable memory: it never locks
 * or waits on anything there but the doorbell (bounded), and reads a learner's
 * block as a kernel reads a user-shared ring (copied once, checked, then used).
 */
#ifndef PSD_LAYOUT_H
#define PSD_LAYOUT_H

#include <pthread.h>
#include <stdalign.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#define PSD_CACHELINE 64
#define PSD_PAGE 4096
#define PSD_HEADER_SIZE (2 * PSD_PAGE) /* the server's page, then the shared page */
/* Reads "PSDARENA" in a little-endian dump; a byte-swapped value exposes a
 * foreign byte order instead of being taken for a corrupt arena. */
#define PSD_MAGIC UINT64_C(0x414E455241445350)
/* Bump on any change to the structs below. The identity line (the first
 * fields of psd_header up to and including psd_version) never moves, so any
 * version of psd can read which version made an arena. */
/* 17: struct psd_piece's taken and round_taken (kasync with Adam counts each tensor's own gradients);
 * 15: round_applying, round_applied, round_slot, round_head (a round a killed server was finishing is
 * finished by the next, neither lost nor applied again but for the update in flight);
 * 14: staleness_held_bits (the momentum rule's staleness held when learners leave); 13: cfg nodes and
 * node_lag (several nodes' staleness in the momentum rule); 12: damping_bits, --overlap auto waits for
 * momentum too; 11: auto waits but for momentum at 2+ slots;
 * 10: cfg_flags' overlap bits */
#define PSD_LAYOUT_VERSION 17
#define PSD_VERSION_LEN 24
#define PSD_MSG_LEN 256
#define PSD_MAX_SLOTS 4096
#define PSD_MAX_RING 1024
#define PSD_HIST_BUCKETS 16 /* staleness 0, 1, 2-3, 4-7, ..., >= 2^14 */

/* Arena life cycle, psd_header.state. Transitions:
 *   WAITING_SPEC  -> SPEC_OFFERED  a learner wrote its model's spec (admission mutex)
 *   SPEC_OFFERED  -> INIT_WEIGHTS  server grew the arena for that spec
 *   SPEC_OFFERED  -> WAITING_SPEC  server refused the spec (fail_msg says why)
 *   INIT_WEIGHTS  -> READY         the offering learner wrote the initial weights
 *   INIT_WEIGHTS  -> WAITING_SPEC  the offering learner died first; server resets
 *   SPEC_OFFERED  -> READY         the server wrote weights it loaded itself (--init, a checkpoint)
 *   STOPPED       -> READY / WAITING_SPEC  a new server took over a stopping server's arena
 *   READY         -> STOPPED       server stopped cleanly (and unlinks the arena)
 */
enum psd_arena_state {
    PSD_ARENA_WAITING_SPEC = 1,
    PSD_ARENA_SPEC_OFFERED = 2,
    PSD_ARENA_INIT_WEIGHTS = 3,
    PSD_ARENA_READY = 4,
    PSD_ARENA_STOPPED = 5,
};

/* Learner slot life cycle, psd_slot.state; the server process makes every transition:
 *   FREE            -> ACTIVE    the update loop admits a claim request (psd_admit)
 *   ACTIVE          -> DRAINING  the learner asked to release it, or the reaper found it dead
 *   DRAINING        -> FREE      the update loop applied everything fully pushed
 *   ACTIVE/DRAINING -> EVICTED   the update loop found a broken rule in the learner's memory
 *   EVICTED         -> FREE      the reaper, once the evicted process is gone
 * Only ACTIVE and DRAINING rings are consumed. */
enum psd_slot_state {
    PSD_SLOT_FREE = 0,
    PSD_SLOT_ACTIVE = 1,
    PSD_SLOT_DRAINING = 2,
    PSD_SLOT_EVICTED = 3, /* its learner broke a rule; freed once that process is gone */
};

/* psd_slot.refused: why the server refused a claim request. */
enum psd_refusal {
    PSD_REFUSE_NONE = 0,    /* admitted */
    PSD_REFUSE_GONE = 1,    /* the requesting process is not alive (/proc) */
    PSD_REFUSE_RANK = 2,    /* rank out of range */
    PSD_REFUSE_EVICTED = 3, /* this process was evicted from the job */
    PSD_REFUSE_GARBLED = 4, /* the request's check word does not match its fields: not a claimer's */
};

/* psd_lslot.req_nonce while a claimer writes its request (or the update loop answers it): the line is
 * taken. Never a request's nonce. */
#define PSD_NONCE_WRITING UINT64_MAX

/* The check word of a claim request (a 64-bit mix of its fields): a stray write into a request line
 * makes a request the server refuses, never one it admits. */
static inline uint64_t psd_request_check(uint64_t nonce, int32_t pid, int32_t rank, uint64_t start_time,
                                         uint64_t pid_ns) {
    uint64_t x = nonce ^ UINT64_C(0x9E3779B97F4A7C15);
    const uint64_t parts[] = {(uint64_t)(uint32_t)pid, (uint64_t)(uint32_t)rank, start_time, pid_ns};
    for (unsigned i = 0; i < 4; i++) {
        x ^= parts[i] + UINT64_C(0x9E3779B97F4A7C15) + (x << 6) + (x >> 2);
        x ^= x >> 30;
        x *= UINT64_C(0xBF58476D1CE4E5B9);
        x ^= x >> 27;
        x *= UINT64_C(0x94D049BB133111EB);
        x ^= x >> 31;
    }
    return x;
}

/* A condition variable that leaves no state behind when a waiter dies.
 * glibc's process-shared pthread_cond_t keeps per-waiter group references, and
 * a waiter killed inside pthread_cond_wait can hang every later broadcaster
 * (glibc >= 2.25; osrm-backend#3911, boost interprocess#53). This one is a
 * futex on `seq`: waiters sleep on the value they read, signallers bump it.
 * `waiters` only lets signallers skip the syscall; a dead waiter that left it
 * non-zero costs spurious wake-ups, never a hang. Always waited with a timeout. */
struct psd_cond {
    _Atomic uint32_t seq;     /* bumped by every signal (fetch_add, pairs with the waiter's load) */
    _Atomic uint32_t waiters; /* waiters announced; read by signallers to skip futex_wake */
};

/* The job's configuration (the server's flags), a line of the header: the update loop takes its own
 * copy at start (take_config) and checks it; the optimizers read only that copy. */
struct psd_config {
    double lr;                          /* base learning rate, before the schedule */
    uint32_t optimizer;                 /* enum psd_optimizer */
    uint32_t sync_mode;                 /* enum psd_sync */
    uint32_t threads;
    uint32_t spin_us;
    uint32_t sync_param;                /* S of ssp:S, K of kasync:K */
    uint32_t push_every;                /* W: mini-batches a learner sums into one push (>= 1) */
    uint32_t schedule;                  /* enum psd_schedule */
    uint32_t cfg_flags;                 /* PSD_CFG_* */
    double momentum, dampening, beta1, beta2, eps, weight_decay, lr_decay;
    double gamma, eta_min;              /* step: lr *= gamma every step_size; cosine: floor */
    uint64_t step_size, t_max, warmup;  /* in optimizer steps */
    uint64_t max_staleness;             /* drop gradients staler than this; UINT64_MAX: never */
    uint32_t async_momentum;            /* enum psd_async_momentum */
    uint32_t lease_ms;                  /* a learner whose liveness /proc cannot tell is dead once
                                         * its slot's lease_beat stood still this long (0: default) */
    uint32_t nodes;                     /* nodes exchanging often enough to train as one job (psd/gain.py
                                         * node_terms): --async-momentum auto's staleness counts theirs too;
                                         * 0 or 1: this node's alone (one node, or local SGD between rare
                                         * exchanges) */
    double node_lag;                    /* the updates an exchange's lag adds to that staleness, >= 0 */
};

/* Header. Each line written by a different party sits on its own cache line. */
struct psd_header {
    /* -- identity line: written once by the creating server, then `magic`
     *    is store-released last; readers load-acquire `magic` first. */
    alignas(PSD_CACHELINE) _Atomic uint64_t magic;
    uint32_t layout_version;
    uint32_t fingerprint; /* psd_fingerprint(): struct sizes, lock sizes, cache line */
    char psd_version[PSD_VERSION_LEN]; /* the psd release that created the arena, NUL-terminated */

    /* -- fixed geometry: written by the server at create, never changed */
    alignas(PSD_CACHELINE) uint32_t n_slots;
    uint32_t ring_k;        /* entries per ring, a power of two */
    uint64_t ranks_off;     /* n_slots struct psd_rank, one per learner rank */
    uint64_t slotrec_off;   /* n_slots struct psd_slot: the server's record of each slot */
    uint64_t spec_off;
    uint64_t spec_cap;
    uint64_t created_unix_ns;

    /* -- model geometry: written by the server when it grows the arena for a
     *    spec, before the store-release of state INIT_WEIGHTS/READY; readers
     *    load-acquire state first. */
    alignas(PSD_CACHELINE) uint64_t total_size;
    uint64_t n_params;      /* float32 weight elements, trainable and frozen */
    uint64_t weights_off, weights_bytes;
    uint64_t optstate_off, optstate_bytes;
    uint64_t slots_off, slot_stride, entry_stride;
    uint64_t buffers_off, pieces_off, rowlog_off;
    /* -- model shape, from the spec: written with it (under `admission`),
     *    fixed once state >= INIT_WEIGHTS. */
    uint64_t n_train;       /* trainable float32 elements: a prefix of the weights */
    uint64_t n_buffers;     /* float64 buffer elements */
    uint64_t n_pieces;      /* trainable tensors (entries of the piece map) */

    /* -- spec: written by the offering learner (or the server given initial
     *    weights) under `admission`; fixed once state >= INIT_WEIGHTS. */
    alignas(PSD_CACHELINE) uint64_t spec_len;
    uint64_t spec_hash;
    int32_t offer_pid;
    uint32_t pad0;
    uint64_t offer_start_time; /* /proc/<pid>/stat starttime of offer_pid */
    uint64_t offer_pid_ns;     /* inode of offer_pid's PID namespace (0: unknown) */

    /* -- configuration: written by the server before it starts the update
     *    loop (and before it grows the arena: optimizer and sync_mode size
     *    the optimizer state); read by anyone; the loop copies it as one unit. */
    alignas(PSD_CACHELINE) struct psd_config cfg;

    /* -- optimizer progress, written only by the update loop (or by a server
     *    restoring a checkpoint before READY); in checkpoints, except
     *    `acc_members`, `staleness_avg_bits`, `staleness_held_bits` (a resume starts them at 0), `round_slot`
     *    and `round_head` (the rings do not survive a resume). */
    alignas(PSD_CACHELINE) _Atomic uint64_t opt_steps; /* updates applied to the weights (Adam's t) */
    _Atomic uint64_t lr_bits;       /* double: scheduled lr of the last update (weight prediction reads it) */
    _Atomic uint64_t rounds;        /* bsp / kasync: rounds completed (signalled on sync_cond) */
    _Atomic uint64_t acc_count;     /* gradients summed into the accumulator this round */
    _Atomic uint64_t acc_members;   /* bsp: learners that contributed this round (incl. rejected) */
    _Atomic uint64_t acc_staleness; /* staleness summed over acc_count */
    _Atomic uint64_t staleness_avg_bits; /* double: running mean of the staleness of the last
                                          * ~PSD_STALENESS_WINDOW updates (--async-momentum reads it) */
    _Atomic uint64_t staleness_held_bits; /* double: the running mean when the job last lost a learner, decaying
                                           * over ~PSD_STALENESS_HOLD updates, 0 once one arrives; the
                                           * momentum rule reads the larger of the two (psd_rule_staleness) */
    /* bsp / kasync: where a round's finish stands, for a server that takes over after one died in it
     * (update.c recover_round). `round_applying`: rounds + 1 of the round being finished (stored before its
     * update writes a weight; 0 once the round is closed and the entry that finished it handed back);
     * `round_applied`: the same mark once its update is whole (before a hold, where a snapshot may be
     * taken); `round_slot`: 1 + the slot whose entry, at `round_head`, finished it (kasync; 0: none). The
     * first two are in checkpoints (a snapshot of a dead server's arena, or of one held in a round). */
    _Atomic uint64_t round_applying;
    _Atomic uint64_t round_applied;
    _Atomic uint64_t round_slot;
    _Atomic uint64_t round_head;

    /* -- --async-momentum auto's steering (psd/gain.py), written by the server:
     *    level 0 and all of the damping at the arena's creation and when a
     *    server starts, then by its supervision thread from the learners'
     *    measured sharpness (Server._steer_gain); read relaxed by the update
     *    loop at each update. Not in checkpoints. */
    alignas(PSD_CACHELINE) _Atomic uint64_t gain_level_bits; /* double in [0, 1]: how much of one process's
                                                             * momentum gain it keeps (0: the staleness
                                                             * rule alone); psd_gain_level */
    _Atomic uint64_t damping_bits; /* double in [0, 1]: how much of the damping of staler-than-mean
                                    * gradients (psd_async_lr_factor) it applies; psd_damping */

    /* -- life cycle: `state` is store-released by whoever makes a transition
     *    (see enum psd_arena_state), load-acquired by everyone. */
    alignas(PSD_CACHELINE) _Atomic uint32_t state;

    /* -- server identity: written by the server at start, before `generation`
     *    is bumped (release); a learner that sees a new generation re-reads it. */
    alignas(PSD_CACHELINE) _Atomic int32_t server_pid;
    uint32_t pad1;
    uint64_t server_start_time;
    _Atomic uint64_t generation;
    uint64_t server_started_unix_ns; /* wall clock, for uptime */
    uint64_t server_pid_ns; /* inode of the server's PID namespace (0: unknown): a learner in
                             * another one judges the server by its heartbeat, not its pid */

    /* -- heartbeat: CLOCK_MONOTONIC ns, stored by the update loop every
     *    PSD_BEAT_NS (2 ms) while it works, from inside a long update too (psd_beat),
     *    every 20 ms while paused, and after each doorbell sleep (at most 100 ms);
     *    read by learners and the watchdog. */
    alignas(PSD_CACHELINE) _Atomic uint64_t heartbeat_ns;

    /* -- weights clock: gradients applied to these weights so far. Written
     *    only by the update loop (store-release after each apply); learners
     *    load-acquire it before a pull to skip pulls of unchanged weights. */
    alignas(PSD_CACHELINE) _Atomic uint64_t clock;

    /* -- the rows log (struct psd_rowlog_entry): `rowlog_head` counts the entries ever appended,
     *    written only by the update loop, store-released after an update's weights and entries
     *    are written and before its `clock`; a learner load-acquires it after `clock`.
     *    `weights_epoch` is bumped (release) by whatever writes the weights outside a logged update
     *    (the node link's exchange, a server taking the arena over, a regrow): a learner whose
     *    last pull saw another epoch copies everything. */
    alignas(PSD_CACHELINE) _Atomic uint64_t rowlog_head;
    _Atomic uint64_t weights_epoch;

    /* -- global counters, written only by the update loop. Invariant once all
     *    rings are empty: pushed == applied + rejected + dropped, where pushed is
     *    retired_pushed + the tails of the slots in use. */
    alignas(PSD_CACHELINE) _Atomic uint64_t applied;
    _Atomic uint64_t rejected;
    _Atomic uint64_t retired_pushed; /* tails of slots that were freed */
    _Atomic uint64_t staleness_sum;
    _Atomic uint64_t staleness_max;
    _Atomic uint64_t dropped;        /* older than --max-staleness, not applied */
    _Atomic uint64_t reclaimed;      /* slots of dead learners freed */
    _Atomic uint64_t ignored;        /* entries whose claim token was not their slot's claim */
    _Atomic uint64_t evicted;        /* learners evicted for breaking a rule of their slot */
    _Atomic int32_t evicted_pid;     /* the last one's pid, rank and the rule (enum psd_rule), */
    _Atomic int32_t evicted_rank;    /* written before `evicted` is bumped (release) */
    _Atomic uint32_t evicted_rule;

    /* -- staleness histogram, written only by the update loop (relaxed):
     *    bucket 0 counts staleness 0, bucket i > 0 counts [2^(i-1), 2^i), the
     *    last bucket everything above. */
    alignas(PSD_CACHELINE) _Atomic uint64_t staleness_hist[PSD_HIST_BUCKETS];

    /* -- doorbell: the update loop sets `sleeping` before it sleeps on
     *    `doorbell` (in the shared page); a learner that published a tail and then sees `sleeping`
     *    signals it. Both sides use seq_cst (a Dekker pair). */
    alignas(PSD_CACHELINE) _Atomic uint32_t sleeping;

    /* -- pause: a consistent snapshot. The pauser (the watchdog; `psd checkpoint` and `psd run`'s
     *    shutdown when no watchdog lives) writes its
     *    pid and start time, then sets `pause_req` (seq_cst) and waits on
     *    `pause_cond` for `paused`; the update loop, between two gradients,
     *    sets `paused`, and waits on `pause_cond` until `pause_req` is cleared
     *    or the pauser is dead. Nothing else writes weights meanwhile. */
    alignas(PSD_CACHELINE) _Atomic uint32_t pause_req;
    _Atomic uint32_t paused;
    _Atomic int32_t pauser_pid;
    uint32_t pad2;
    _Atomic uint64_t pauser_start_time;
    struct psd_cond pause_cond;
    /* -- hold (same line: the same waiters): the node link (psd/nodelink.py) stops the loop at
     *    a clock. It writes `holder_pid` and `holder_start_time`, then stores `hold_clock`
     *    (seq_cst): the clock to hold at plus one (0: no hold). The update loop, right after
     *    an update that brings `clock` to that clock or past it (before bsp's `rounds` is
     *    bumped, so learners wait too), or before any update while `clock` is there already,
     *    sets `held` and waits on `pause_cond` until `hold_clock` is cleared or raised above
     *    the clock, or the holder is dead (then the loop clears it); it clears `held` and
     *    checks once more before it goes on. A holder that stores `hold_clock` and then sees
     *    `held` set knows that no update is applied until it releases the hold (a seq_cst
     *    Dekker pair). A pause request is honoured while held. */
    _Atomic uint64_t hold_clock;
    _Atomic int32_t holder_pid;
    _Atomic uint32_t held; /* written by the loop, read by the holder (Arena.header "held") */
    _Atomic uint64_t holder_start_time;

    /* -- supervision: written by the watchdog (`checkpoint_*` also by `psd checkpoint` when no
     *    watchdog lives; `server_restarts` by each server that takes over); read by `psd status`. */
    alignas(PSD_CACHELINE) _Atomic int32_t watchdog_pid;
    uint32_t pad3;
    _Atomic uint64_t watchdog_start_time;
    _Atomic uint64_t checkpoint_clock;   /* weights clock of the last checkpoint */
    _Atomic uint64_t checkpoint_unix_ns; /* when it was written; 0: none yet */
    _Atomic uint64_t server_restarts;    /* servers started on this arena after the first */
    /* The job's lineage: a random number a server draws whenever it loads the job's weights into a new arena
     * (from a checkpoint, --init's file or a learner's model; a server taking an arena over keeps it), carried by
     * every checkpoint written since; and the checkpoint it loaded (its creation time and clock, 0: none). The
     * watchdog restores a lost arena only from the newest checkpoint of the lineage, or, before one, from that
     * origin (Server.start, checkpoint.of_job): another run's in the same directory, a run forked from the same
     * checkpoint, or the checkpoints a job resumed from an older one rolled back from, are not the job's.
     * Written by the server before READY. */
    _Atomic uint64_t lineage;
    _Atomic uint64_t origin_unix_ns;
    _Atomic uint64_t origin_clock;

    /* -- why the server refused an offered spec or stopped; server writes,
     *    then changes state (the offering learner clears it with its offer). */
    alignas(PSD_CACHELINE) char fail_msg[PSD_MSG_LEN];

    /* ==== the shared page: every attached process, learners included, may
     *      write these words (a learner maps nothing else of the header
     *      writable, except its offer window). Each is on its own line. */

    /* -- admission: robust, process-shared; taken to offer a spec (claims are lock-free:
     *    ring.c). Initialised by the server only; locked by anyone. */
    alignas(PSD_PAGE) pthread_mutex_t admission;

    /* -- signalled by the loop when a round completes, and by ssp learners when
     *    they push, each only when a waiter announced itself. Learners wait on it
     *    (bsp rounds, ssp). */
    alignas(PSD_CACHELINE) struct psd_cond sync_cond;

    /* -- signalled at every change of `state` (server, offering learner);
     *    waited on by learners and tools. */
    alignas(PSD_CACHELINE) struct psd_cond state_cond;

    /* -- rung by anyone that published work for a sleeping loop (see `sleeping`);
     *    the update loop sleeps on it. */
    alignas(PSD_CACHELINE) struct psd_cond doorbell;

    /* -- mutexes taken over from a dead owner, bumped by whichever process took one over. */
    alignas(PSD_CACHELINE) _Atomic uint64_t lock_recoveries;
};

/* Progress of one learner rank (the PSD_RANK that `psd run` hands each
 * learner), kept across that learner's restarts and in checkpoints. */
struct psd_rank {
    /* gradients of this rank applied to the weights; written only by the
     * update loop (relaxed), or by a server restoring a checkpoint before READY. */
    alignas(PSD_CACHELINE) _Atomic uint64_t applied;
};

/* The server's record of learner slot i, in the slot table (`slotrec_off`): only the server
 * process writes it (the update loop, the reaper in its main thread); a learner maps it read-only.
 * Everything the server relies on about a learner lives here, never in the learner's page. */
struct psd_slot {
    /* -- ownership: written by the update loop when it admits a claim request (psd_admit), before
     *    the store-release of `state`; cleared when the slot is freed. `state` changes by
     *    compare-exchange (the loop and the reaper both move it), load-acquired by everyone. */
    alignas(PSD_CACHELINE) _Atomic uint32_t state;
    _Atomic int32_t pid;         /* as the owner sees itself: meaningful only in its PID namespace (pid_ns) */
    _Atomic uint64_t start_time; /* /proc/<pid>/stat starttime: a reused pid is not the owner */
    _Atomic uint64_t claims;     /* the claim token: a fresh random value at every admitted claim, so
                                  * reattached learners are told apart and no stray write names it */
    _Atomic int32_t rank;        /* the learner's rank, or -1 (checked at admission) */
    _Atomic uint32_t refused;    /* enum psd_refusal: the answer to request `answered` (0: admitted) */
    _Atomic uint64_t ssp_base;   /* ssp: the learner's clock is ssp_base + tail (set at admission to
                                  * the slowest live learner's, so a newcomer holds nobody back) */
    _Atomic uint64_t pid_ns;     /* inode of the owner's PID namespace, 0: unknown. The pid and
                                  * start time mean something only in the same namespace. */
    _Atomic uint64_t answered;   /* the nonce of the last claim request the server answered
                                  * (store-release after the answer's fields; the claimer load-acquires) */

    /* -- bumped (and futex-woken) by the update loop after it frees an entry, admits or refuses a
     *    claim request, or frees the slot; learners wait on `seq` through their read-only mapping,
     *    announcing themselves in their own page (psd_lslot.waiters). `waiters` is unused. */
    alignas(PSD_CACHELINE) struct psd_cond not_full;

    /* -- consumer index: written only by the update loop, store-release after an entry is applied
     *    (the learner load-acquires it before reusing the entry). Entries consumed since the claim. */
    alignas(PSD_CACHELINE) _Atomic uint64_t head;

    /* -- figures for this slot, written only by the update loop. */
    alignas(PSD_CACHELINE) _Atomic uint64_t applied;
    _Atomic uint64_t rejected;       /* non-finite gradients */
    _Atomic uint64_t dropped;        /* older than --max-staleness */
    _Atomic uint64_t staleness_sum;
    _Atomic uint64_t staleness_max;
    _Atomic uint64_t last_loss_bits; /* double, bit pattern (a finite loss the learner reported) */
    _Atomic uint64_t round_joined;   /* bsp: rounds + 1 of the round it last contributed to */
    _Atomic uint64_t ignored;        /* entries whose claim token was not this slot's claim */

    /* -- the lease as the reaper saw it, written only by the server's reaper
     *    (psd_reap, main thread; relaxed), reset when it sees a new claim. The reaper never moves
     *    an ACTIVE slot itself: it posts the claim it judged gone (`reap_claim`, store-release after
     *    `reap_why`), and the update loop moves the slot to DRAINING only while that claim is still
     *    the slot's (so a judgement about one owner never lands on the next). */
    alignas(PSD_CACHELINE) _Atomic uint64_t lease_claim; /* the claim these describe */
    _Atomic uint64_t lease_seen;     /* the learner's lease_beat when the reaper last saw it move */
    _Atomic uint64_t lease_seen_ns;  /* the reaper's CLOCK_MONOTONIC then */
    _Atomic uint64_t reap_claim;     /* the claim the reaper judged gone (0: none) */
    _Atomic uint32_t reap_why;       /* enum psd_reap_reason, for reap_claim */
    _Atomic uint32_t lease_moved;    /* the owner's lease beat moved since its admission */
    _Atomic uint32_t reap_reason;    /* enum psd_reap_reason: why the slot was taken back (by the loop) */
    _Atomic uint32_t liveness;       /* enum psd_live_method the reaper used last (for psd status) */

    /* -- the update loop's watch over a request line held mid-write (req_nonce == WRITING) while
     *    the slot is FREE: its CLOCK_MONOTONIC when it first saw it so (0: not held), so a claimer
     *    that died writing frees the line after a second. */
    alignas(PSD_CACHELINE) _Atomic uint64_t line_seen_ns;

    /* -- the last eviction from this slot, written by the update loop before the store-release of
     *    state EVICTED: who (a process with this identity is refused a slot while any slot keeps
     *    its record), which rule, when. Kept until the slot is claimed again. */
    alignas(PSD_CACHELINE) _Atomic int32_t evicted_pid;
    _Atomic uint32_t evicted_rule;   /* enum psd_rule */
    _Atomic uint64_t evicted_start_time;
    _Atomic uint64_t evicted_pid_ns;
    _Atomic uint64_t evicted_unix_ns;
    _Atomic uint64_t evicted_entries; /* entries the loop had taken from it (it pushed at least these) */
};

/* What learner i may write: one page-aligned block per slot at `slots_off + i * slot_stride`,
 * this struct, then its ring of `ring_k` entries. The claimer writes the request line of a FREE
 * slot (mapping only that block writable); once admitted, the owner writes the rest. The server
 * reads it as a kernel reads a user-shared ring: every value copied once, checked, then used. */
struct psd_lslot {
    /* -- claim request: the claimer takes the line (compare-exchange of `req_nonce` to WRITING),
     *    writes pid, start time, namespace, rank and their check, then publishes a fresh non-zero
     *    `req_nonce` (compare-exchange from WRITING: a line the loop freed from under a stalled
     *    claimer is not written over). The update loop answers each new nonce once, in the server's
     *    record (`answered`, `refused`), holding the line at WRITING while it answers so that a
     *    claimer withdrawing at its deadline cannot cross the answer. `release`: the owner's claim
     *    token, written to give the slot back (the loop then drains and frees it). */
    alignas(PSD_CACHELINE) _Atomic uint64_t req_nonce;
    _Atomic int32_t req_pid;
    _Atomic int32_t req_rank;
    _Atomic uint64_t req_start_time;
    _Atomic uint64_t req_pid_ns;
    _Atomic uint64_t req_check; /* psd_request_check() of the fields above: garbage is never a request */
    _Atomic uint64_t release;

    /* -- producer index: written only by the owning learner, store-release
     *    after an entry is completely written; the update loop load-acquires.
     *    Free-running from 0 at the claim; tail - head <= ring_k, else the learner is evicted. */
    alignas(PSD_CACHELINE) _Atomic uint64_t tail;

    /* -- the owner's own figures (relaxed; shown by psd status as the learner reports them). */
    alignas(PSD_CACHELINE) _Atomic uint64_t learner_clock; /* clock of the weights it trains on */
    _Atomic uint64_t pulls;
    _Atomic uint64_t pulls_skipped;
    _Atomic uint64_t full_waits; /* times it found its ring full */
    _Atomic uint64_t lease_beat; /* bumped by every push and by the owner's lease thread (lease.c);
                                  * the reaper reclaims the slot when it stands still for lease_ms
                                  * where /proc cannot tell */
    _Atomic uint64_t sharpness_bits; /* double: the largest curvature of the loss the owner last measured
                                      * (learner/sharpness.py); the server takes only a finite positive one */
    _Atomic uint32_t waiters;    /* the owner waits on its record's not_full (a hint: the loop wakes it) */
    uint32_t pad;
};

/* Header of one ring entry. Written by the learner before it store-releases
 * the tail past it; read by the update loop after it load-acquired that tail.
 * The payload follows at offset PSD_CACHELINE (see psd_entry_* in psd.h):
 *   gradient    n_train float32, in spec order; the span of piece k holds
 *               either its dense gradient, or (PSD_PIECE_SPARSE) a uint64
 *               row count r, r int64 row indices, then r rows of float32, or
 *               (PSD_PIECE_DENSE_BF16) its dense gradient as bfloat16 in the
 *               first half of the span
 *   buffers     n_buffers float64 (8-aligned, PSD_ENTRY_BUFFERS): the learner's
 *               real-valued buffers (they replace the job's; with
 *               PSD_ENTRY_BUF_RANGE only those in [buf_lo, buf_hi), a partial
 *               attach's own), then how far its integer buffers (counters) moved
 *               since it last pulled them (added)
 *   piece map   n_pieces bytes, enum psd_piece_kind: which tensors have a
 *               gradient in this entry, and how it is stored */
struct psd_entry {
    alignas(PSD_CACHELINE) uint64_t seq; /* the tail value this entry was published with */
    uint64_t clock;      /* weights clock the gradient was computed from */
    uint32_t batch_size;
    uint32_t flags;      /* PSD_ENTRY_* */
    double loss;
    uint64_t claim;      /* the slot's claim token the learner holds: the update loop ignores
                          * (and counts) an entry whose token is not the slot's current claim */
    /* Written by the update loop when it consumes the entry, before the
     * store-release of head; the learner reads it after load-acquiring head:
     * the weights clock the gradient met (so its exact staleness is
     * applied_clock - clock). */
    uint64_t applied_clock;
    uint32_t outcome;    /* enum psd_outcome */
    /* PSD_ENTRY_BUF_RANGE: the real-valued buffers this entry sets, [buf_lo, buf_hi) of the job's
     * (a partial attach holds some of the model's buffers); checked against the job's. */
    uint32_t buf_lo, buf_hi;
};

/* What the update loop checks of a slot a learner writes; breaking a rule evicts the learner. */
enum psd_rule {
    PSD_RULE_NONE = 0,
    PSD_RULE_TAIL = 1, /* tail - head must be at most ring_k */
    PSD_RULE_SEQ = 2,  /* an entry's seq must be the index it was published at */
    PSD_RULE_RANK = 3, /* rank must be -1 or a rank of this job */
    PSD_RULE_HEAD = 4, /* head is the update loop's: nobody else may move it */
    PSD_RULE_FLAGS = 5, /* an entry's flags must be known PSD_ENTRY_* bits */
    PSD_RULE_BATCH = 6, /* an entry's batch_size must be at most PSD_MAX_BATCH */
    PSD_RULE_CLOCK = 7, /* an entry's clock must not be ahead of the weights clock */
    PSD_RULE_PIECES = 8, /* an entry's piece map must hold known kinds, its sparse pieces rows of their tensor */
    PSD_RULE_VALUES = 9, /* a gradient the learner marked finite must be finite where the loop reads it */
    PSD_RULE_BUFFERS = 10, /* an entry's buffer range must lie within the job's real-valued buffers */
};
#define PSD_MAX_BATCH (UINT32_C(1) << 24) /* samples in one gradient; more is a stray write */

/* psd_entry.flags, set by the learner. */
#define PSD_ENTRY_NONFINITE 1u /* the gradient holds a NaN or an infinity: never applied */
#define PSD_ENTRY_BUFFERS 2u   /* the buffers are filled in: merge them into the job's */
#define PSD_ENTRY_BUF_RANGE 4u /* with BUFFERS: only the real-valued buffers in [buf_lo, buf_hi) are set */

/* The piece map: what one entry holds for each trainable tensor. A tensor
 * without a gradient (frozen this step, or unused) gets no update at all. */
enum psd_piece_kind {
    PSD_PIECE_ABSENT = 0,
    PSD_PIECE_DENSE = 1,
    PSD_PIECE_SPARSE = 2, /* rows of a 2-D (or wider) tensor: sgd, momentum, nesterov, adagrad */
    PSD_PIECE_DENSE_BF16 = 3, /* dense, as bfloat16 (--grad-dtype bf16): half the bytes to write and read */
};

/* Per trainable tensor, written only by the update loop (or a server
 * restoring a checkpoint before READY); in checkpoints. As in torch.optim,
 * each tensor counts its own steps (Adam's bias correction, the momentum
 * buffer's first step), so a tensor without a gradient is not moved. */
struct psd_piece {
    uint64_t steps; /* optimizer updates this tensor received */
    uint64_t round; /* bsp / kasync: rounds + 1 of the round whose sum it is in */
    /* kasync:K (K > 1) with Adam / AdamW, where each gradient is one process's step (psd_adam_take):
     * the gradients this tensor took into its moments (Adam's step count for it, as torch.optim's
     * per-tensor `step`: one per gradient that carries it), and how many of them in round `round`
     * (AdamW's decoupled decay of that round, once a gradient). 0 in every other mode. */
    uint64_t taken;
    uint64_t round_taken;
};
#define PSD_PIECE_WORDS 4 /* uint64 words of a struct psd_piece (psd/state.py pieces_view) */

/* One entry of the rows log, written only by the update loop: entry i sits at index
 * i % psd_rowlog_cap(n_train). The loop stores `seq` = PSD_ROWLOG_WRITING, then store-releases the
 * fields, then `seq` = i; a reader load-acquires `seq` and the fields, and takes them only if `seq`
 * still reads i (a seqlock of one entry: the loop may lap a reader). */
struct psd_rowlog_entry {
    _Atomic uint64_t seq;
    _Atomic uint64_t piece; /* the trainable tensor, or PSD_ROWLOG_ALL: every weight may have changed */
    _Atomic uint64_t row;   /* the row (of the piece's row_len elements), or PSD_ROWLOG_WHOLE */
};
#define PSD_ROWLOG_WRITING UINT64_MAX
#define PSD_ROWLOG_ALL UINT64_MAX
#define PSD_ROWLOG_WHOLE UINT64_MAX
/* Entries in an arena's rows log: a power of two from 2^10 to 2^16, one for every 64 trainable
 * elements (a learner whose pulls fall further behind than that copies everything). */
static inline uint64_t psd_rowlog_cap(uint64_t n_train) {
    uint64_t cap = UINT64_C(1) << 10;
    while (cap < (UINT64_C(1) << 16) && cap * 64 < n_train)
        cap <<= 1;
    return cap;
}

/* Element types of a learner's gradients; the arena keeps float32. */
enum psd_dtype {
    PSD_DTYPE_F32 = 0,
    PSD_DTYPE_BF16 = 1,
    PSD_DTYPE_F16 = 2,
};

/* psd_entry.outcome, set by the update loop. */
enum psd_outcome {
    PSD_OUTCOME_PENDING = 0,
    PSD_OUTCOME_APPLIED = 1,  /* applied (asp, ssp) or added to the round's sum (bsp, kasync) */
    PSD_OUTCOME_REJECTED = 2, /* non-finite */
    PSD_OUTCOME_DROPPED = 3,  /* staler than --max-staleness */
    PSD_OUTCOME_IGNORED = 4,  /* pushed under a claim token that is not the slot's current claim */
};

/* psd_slot.reap_reason: why the reaper took a slot back from its owner. */
enum psd_reap_reason {
    PSD_REAP_NONE = 0,
    PSD_REAP_EXITED = 1, /* /proc (or kill(pid, 0)) says the owner is gone */
    PSD_REAP_LEASE = 2,  /* /proc could not tell; the lease ran out */
    PSD_REAP_UNCLAIMED = 3, /* admitted, but the owner never beat its lease (it did not take the slot:
                             * a claim withdrawn as it was answered, or a request naming another process) */
};

/* psd_slot.liveness: how the reaper judged the owner the last time. */
enum psd_live_method {
    PSD_LIVE_BY_NONE = 0,
    PSD_LIVE_BY_PROC = 1,  /* same PID namespace, /proc readable: pid + start time */
    PSD_LIVE_BY_LEASE = 2, /* /proc cannot tell (another PID namespace, hidepid, --liveness lease) */
};

enum psd_optimizer {
    PSD_OPT_SGD = 0,
    PSD_OPT_MOMENTUM = 1,
    PSD_OPT_NESTEROV = 2,
    PSD_OPT_ADAM = 3,
    PSD_OPT_ADAMW = 4,
    PSD_OPT_ADAGRAD = 5,
};

enum psd_sync {
    PSD_SYNC_ASP = 0,    /* every gradient applied as it comes */
    PSD_SYNC_SSP = 1,    /* as asp; a learner computes only while at most sync_param pushes
                          * ahead of the slowest live learner */
    PSD_SYNC_BSP = 2,    /* one gradient per live learner, averaged, applied once */
    PSD_SYNC_KASYNC = 3, /* the sum of every sync_param gradients */
};

enum psd_schedule {
    PSD_SCHED_CONSTANT = 0,
    PSD_SCHED_STEP = 1,   /* lr * gamma^(t / step_size) */
    PSD_SCHED_COSINE = 2, /* eta_min + (lr - eta_min) (1 + cos(pi min(t, t_max) / t_max)) / 2 */
};

/* psd_header.async_momentum: the explicit momentum of momentum / nesterov, less the implicit
 * momentum that asynchrony adds (Mitliagkas et al. 2016), estimated from the measured staleness. */
enum psd_async_momentum {
    PSD_ASYNC_MOMENTUM_OFF = 0,  /* the configured momentum, as torch.optim */
    PSD_ASYNC_MOMENTUM_AUTO = 1, /* max(0, momentum - tau / (1 + tau)), tau: the mean staleness */
};
/* Updates the running mean of staleness spans (an exponential moving average). */
#define PSD_STALENESS_WINDOW 64.0
/* Updates over which the staleness held when learners leave decays (1/e): staleness_held_bits. */
#define PSD_STALENESS_HOLD 1024.0

#define PSD_CFG_STALENESS_LR 1u /* divide the lr by max(1, staleness) */
#define PSD_CFG_PREDICT 2u      /* learners train on predicted weights */
#define PSD_CFG_LEASE_ONLY 4u   /* --liveness lease: never consult /proc, judge learners by their lease */
#define PSD_CFG_GRAD_BF16 8u    /* --grad-dtype bf16: learners push dense gradients as bfloat16 */
#define PSD_CFG_OVERLAP 16u     /* --overlap on: an asp/ssp learner pulls without waiting for its own gradient */
#define PSD_CFG_NO_OVERLAP 32u  /* --overlap off: it pulls once the loop applied its gradient (neither: auto) */
/* Every flag above: the update loop refuses a configuration with any other (take_config). */
#define PSD_CFG_KNOWN                                                                                              \
    (PSD_CFG_STALENESS_LR | PSD_CFG_PREDICT | PSD_CFG_LEASE_ONLY | PSD_CFG_GRAD_BF16 | PSD_CFG_OVERLAP |             \
     PSD_CFG_NO_OVERLAP)

/* Whether asp / ssp learners wait after each push until the loop applied it: --overlap off, and auto (neither
 * bit), for every optimizer at any learner count (docs/training.md, "When a learner takes newer weights":
 * waiting takes a step of staleness away; layouts 10 and 11 kept the hand-off for momentum / nesterov at two
 * or more slots, until --async-momentum auto was measured with the wait). --overlap on takes the hand-off.
 * kasync and bsp never do (their own waits). */
static inline int psd_learners_wait_for_their_own(const struct psd_config *c) {
    return (c->sync_mode == PSD_SYNC_ASP || c->sync_mode == PSD_SYNC_SSP) && !(c->cfg_flags & PSD_CFG_OVERLAP);
}
#define PSD_LEASE_MS_DEFAULT 5000u

/* Optimizer state vectors (n_train floats each) an arena holds. */
static inline uint32_t psd_state_vectors(uint32_t optimizer, uint32_t sync_mode) {
    uint32_t v = optimizer == PSD_OPT_MOMENTUM || optimizer == PSD_OPT_NESTEROV || optimizer == PSD_OPT_ADAGRAD ? 1
                 : optimizer == PSD_OPT_ADAM || optimizer == PSD_OPT_ADAMW                                   ? 2
                                                                                                            : 0;
    return v + (sync_mode == PSD_SYNC_BSP || sync_mode == PSD_SYNC_KASYNC ? 1 : 0);
}

_Static_assert(sizeof(struct psd_header) <= PSD_HEADER_SIZE, "header must fit its two pages");
_Static_assert(offsetof(struct psd_header, admission) == PSD_PAGE, "the shared page is the header's second");
_Static_assert(offsetof(struct psd_header, fail_msg) + PSD_MSG_LEN <= PSD_PAGE, "server lines fit the first page");
_Static_assert(offsetof(struct psd_header, magic) == 0, "identity line is fixed");
_Static_assert(offsetof(struct psd_header, layout_version) == 8, "identity line is fixed");
_Static_assert(offsetof(struct psd_header, psd_version) == 16, "identity line is fixed");
_Static_assert(offsetof(struct psd_header, clock) % PSD_CACHELINE == 0, "clock on its own line");
_Static_assert(offsetof(struct psd_lslot, tail) % PSD_CACHELINE == 0, "tail on its own line");
_Static_assert(offsetof(struct psd_slot, head) % PSD_CACHELINE == 0, "head on its own line");
_Static_assert(sizeof(struct psd_lslot) % PSD_CACHELINE == 0, "a learner page header is whole lines");
_Static_assert(sizeof(struct psd_entry) == PSD_CACHELINE, "entry header is one line");
_Static_assert(sizeof(struct psd_rank) == PSD_CACHELINE, "a rank is one line");
_Static_assert(sizeof(pthread_mutex_t) <= PSD_CACHELINE, "a mutex fits its line");
_Static_assert(sizeof(struct psd_slot) % PSD_CACHELINE == 0, "slot is whole lines");
_Static_assert(sizeof(struct psd_piece) == 8 * PSD_PIECE_WORDS, "a piece is PSD_PIECE_WORDS words");

/* What a layout built by another compiler or ABI would disagree on. */
static inline uint32_t psd_fingerprint(void) {
    uint64_t h = UINT64_C(1469598103934665603);
    const uint64_t parts[] = {
        sizeof(struct psd_header), sizeof(struct psd_slot), sizeof(struct psd_entry),
        sizeof(pthread_mutex_t),   sizeof(struct psd_cond), PSD_CACHELINE,
        offsetof(struct psd_header, admission), sizeof(struct psd_lslot),
        offsetof(struct psd_slot, head),   sizeof(struct psd_piece),
        offsetof(struct psd_header, n_pieces), offsetof(struct psd_entry, claim),
        offsetof(struct psd_lslot, lease_beat), offsetof(struct psd_header, cfg.lease_ms),
        offsetof(struct psd_slot, evicted_entries), offsetof(struct psd_header, slotrec_off),
        offsetof(struct psd_header, rowlog_head), sizeof(struct psd_rowlog_entry),
    };
    for (size_t i = 0; i < sizeof parts / sizeof parts[0]; i++) {
        h ^= parts[i];
        h *= UINT64_C(1099511628211);
    }
    return (uint32_t)(h ^ (h >> 32));
}

#endif
