/*
 * update.c -- the server's update loop, the consumer side of every ring.
 *
 * One native thread, never holding the GIL, visits the rings round-robin and
 * takes one gradient per ring per round (so a fast learner cannot starve a
 * slow one). In asp and ssp each gradient is one update of the configured
 * optimizer, applied in place, Hogwild style, with OpenMP across the vector;
 * in bsp and kasync gradients are summed into the accumulator and applied
 * once per round: bsp their average (one per live learner), kasync their sum
 * (every K).
 * Non-finite gradients (flagged by the learner's push) and gradients staler
 * than --max-staleness are counted and never applied. It spins for a short
 * while after the last gradient it found, then sleeps on the doorbell, so an
 * idle server costs (almost) no CPU and a busy one reacts in microseconds.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <time.h>
#include <unistd.h>

#include "kernels.h"
#include "psd.h"

struct psd_loop {
    /* The server's mapping, copied at start with its checked geometry (psd.h psd_geom): the loop
     * never reads geometry from shared memory. m points at `map`. */
    struct psd_map map, *m;
    /* The header's configuration, copied as one unit and checked at start (take_config): no other
     * process can change what the loop uses under it. */
    struct psd_config cfg;
    double staleness_avg; /* --async-momentum's running mean of staleness (note_staleness) */
    double staleness_held; /* and that mean held since the job last lost a learner (note_learners) */
    uint32_t learners;     /* slots in use at the last whole pass (round_robin's count) */
    pthread_t thread;
    _Atomic int stop; /* set by psd_loop_stop, read each round */
    uint32_t threads;
    uint32_t cpus;
    uint64_t spin_ns;
    /* The trainable tensors, the loop's own copy (never read back from shared
     * memory), and a piece map of its own for applying the bsp / kasync sum. */
    uint64_t n_pieces;
    struct psd_piece_geom *pieces;
    uint8_t *round_map;
    /* Per tensor, the share of recent updates that moved it (a running mean over about
     * PSD_STALENESS_WINDOW updates; 1 while every update moves every tensor): what turns an entry's
     * clock distance into the updates that moved its own tensors (entry_staleness). */
    double *moved;
    uint64_t buffers_set; /* leading buffer elements an entry sets; the rest it adds to */
    uint64_t clock;       /* the weights clock: the loop's own, stored out after each update */
    uint64_t crash_round;    /* PSD_TEST_CRASH_IN_ROUND (a test hook): the round, 0: none */
    uint32_t crash_stage;    /* and where in its finish (enum crash_stage) */
    /* Per slot, the head this loop stored last (0 for a free slot): the loop never takes a head
     * back from shared memory, and a slot whose head another process moved is evicted. */
    uint64_t *heads;
    /* The piece map of the entry being taken, copied out of the ring before it is checked, so
     * that what is applied is what was checked. */
    uint8_t *entry_map;
    /* momentum / nesterov: a sparse gradient made dense (its rows, 0 elsewhere), `dense_len` floats */
    float *dense;
    uint64_t dense_len;
    /* The heartbeat, stored after each pass and, inside a long update, every PSD_BEAT_NS
     * (psd_beat), so that one long apply does not look like a hung server. */
    struct psd_beat beat;
    /* Non-finite values the kernels met in the entry being taken (each moved nothing): a learner
     * that marked its gradient finite wrote into it after its check (rule VALUES). Counted by the
     * kernels' threads, read by this loop's thread after each apply. */
    _Atomic uint64_t nonfinite;
    /* The rows log's writer: what each update changed, so learners pull only that. */
    struct psd_rowlog_writer log;
};

static void atomic_max(_Atomic uint64_t *p, uint64_t v) {
    uint64_t cur = PSD_LOAD_RLX(p);
    while (v > cur && !atomic_compare_exchange_weak_explicit(p, &cur, v, memory_order_relaxed,
                                                             memory_order_relaxed)) {
    }
}

/* Staleness bookkeeping for one consumed gradient (the update loop alone writes these). */
static void count_applied(struct psd_map *m, struct psd_slot *s, const struct psd_entry *e, uint64_t staleness) {
    struct psd_header *h = psd_hdr(m);
    double loss = e->loss;
    uint64_t loss_bits;
    memcpy(&loss_bits, &loss, sizeof loss_bits);
    if (loss == loss && loss - loss == 0.0) /* a finite loss; a learner that reports none leaves the last one */
        PSD_STORE_RLX(&s->last_loss_bits, loss_bits);
    PSD_ADD_RLX(&s->applied, 1);
    PSD_ADD_RLX(&s->staleness_sum, staleness);
    atomic_max(&s->staleness_max, staleness);
    PSD_ADD_RLX(&h->applied, 1);
    int32_t rank = PSD_LOAD_RLX(&s->rank); /* the server's record, checked at admission */
    if (rank >= 0 && (uint32_t)rank < m->g.n_slots)
        PSD_ADD_RLX(&psd_rank_at(m, (uint32_t)rank)->applied, 1);
    PSD_ADD_RLX(&h->staleness_sum, staleness);
    atomic_max(&h->staleness_max, staleness);
    uint32_t bucket = staleness == 0 ? 0 : 64 - (uint32_t)__builtin_clzll(staleness);
    PSD_ADD_RLX(&h->staleness_hist[bucket < PSD_HIST_BUCKETS ? bucket : PSD_HIST_BUCKETS - 1], 1);
}

/* A double into a header field of its bits (the loop alone writes these; readers load them relaxed). */
static void store_double(_Atomic uint64_t *field, double v) {
    uint64_t bits;
    memcpy(&bits, &v, sizeof bits);
    PSD_STORE_RLX(field, bits);
}

/* --async-momentum: fold this update's staleness into the running mean psd_async_momentum reads
 * (the loop's own copy), decay a hold (note_learners), and show both in the header. */
static void note_staleness(struct psd_loop *L, double staleness) {
    L->staleness_avg += (staleness - L->staleness_avg) / PSD_STALENESS_WINDOW;
    store_double(&psd_hdr(L->m)->staleness_avg_bits, L->staleness_avg); /* for psd status, the next server */
    if (L->staleness_held > 0.0) {
        L->staleness_held *= 1.0 - 1.0 / PSD_STALENESS_HOLD;
        if (L->staleness_held <= L->staleness_avg)
            L->staleness_held = 0.0; /* the mean met it: the hold is over */
        store_double(&psd_hdr(L->m)->staleness_held_bits, L->staleness_held);
    }
}

/* The staleness the momentum rule reads: the running mean, or the mean held since the job last lost a
 * learner where that is larger. The staleness falls as learners leave (at a job's end they finish one
 * after another), and the rule would raise the momentum the job trained under several-fold within its
 * last few hundred updates: the MLP of tests/test_convergence.py's momentum test then ended at 0.954-0.97
 * where it trained at 0.98 (benchmarks/results/matrix/README.md, "the momentum rule's surge at a job's
 * tail"). So a departure holds the mean it met; the hold decays over PSD_STALENESS_HOLD updates (learners
 * that left for good let the momentum back up slowly) and ends when the running mean meets it, or when a
 * learner arrives (a restarted one, a new one). */
static double rule_staleness(const struct psd_loop *L) {
    return L->staleness_held > L->staleness_avg ? L->staleness_held : L->staleness_avg;
}

/* A whole pass found `busy` slots in use: a learner left (hold the staleness) or arrived (release it).
 * Only this thread frees slots (free_slot, evict), so a pass counts fewer only after a departure. A
 * departure and an arrival between two passes (while the loop pauses or holds, psd_admit still admits)
 * leave the count as it was, and the rule as it was: the job has as many learners as before. */
static void note_learners(struct psd_loop *L, uint32_t busy) {
    if (busy < L->learners)
        L->staleness_held = rule_staleness(L);
    else
        L->staleness_held = 0.0;
    L->learners = busy;
    store_double(&psd_hdr(L->m)->staleness_held_bits, L->staleness_held);
}

/* A sparse piece's rows as a dense gradient in L->dense (grown to the tensor's size the first time);
 * false if there is no memory for it (the piece then moves nothing, and the loop says so once). */
static bool dense_gradient(struct psd_loop *L, const float *span, const struct psd_piece_geom *pg) {
    if (L->dense_len < pg->len) {
        float *d = realloc(L->dense, pg->len * sizeof *d);
        if (!d) {
            static _Atomic int told;
            if (!atomic_exchange(&told, 1))
                fprintf(stderr, "psd: no memory to make a sparse gradient of %llu floats dense: not applied\n",
                        (unsigned long long)pg->len);
            return false;
        }
        L->dense = d;
        L->dense_len = pg->len;
    }
    memset(L->dense, 0, pg->len * sizeof *L->dense);
    psd_sparse_add(L->dense, span, pg->len, pg->row_len, NULL, &L->nonfinite);
    return true;
}

/* Whether a round's gradients go into the optimizer's state as they come (kasync, where each gradient is
 * one process's step: Adagrad's squares, psd_adagrad_take; Adam's moments, psd_adam_take), the round's
 * update then adding none. */
static bool squares_as_taken(const struct psd_config *c) {
    return c->sync_mode == PSD_SYNC_KASYNC && c->optimizer == PSD_OPT_ADAGRAD;
}

/* (kasync:1 is asp's arithmetic, bit for bit: its round's sum is its one gradient.) */
static bool moments_as_taken(const struct psd_config *c) {
    return psd_kasync_k(c) > 1 && (c->optimizer == PSD_OPT_ADAM || c->optimizer == PSD_OPT_ADAMW);
}

/* The step argument of tensor k's update (psd_optimizer_step's t): its step, one more than the updates it
 * received; a kasync round of Adam whose moments took the gradients (adam_taken): how many of the round's
 * gradients it took, the steps of AdamW's decay the round makes. */
static uint64_t step_arg(const struct psd_map *m, uint64_t k, bool adam_taken) {
    const struct psd_piece *ps = psd_piece_at(m, k);
    return adam_taken ? ps->round_taken : ps->steps + 1;
}

/* Apply gradient g (an entry's, or the accumulator) to the tensors that `map`
 * says have one, each at its own step count. Runs of dense tensors at the same
 * step go to the optimizer as one range (one call for a whole dense model). */
static void apply_pieces(struct psd_loop *L, const float *g, const uint8_t *map, float gscale, double lr,
                         double mom) {
    struct psd_map *m = L->m;
    const struct psd_config *cfg = &L->cfg;
    float *w = psd_weights(m), *s0 = psd_state(m, 0), *s1 = psd_state(m, 1);
    /* The rows log: an update of every tensor, dense, is one entry (everything changed); else each
     * tensor it moves is logged whole, and a sparse one by its rows (psd_sparse_step). */
    bool every_dense = true;
    for (uint64_t k = 0; k < L->n_pieces && every_dense; k++)
        every_dense = map[k] == PSD_PIECE_DENSE || map[k] == PSD_PIECE_DENSE_BF16;
    if (every_dense)
        psd_rowlog_put(&L->log, PSD_ROWLOG_ALL, PSD_ROWLOG_WHOLE);
    bool adam_taken = (cfg->cfg_flags & PSD_CFG_LOOP_SQUARES_TAKEN) && moments_as_taken(cfg);
    for (uint64_t k = 0; k < L->n_pieces;) {
        const struct psd_piece_geom *pg = &L->pieces[k];
        uint64_t t = step_arg(m, k, adam_taken);
        if (map[k] == PSD_PIECE_ABSENT) {
            k++;
        } else if (map[k] == PSD_PIECE_SPARSE &&
                   (cfg->optimizer == PSD_OPT_MOMENTUM || cfg->optimizer == PSD_OPT_NESTEROV)) {
            /* torch's SGD with momentum on a sparse gradient: its buffer decays, and moves the weights,
             * wherever it holds rows. That is the dense step with the gradient 0 off its rows: made
             * dense here, applied whole, logged whole. */
            if (dense_gradient(L, g + pg->off, pg)) {
                psd_rowlog_put(&L->log, k, PSD_ROWLOG_WHOLE);
                psd_optimizer_step(cfg, mom, w + pg->off, L->dense, PSD_DTYPE_F32, gscale, s0 + pg->off,
                                   s1 + pg->off, pg->len, lr, t, (int)L->threads, &L->beat, &L->nonfinite);
            }
            psd_piece_at(m, k++)->steps = t;
        } else if (map[k] == PSD_PIECE_SPARSE) {
            psd_sparse_step(&L->log, k, cfg, w + pg->off, g + pg->off, pg->len, pg->row_len, gscale, s0 + pg->off,
                            lr, t, &L->nonfinite);
            psd_piece_at(m, k++)->steps = t;
        } else if (map[k] == PSD_PIECE_DENSE_BF16) {
            if (!every_dense)
                psd_rowlog_put(&L->log, k, PSD_ROWLOG_WHOLE);
            /* Its own call: the bfloat16 halves of two spans are not contiguous. */
            psd_optimizer_step(cfg, mom, w + pg->off, g + pg->off, PSD_DTYPE_BF16, gscale, s0 + pg->off, s1 + pg->off,
                               pg->len, lr, t, (int)L->threads, &L->beat, &L->nonfinite);
            psd_piece_at(m, k++)->steps = t;
        } else {
            uint64_t j = k + 1;
            while (j < L->n_pieces && map[j] == PSD_PIECE_DENSE && step_arg(m, j, adam_taken) == t)
                j++;
            for (uint64_t i = k; i < j && !every_dense; i++)
                psd_rowlog_put(&L->log, i, PSD_ROWLOG_WHOLE);
            uint64_t lo = pg->off, hi = L->pieces[j - 1].off + L->pieces[j - 1].len;
            psd_optimizer_step(cfg, mom, w + lo, g + lo, PSD_DTYPE_F32, gscale, s0 + lo, s1 + lo, hi - lo, lr, t,
                               (int)L->threads, &L->beat, &L->nonfinite);
            for (; k < j; k++) /* one update more: t, but where t is AdamW's count of decays (adam_taken) */
                psd_piece_at(m, k)->steps++;
        }
    }
}

/* One optimizer update of the weights with g * gscale, at the scheduled lr
 * (divided by the staleness with --staleness-lr; the momentum less asynchrony's implicit momentum
 * with --async-momentum auto, and Adagrad's young updates damped: psd_adagrad_start_factor); advances the
 * clock. */
static void update_weights(struct psd_loop *L, const float *g, const uint8_t *map, float gscale, double staleness,
                           uint64_t round) {
    struct psd_map *m = L->m;
    struct psd_header *h = psd_hdr(m);
    uint64_t t = PSD_LOAD_RLX(&h->opt_steps) + 1; /* only this thread writes it */
    double lr = psd_scheduled_lr(&L->cfg, t - 1);
    uint64_t lr_bits;
    memcpy(&lr_bits, &lr, sizeof lr_bits);
    if ((L->cfg.cfg_flags & PSD_CFG_STALENESS_LR) && staleness > 1.0)
        lr /= staleness;
    double mom = L->cfg.momentum;
    if (L->cfg.async_momentum == PSD_ASYNC_MOMENTUM_AUTO) {
        double gain_lr;
        double tau = rule_staleness(L);
        psd_async_rule(&L->cfg, tau, psd_gain_level(h), &mom, &gain_lr);
        double d = psd_damping(h);
        lr *= gain_lr * ((1.0 - d) + d * psd_async_lr_factor(&L->cfg, tau, staleness));
        lr *= psd_adagrad_start_factor(&L->cfg, t - 1, staleness);
        note_staleness(L, staleness);
    }
    apply_pieces(L, g, map, gscale, lr, mom);
    for (uint64_t k = 0; k < L->n_pieces; k++)
        L->moved[k] += ((map[k] != PSD_PIECE_ABSENT ? 1.0 : 0.0) - L->moved[k]) / PSD_STALENESS_WINDOW;
    /* Pairs with a learner's load-acquire of rowlog_head (after its load of clock): the entries
     * and the weights they name are written. */
    PSD_STORE_REL(&h->rowlog_head, L->log.head);
    PSD_STORE_RLX(&h->lr_bits, lr_bits);
    /* Pairs with the load-acquire of opt_steps in psd_predict. */
    PSD_STORE_REL(&h->opt_steps, t);
    /* Pairs with the load-acquire of clock before a learner's pull. */
    PSD_STORE_REL(&h->clock, ++L->clock);
    if (round) /* bsp / kasync: the round's update is whole (before the hold: a snapshot may be taken there) */
        atomic_store(&h->round_applied, round);
    if (psd_loop_should_hold(m)) /* a node-link exchange point: stop here, before bsp's rounds moves */
        psd_loop_hold(m, &L->stop);
}

/* dst = src, n float32 or bfloat16 (widened) taken out of a ring (psd_take_finite: a non-finite
 * value becomes 0 and is counted), beating as it goes. */
static void copy_beating(struct psd_loop *L, float *dst, const void *src, uint32_t dtype, uint64_t n) {
    uint32_t bad = 0;
    for (uint64_t lo = 0; lo < n; lo += PSD_CHUNK) {
        uint64_t len = n - lo < PSD_CHUNK ? n - lo : PSD_CHUNK;
        if (dtype == PSD_DTYPE_BF16)
            bad |= psd_take_finite_bf16(dst + lo, (const uint16_t *)src + lo, len);
        else
            bad |= psd_take_finite(dst + lo, (const float *)src + lo, len);
        psd_beat(&L->beat);
    }
    if (bad)
        PSD_ADD_RLX(&L->nonfinite, bad);
}

/* bsp / kasync: add an entry's gradient to the round's sum, tensor by tensor;
 * a tensor's first gradient of the round replaces what the sum held. */
static void accumulate(struct psd_loop *L, const float *g, const uint8_t *map) {
    struct psd_map *m = L->m;
    struct psd_header *h = psd_hdr(m);
    float *acc = psd_accumulator(m);
    float *squares = squares_as_taken(&L->cfg) ? psd_state(m, 0) : NULL;
    bool moments = moments_as_taken(&L->cfg);
    uint64_t mark = PSD_LOAD_RLX(&h->rounds) + 1;
    for (uint64_t k = 0; k < L->n_pieces; k++) {
        const struct psd_piece_geom *pg = &L->pieces[k];
        struct psd_piece *ps = psd_piece_at(m, k);
        bool first = ps->round != mark;
        bool dense = map[k] == PSD_PIECE_DENSE || map[k] == PSD_PIECE_DENSE_BF16;
        uint32_t dtype = map[k] == PSD_PIECE_DENSE_BF16 ? PSD_DTYPE_BF16 : PSD_DTYPE_F32;
        /* Adam's step of one process for this tensor: one more than the gradients it took (as torch.optim
         * counts a tensor's own steps: a gradient that leaves it out is none), and the round's count of them
         * for AdamW's decay. Counted after the take: a server killed inside it takes the entry again. */
        if (dense && moments) {
            uint64_t t = ps->taken + 1;
            double lr = psd_scheduled_lr(&L->cfg, PSD_LOAD_RLX(&h->opt_steps)); /* the round's (update_weights) */
            psd_adam_take(acc + pg->off, psd_state(m, 0) + pg->off, psd_state(m, 1) + pg->off, g + pg->off, dtype,
                          psd_weights(m) + pg->off, &L->cfg, lr, t, pg->len, first, (int)L->threads, &L->beat,
                          &L->nonfinite);
            ps->taken = t;
            ps->round_taken = first ? 1 : ps->round_taken + 1;
        } else if (dense && squares) /* a bfloat16 span starts where a float32 one would */
            psd_adagrad_take(acc + pg->off, squares + pg->off, g + pg->off, dtype, psd_weights(m) + pg->off,
                             L->cfg.weight_decay, pg->len, first, (int)L->threads, &L->beat, &L->nonfinite);
        else if (dense && first)
            copy_beating(L, acc + pg->off, g + pg->off, dtype, pg->len);
        else if (dense) /* acc += g */
            psd_apply_sgd(acc + pg->off, g + pg->off, dtype, pg->len, -1.0f, (int)L->threads, &L->beat,
                          &L->nonfinite);
        if (map[k] == PSD_PIECE_SPARSE) {
            if (first)
                memset(acc + pg->off, 0, pg->len * sizeof(float));
            psd_sparse_add(acc + pg->off, g + pg->off, pg->len, pg->row_len, squares ? squares + pg->off : NULL,
                           &L->nonfinite);
        }
        if (map[k] != PSD_PIECE_ABSENT)
            ps->round = mark;
    }
}

/* Whether an entry's piece map (the loop's copy) and its sparse pieces are well formed: known
 * kinds, and each sparse piece's row count and row indices within its tensor. An honest learner
 * writes nothing else (psd_push_from checks the rows it is given). */
static bool pieces_well_formed(const struct psd_loop *L, const float *g, const uint8_t *map) {
    for (uint64_t k = 0; k < L->n_pieces; k++) {
        const struct psd_piece_geom *pg = &L->pieces[k];
        if (map[k] > PSD_PIECE_DENSE_BF16)
            return false;
        if (map[k] == PSD_PIECE_SPARSE && psd_sparse_rows(g + pg->off, pg->len, pg->len / pg->row_len, pg->row_len) < 0)
            return false;
    }
    return true;
}

/* Whether the configured optimizer can take the entry's sparse pieces (as torch.optim: sgd and
 * adagrad without weight decay); an honest learner can push others, and they are rejected. */
static bool sparse_taken(const struct psd_loop *L, const uint8_t *map) {
    if (psd_sparse_ok(&L->cfg))
        return true;
    for (uint64_t k = 0; k < L->n_pieces; k++)
        if (map[k] == PSD_PIECE_SPARSE)
            return false;
    return true;
}

/* bsp: whether learner slot `s` already gave the current round its gradient. */
static bool joined_this_round(const struct psd_header *h, struct psd_slot *s) {
    return PSD_LOAD_RLX(&s->round_joined) == PSD_LOAD_RLX(&h->rounds) + 1;
}

/* bsp: apply the average of the round's gradients (one per learner, as DDP's all-reduce); kasync: their
 * sum (each gradient one process's step at the lr, as asp applies it: the average made K times fewer
 * steps of the same size). `mark`: the round's (rounds + 1). */
static void apply_round(struct psd_loop *L, uint64_t mark) {
    struct psd_map *m = L->m;
    struct psd_header *h = psd_hdr(m);
    uint64_t count = PSD_LOAD_RLX(&h->acc_count);
    if (!count) {
        atomic_store(&h->round_applied, mark); /* nothing to apply */
        return;
    }
    double staleness = (double)PSD_LOAD_RLX(&h->acc_staleness) / (double)count;
    for (uint64_t k = 0; k < L->n_pieces; k++)
        L->round_map[k] = psd_piece_at(m, k)->round == mark ? PSD_PIECE_DENSE : PSD_PIECE_ABSENT;
    float gscale = L->cfg.sync_mode == PSD_SYNC_KASYNC ? 1.0f : 1.0f / (float)count;
    if (squares_as_taken(&L->cfg) || moments_as_taken(&L->cfg))
        L->cfg.cfg_flags |= PSD_CFG_LOOP_SQUARES_TAKEN;
    update_weights(L, psd_accumulator(m), L->round_map, gscale, staleness, mark);
    L->cfg.cfg_flags &= ~PSD_CFG_LOOP_SQUARES_TAKEN;
}

/* Closes the round: the next one starts empty; learners waiting for the round go on. */
static void close_round(struct psd_header *h) {
    PSD_STORE_RLX(&h->acc_count, 0);
    PSD_STORE_RLX(&h->acc_members, 0);
    PSD_STORE_RLX(&h->acc_staleness, 0);
    /* Pairs with the load-acquire of rounds in psd_wait_round. */
    atomic_store(&h->rounds, PSD_LOAD_RLX(&h->rounds) + 1);
    psd_cond_broadcast_if_waiters(&h->sync_cond);
}

/* PSD_TEST_CRASH_IN_ROUND's stages: where in a round's finish the loop SIGKILLs its own process. */
enum crash_stage { CRASH_BEFORE = 1, CRASH_AFTER = 2, CRASH_CLOSED = 3 };

static void crash_if(const struct psd_loop *L, uint64_t mark, uint32_t stage) {
    if (L->crash_round == mark && L->crash_stage == stage)
        raise(SIGKILL); /* die as a server killed right here would */
}

/* Finish the round: apply it and close it, leaving where it stands in the header for a server that takes
 * over should this one die meanwhile (recover_round). `slot1`: 1 + the slot whose entry at `head` finished
 * it (kasync: taken, counted and in the sum, not yet handed back), 0 for none (bsp). The caller clears
 * round_applying once that entry is handed back (end_round). */
static void finish_round(struct psd_loop *L, uint32_t slot1, uint64_t head) {
    struct psd_header *h = psd_hdr(L->m);
    uint64_t mark = PSD_LOAD_RLX(&h->rounds) + 1;
    PSD_STORE_RLX(&h->round_slot, slot1);
    PSD_STORE_RLX(&h->round_head, head);
    /* seq_cst, after the two above and before the update writes a weight (its kernels' threads start after
     * it): a successor that reads the mark reads them too, and knows the round's sum may be in the weights. */
    atomic_store(&h->round_applying, mark);
    crash_if(L, mark, CRASH_BEFORE);
    apply_round(L, mark);
    crash_if(L, mark, CRASH_AFTER);
    close_round(h);
    crash_if(L, mark, CRASH_CLOSED);
}

/* The round and the entry that finished it are done with (after its hand-back). */
static void end_round(struct psd_header *h) {
    atomic_store(&h->round_applying, 0);
}

static void hand_back(struct psd_loop *L, uint32_t i, struct psd_slot *s, uint64_t head);

/* A new server on an arena whose last server died finishing a round (round_applying set). The round's update
 * begun but not whole: applied again, whole (the part already done twice, as the entry being applied at a crash
 * under asp); whole: not again. The round is closed, if it was not. The kasync entry that finished it (counted,
 * in the round's sum) is handed back, if its ring's head is still at it: taken again, it was counted again and
 * went into the round twice, which was then applied again (that round twice, that entry three times). */
static void recover_round(struct psd_loop *L) {
    struct psd_map *m = L->m;
    struct psd_header *h = psd_hdr(m);
    uint64_t applying = atomic_load(&h->round_applying);
    if (!applying)
        return;
    uint64_t mark = PSD_LOAD_RLX(&h->rounds) + 1;
    if (applying == mark) {
        /* A hold the last server died in is honoured before this runs (loop_main), and apply_round's update
         * holds at its end, as any update, where a node link asks: rounds moves after either. */
        if (atomic_load(&h->round_applied) != mark)
            apply_round(L, mark);
        close_round(h);
    }
    uint64_t slot1 = PSD_LOAD_RLX(&h->round_slot), head = PSD_LOAD_RLX(&h->round_head);
    if (slot1 && slot1 <= m->g.n_slots && L->heads[slot1 - 1] == head) {
        uint32_t i = (uint32_t)(slot1 - 1);
        struct psd_slot *s = psd_slot_at(m, i);
        uint32_t st = PSD_LOAD_ACQ(&s->state);
        if (st == PSD_SLOT_ACTIVE || st == PSD_SLOT_DRAINING) {
            struct psd_entry *e = psd_entry_at(m, i, head);
            e->applied_clock = L->clock;
            e->outcome = PSD_OUTCOME_APPLIED;
            hand_back(L, i, s, head);
        }
    }
    end_round(h);
}

/* Consume the entry at `head` of slot i, whose header `eh` (the loop's copy) and piece map
 * (L->entry_map) slot_rule checked: reject, drop, apply, or (bsp, kasync) add it to the round's
 * sum; then hand the entry back. */
/* The entry at head is free again: pairs with the load-acquire of head in tail_entry /
 * has_space. seq_cst so the load of the owner's waiter count stays after it (a Dekker pair with
 * the waiter's announcement and its load of head). */
static void hand_back(struct psd_loop *L, uint32_t i, struct psd_slot *s, uint64_t head) {
    L->heads[i] = head + 1;
    atomic_store(&s->head, head + 1);
    if (atomic_load(&psd_lslot_at(L->m, i)->waiters)) /* a hint the learner writes: at worst a wake too many */
        psd_cond_broadcast(&s->not_full);
}

static void evict(struct psd_loop *L, uint32_t i, struct psd_slot *s, uint32_t rule);

/* Whether an entry's piece map (the loop's copy) gives no tensor a gradient. */
static bool no_gradient(const struct psd_loop *L, const uint8_t *map) {
    for (uint64_t k = 0; k < L->n_pieces; k++)
        if (map[k] != PSD_PIECE_ABSENT)
            return false;
    return true;
}

/* An entry's staleness: the updates since its weights that moved any of its tensors, estimated as the
 * clock distance times the largest share of recent updates that moved one of them. A whole model's entry:
 * some tensor of it moved with every update (its own pushes move them all), share 1, the clock distance
 * exactly, whatever other learners' partial pushes do. A pipeline stage's (partial attach): the other
 * stages' updates, which the clock also counts, moved none of its tensors, so it counts its waves, not the
 * job's clock ticks (HetPipe's WSP). Until the running means settle (about PSD_STALENESS_WINDOW updates
 * after a server starts) a stage's count errs high, toward the clock distance. */
static double entry_staleness(const struct psd_loop *L, const uint8_t *map, uint64_t ticks) {
    double share = 0.0;
    for (uint64_t k = 0; k < L->n_pieces; k++)
        if (map[k] != PSD_PIECE_ABSENT && L->moved[k] > share)
            share = L->moved[k];
    if (share == 0.0 || share >= 1.0)
        return (double)ticks;
    return (double)ticks * share;
}

static void take_entry(struct psd_loop *L, uint32_t i, struct psd_slot *s, uint64_t head,
                       const struct psd_entry *eh) {
    struct psd_map *m = L->m;
    struct psd_header *h = psd_hdr(m);
    struct psd_entry *e = psd_entry_at(m, i, head);
    uint64_t clock = L->clock;
    /* eh->clock <= clock: checked by slot_rule. The counters, the histogram, --max-staleness and the
     * rounds' sum take the estimate rounded; the update itself the estimate. */
    double stale = entry_staleness(L, L->entry_map, clock - eh->clock);
    uint64_t staleness = (uint64_t)(stale + 0.5);
    bool summed = L->cfg.sync_mode == PSD_SYNC_BSP || L->cfg.sync_mode == PSD_SYNC_KASYNC;
    uint32_t outcome = PSD_OUTCOME_APPLIED;
    const float *g = psd_entry_grad(e);
    const uint8_t *map = L->entry_map;
    if (eh->claim != PSD_LOAD_RLX(&s->claims)) {
        /* Pushed by a learner that no longer owns the slot (taken back while it lived, and
         * handed on): never applied, never a contribution to a round; counted. */
        PSD_ADD_RLX(&s->ignored, 1);
        PSD_ADD_RLX(&h->ignored, 1);
        e->applied_clock = clock;
        e->outcome = PSD_OUTCOME_IGNORED;
        hand_back(L, i, s, head);
        return;
    }
    PSD_STORE_RLX(&L->nonfinite, 0);
    if ((eh->flags & PSD_ENTRY_NONFINITE) || !sparse_taken(L, map)) {
        outcome = PSD_OUTCOME_REJECTED;
        PSD_ADD_RLX(&s->rejected, 1);
        PSD_ADD_RLX(&h->rejected, 1);
    } else if (staleness > L->cfg.max_staleness) {
        outcome = PSD_OUTCOME_DROPPED;
        PSD_ADD_RLX(&s->dropped, 1);
        PSD_ADD_RLX(&h->dropped, 1);
    } else if (no_gradient(L, map)) {
        /* A step that carried no gradient (every tensor absent: a framework's step after a skipped
         * backward, say) is taken, and counts as the learner's step, but is no update: the clock does
         * not move, and it is no kasync gradient (bsp: the learner has joined the round, with nothing). */
    } else if (!summed) {
        update_weights(L, g, map, 1.0f, stale, 0);
    } else {
        accumulate(L, g, map);
        PSD_ADD_RLX(&h->acc_staleness, staleness);
        PSD_ADD_RLX(&h->acc_count, 1);
    }
    if (outcome == PSD_OUTCOME_APPLIED) {
        if (eh->flags & PSD_ENTRY_BUFFERS) {
            /* Real-valued statistics: the learner's running average, which started from the job's
             * value it last pulled, becomes the job's (adding its change instead would feed the
             * learners' delays back into the average, which then oscillates). Counters: the
             * learner's increments add up, so they count every learner's batches. */
            double *b = psd_buffers(m);
            const double *d = psd_entry_bufdelta(m, e);
            uint64_t set = L->buffers_set < m->g.n_buffers ? L->buffers_set : m->g.n_buffers, bad = 0;
            /* A partial attach sets only its own real-valued buffers (the range slot_rule checked). */
            uint64_t lo = 0, hi = set;
            if (eh->flags & PSD_ENTRY_BUF_RANGE)
                lo = eh->buf_lo, hi = eh->buf_hi;
            for (uint64_t j = 0; j < m->g.n_buffers; j++) {
                if (j < set && (j < lo || j >= hi))
                    continue; /* the job's value stays */
                double x = d[j]; /* loaded once: a non-finite value leaves the job's as it was */
                uint64_t bits;
                memcpy(&bits, &x, sizeof bits);
                if ((bits & UINT64_C(0x7ff0000000000000)) == UINT64_C(0x7ff0000000000000))
                    bad++;
                else
                    b[j] = j < set ? x : b[j] + x;
            }
            if (bad)
                PSD_ADD_RLX(&L->nonfinite, bad);
        }
        count_applied(m, s, eh, staleness);
    }
    /* Values the learner marked finite that were not where the loop read them: applied as zeros,
     * and the learner is evicted below (its memory changed after its own check). */
    uint64_t nonfinite = PSD_LOAD_RLX(&L->nonfinite);
    if (L->cfg.sync_mode == PSD_SYNC_BSP) {
        PSD_STORE_RLX(&s->round_joined, PSD_LOAD_RLX(&h->rounds) + 1);
        PSD_ADD_RLX(&h->acc_members, 1);
    }
    /* kasync: the K-th gradient completes the round before its entry is handed
     * back, so a learner whose ring drained sees the update. */
    bool rounded = L->cfg.sync_mode == PSD_SYNC_KASYNC && PSD_LOAD_RLX(&h->acc_count) >= L->cfg.sync_param;
    if (rounded)
        finish_round(L, i + 1, head);
    e->applied_clock = clock;
    e->outcome = outcome;
    hand_back(L, i, s, head);
    if (rounded)
        end_round(h);
    if (nonfinite)
        evict(L, i, s, PSD_RULE_VALUES);
}

/* bsp: the round is complete once every active learner contributed. */
static bool round_complete(struct psd_map *m) {
    struct psd_header *h = psd_hdr(m);
    if (PSD_LOAD_RLX(&h->acc_members) == 0)
        return false;
    for (uint32_t i = 0; i < m->g.n_slots; i++) {
        struct psd_slot *s = psd_slot_at(m, i);
        if (PSD_LOAD_ACQ(&s->state) == PSD_SLOT_ACTIVE && !joined_this_round(h, s))
            return false;
    }
    return true;
}

/* A draining slot whose ring is empty: account for it and hand it back. `head` stays where it is
 * (answer() zeroes head and tail at the next admission): a server killed before the state store
 * leaves a DRAINING slot whose ring the next loop finds empty, never entries to take again. */
static void free_slot(struct psd_loop *L, uint32_t i, struct psd_slot *s) {
    struct psd_header *h = psd_hdr(L->m);
    struct psd_lslot *l = psd_lslot_at(L->m, i);
    bool reaped = PSD_LOAD_RLX(&s->reap_reason) != PSD_REAP_NONE; /* taken back by the reaper */
    uint64_t took = L->heads[i];
    /* Store-releases: pair with the reaper's load-acquires (psd_reap); a reaper that reads the
     * cleared identity also sees the slot DRAINING. */
    PSD_STORE_REL(&s->pid, 0);
    PSD_STORE_RLX(&s->rank, -1);
    PSD_STORE_REL(&s->start_time, 0);
    /* Its request line holds no request: the owner's answered nonce, or whatever it wrote since
     * (no claimer takes the line of a slot that is not FREE). */
    uint64_t left = PSD_LOAD_RLX(&l->req_nonce);
    if (left != PSD_LOAD_RLX(&s->answered) && left != PSD_NONCE_WRITING)
        atomic_compare_exchange_strong(&l->req_nonce, &left, 0);
    /* Pairs with the load-acquire of state in psd_slot_claim and the waits; only this thread
     * moves ACTIVE and DRAINING slots (the reaper only posts its judgement, and frees EVICTED ones). */
    PSD_STORE_REL(&s->state, PSD_SLOT_FREE);
    L->heads[i] = 0;
    PSD_ADD_RLX(&h->retired_pushed, took); /* what the loop took from this ring */
    if (reaped)
        PSD_ADD_RLX(&h->reclaimed, 1);
    PSD_STORE_RLX(&s->reap_reason, PSD_REAP_NONE);
    psd_cond_broadcast(&s->not_full); /* a detaching learner waits for this */
}

/* The rule a learner's memory breaks (enum psd_rule), checked before each entry is taken: every
 * value a learner writes and the loop uses is checked first. `tail` is the loop's one load of it;
 * the entry's header is copied into *eh and its piece map into L->entry_map, and only the copies
 * are used afterwards. */
static uint32_t slot_rule(struct psd_loop *L, uint32_t i, uint64_t head, uint64_t tail, struct psd_entry *eh) {
    const struct psd_map *m = L->m;
    if (tail - head > m->g.ring_k)
        return PSD_RULE_TAIL;
    if (head == tail)
        return PSD_RULE_NONE;
    struct psd_entry *e = psd_entry_at(m, i, head);
    memcpy(eh, e, sizeof *eh);
    if (eh->seq != head)
        return PSD_RULE_SEQ;
    if (eh->flags & ~(PSD_ENTRY_NONFINITE | PSD_ENTRY_BUFFERS | PSD_ENTRY_BUF_RANGE))
        return PSD_RULE_FLAGS;
    if ((eh->flags & PSD_ENTRY_BUF_RANGE) &&
        (!(eh->flags & PSD_ENTRY_BUFFERS) || eh->buf_lo > eh->buf_hi || eh->buf_hi > L->buffers_set ||
         eh->buf_hi > m->g.n_buffers))
        return PSD_RULE_BUFFERS;
    if (eh->batch_size > PSD_MAX_BATCH)
        return PSD_RULE_BATCH;
    if (eh->clock > L->clock) /* computed on weights the server never had */
        return PSD_RULE_CLOCK;
    memcpy(L->entry_map, psd_entry_pieces(m, e), L->n_pieces);
    if (!pieces_well_formed(L, psd_entry_grad(e), L->entry_map))
        return PSD_RULE_PIECES;
    return PSD_RULE_NONE;
}

/* A learner broke a rule: the slot becomes EVICTED at once, without taking anything more from
 * its ring (its tail cannot be trusted; what it pushed and was applied stays counted: pushed ==
 * applied + rejected + dropped holds for the others). The record keeps who it was, so that
 * process gets no slot again; the reaper frees the slot once that process is gone. Its next
 * push fails with PSD_ESLOT, and a wait it is in (for ring space, a head, a drain, a round) ends at
 * once with PSD_EEVICTED. */
static void evict(struct psd_loop *L, uint32_t i, struct psd_slot *s, uint32_t rule) {
    struct psd_header *h = psd_hdr(L->m);
    uint32_t st = PSD_LOAD_ACQ(&s->state);
    if (st != PSD_SLOT_ACTIVE && st != PSD_SLOT_DRAINING)
        return;
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    PSD_ADD_RLX(&h->retired_pushed, L->heads[i]); /* what the loop took from this ring */
    PSD_STORE_RLX(&s->evicted_pid, PSD_LOAD_RLX(&s->pid));
    PSD_STORE_RLX(&s->evicted_start_time, PSD_LOAD_RLX(&s->start_time));
    PSD_STORE_RLX(&s->evicted_pid_ns, PSD_LOAD_RLX(&s->pid_ns));
    PSD_STORE_RLX(&s->evicted_rule, rule);
    PSD_STORE_RLX(&s->evicted_entries, L->heads[i]);
    PSD_STORE_RLX(&s->evicted_unix_ns, (uint64_t)now.tv_sec * 1000000000ull + (uint64_t)now.tv_nsec);
    PSD_STORE_RLX(&h->evicted_pid, PSD_LOAD_RLX(&s->pid));
    PSD_STORE_RLX(&h->evicted_rank, PSD_LOAD_RLX(&s->rank));
    PSD_STORE_RLX(&h->evicted_rule, rule);
    L->heads[i] = 0; /* s->head stays: nothing is taken from an evicted ring, by this loop or the next */
    PSD_STORE_RLX(&s->lease_seen_ns, 0); /* the reaper judges the evicted process afresh */
    /* Only this thread moves ACTIVE and DRAINING slots. Pairs with the load-acquire of state
     * everywhere. */
    PSD_STORE_REL(&s->state, PSD_SLOT_EVICTED);
    /* Pairs with the load-acquire of evicted in the server's watch (evicted_pid, _rank and _rule). */
    PSD_STORE_REL(&h->evicted, PSD_LOAD_RLX(&h->evicted) + 1);
    psd_cond_broadcast(&s->not_full);
    psd_cond_broadcast(&h->sync_cond); /* a learner waiting on this one's progress goes on */
}

/* One round over all rings; returns how many gradients it applied, and in
 * *busy how many learner slots are in use (counted over every slot: a pause
 * ends the taking, not the count). */
static uint32_t round_robin(struct psd_loop *L, uint32_t *busy) {
    struct psd_map *m = L->m;
    struct psd_header *h = psd_hdr(m);
    uint32_t applied = 0;
    bool bsp = L->cfg.sync_mode == PSD_SYNC_BSP, paused = false;
    *busy = 0;
    for (uint32_t i = 0; i < m->g.n_slots; i++) {
        struct psd_slot *s = psd_slot_at(m, i);
        /* Pairs with the store-release of state in psd_admit / the reaper's compare-exchange. */
        uint32_t st = PSD_LOAD_ACQ(&s->state);
        if (st != PSD_SLOT_ACTIVE && st != PSD_SLOT_DRAINING)
            continue;
        ++*busy;
        if (paused)
            continue;
        uint64_t head = L->heads[i];
        /* Pairs with the store of tail in psd_push: the entry is whole. Loaded once. */
        uint64_t tail = PSD_LOAD_ACQ(&psd_lslot_at(m, i)->tail);
        struct psd_entry eh;
        uint32_t rule = slot_rule(L, i, head, tail, &eh);
        if (rule != PSD_RULE_NONE) {
            evict(L, i, s, rule);
            continue;
        }
        if (head != tail) {
            /* bsp: one gradient per learner per round; the rest wait for the next. */
            if (bsp && joined_this_round(h, s))
                continue;
            take_entry(L, i, s, head, &eh);
            applied++;
            /* A pause (a snapshot) is honoured between two updates: the pass takes no more. */
            paused = psd_loop_should_pause(m);
        } else if (st == PSD_SLOT_DRAINING) {
            free_slot(L, i, s);
        }
    }
    if (bsp && round_complete(m)) {
        finish_round(L, 0, 0);
        end_round(h);
        applied++;
    }
    return applied;
}

static bool any_pending(struct psd_loop *L) {
    struct psd_map *m = L->m;
    struct psd_header *h = psd_hdr(m);
    for (uint32_t i = 0; i < m->g.n_slots; i++) {
        struct psd_slot *s = psd_slot_at(m, i);
        struct psd_lslot *l = psd_lslot_at(m, i);
        uint32_t st = atomic_load(&s->state);
        /* A claim request or a release to answer (the claimer rings the doorbell after posting it). */
        if ((st == PSD_SLOT_FREE && atomic_load(&l->req_nonce) != 0 &&
             atomic_load(&l->req_nonce) != PSD_LOAD_RLX(&s->answered)) ||
            (st == PSD_SLOT_ACTIVE && atomic_load(&l->release) == PSD_LOAD_RLX(&s->claims)))
            return true;
        if (st != PSD_SLOT_ACTIVE && st != PSD_SLOT_DRAINING)
            continue;
        /* seq_cst load: the other half of the Dekker pair in psd_push. */
        if (atomic_load(&l->tail) == L->heads[i]) {
            if (st == PSD_SLOT_DRAINING)
                return true; /* to be freed */
            continue;
        }
        /* bsp: a learner that already gave this round its gradient waits for the others. */
        if (L->cfg.sync_mode == PSD_SYNC_BSP && joined_this_round(h, s))
            continue;
        return true;
    }
    return false;
}

/* Adaptive spinning: after a gradient, keep spinning for about twice the
 * recent gap between gradients (so a steady learner never finds the loop
 * asleep and pays for waking it), but only while the learners and this loop
 * fit on the cores; otherwise the spin would steal a learner's core. */
#define PSD_SPIN_MAX_NS (2ull * 1000 * 1000)

static uint64_t spin_budget(const struct psd_loop *L, uint64_t gap_ewma, uint32_t busy) {
    if (busy + L->threads > L->cpus && gap_ewma)
        return 0; /* learners are waiting for a core: nap instead (below) */
    uint64_t spin = L->spin_ns;
    if (2 * gap_ewma > spin)
        spin = 2 * gap_ewma < PSD_SPIN_MAX_NS ? 2 * gap_ewma : PSD_SPIN_MAX_NS;
    return spin;
}

/* Napping: when the learners and this loop do not fit on the cores, spinning
 * would steal a learner's core, and sleeping on the doorbell would make every
 * push pay for a wake-up (a futex call and an inter-processor interrupt, tens
 * of microseconds in a VM). While gradients keep coming, the loop instead
 * naps and then drains what came meanwhile; a learner never rings. A nap lasts
 * half the time a learner takes to fill its ring (ring_k gradients, one every
 * `busy` gaps), so each wake-up finds several gradients and no learner waits
 * for ring space; if learners do fill their rings, the gaps measured shrink
 * and so do the naps. Not under bsp, while learners wait for the slowest
 * (ssp), or where each learner waits for its own gradient after a push (asp and
 * ssp, where psd_learners_wait_for_their_own says so): they hold no core then, and a
 * nap would only add to their wait. After PSD_NAP_WINDOW_NS without a gradient
 * the loop sleeps on the doorbell, so an idle server still costs nothing.
 * (`busy` counts attached learners, busy or not: an idle one makes naps
 * longer until the busy ones fill their rings and the gaps measured shrink.) */
#define PSD_NAP_MIN_NS (UINT64_C(10) * 1000)
#define PSD_NAP_MAX_NS (UINT64_C(500) * 1000)
#define PSD_NAP_WINDOW_NS (UINT64_C(20) * 1000 * 1000)

static uint64_t nap_length(const struct psd_loop *L, uint64_t gap_ewma, uint32_t busy, uint64_t idle_ns) {
    struct psd_header *h = psd_hdr(L->m);
    struct psd_map *m = L->m;
    if (busy + L->threads <= L->cpus || !gap_ewma || idle_ns >= PSD_NAP_WINDOW_NS)
        return 0;
    /* Learners blocked on a round or on the slowest peer use no core, and the gradient that
     * releases them must not wait out a nap: sleep on the doorbell instead. */
    if (L->cfg.sync_mode == PSD_SYNC_BSP ||
        psd_learners_wait_for_their_own(&L->cfg) ||
        PSD_LOAD_RLX(&h->sync_cond.waiters))
        return 0;
    uint64_t nap = m->g.ring_k * busy * gap_ewma / 2;
    return nap < PSD_NAP_MIN_NS ? PSD_NAP_MIN_NS : nap > PSD_NAP_MAX_NS ? PSD_NAP_MAX_NS : nap;
}

static void *loop_main(void *arg) {
    struct psd_loop *L = arg;
#ifdef PR_SET_TIMERSLACK
    prctl(PR_SET_TIMERSLACK, 1000UL, 0UL, 0UL, 0UL); /* naps of 10 us, not the default 50 us of slack */
#endif
    struct psd_header *h = psd_hdr(L->m);
    /* last_work: when the last gradient was taken (the gaps between them feed
     * gap_ewma); spin_from: when the current spin began. */
    uint64_t now = psd_now_ns(), last_work = now, spin_from = now, gap_ewma = 0;
    uint32_t busy = 0;
    bool recovered = false;
    while (!atomic_load_explicit(&L->stop, memory_order_acquire)) {
        if (psd_loop_should_pause(L->m)) {
            psd_loop_pause(L->m, &L->stop);
            continue;
        }
        if (psd_loop_should_hold(L->m)) { /* a hold at the current clock: apply nothing until it moves */
            psd_loop_hold(L->m, &L->stop);
            continue;
        }
        if (!recovered) { /* before anything is taken, after a snapshot or hold in progress: the last server may
                           * have died finishing a round */
            recover_round(L);
            recovered = true;
            continue;
        }
        uint32_t applied = psd_admit(L->m) + round_robin(L, &busy);
        if (busy != L->learners && L->cfg.async_momentum == PSD_ASYNC_MOMENTUM_AUTO)
            note_learners(L, busy);
        now = psd_now_ns();
        psd_beat_at(&L->beat, now);
        if (applied) {
            /* The mean gap between the gradients this pass found (a pass after a nap finds all
             * that arrived during it), so that naps track the learners' pace, not their own. */
            uint64_t gap = (now - last_work) / applied;
            gap = gap < PSD_SPIN_MAX_NS ? gap : PSD_SPIN_MAX_NS;
            gap_ewma = gap_ewma ? (7 * gap_ewma + gap) / 8 : gap;
            last_work = spin_from = now;
            continue;
        }
        if (now - spin_from < spin_budget(L, gap_ewma, busy)) {
            psd_cpu_relax();
            continue;
        }
        uint64_t nap = nap_length(L, gap_ewma, busy, now - last_work);
        if (nap) {
            struct timespec ts = {.tv_sec = 0, .tv_nsec = (long)nap};
            nanosleep(&ts, NULL);
            continue;
        }
        uint32_t seen = atomic_load(&h->doorbell.seq);
        atomic_store(&h->sleeping, 1); /* seq_cst: the loop's half of the Dekker pair */
        if (!any_pending(L) && !atomic_load(&L->stop) && !psd_loop_should_pause(L->m))
            psd_cond_wait(&h->doorbell, seen, PSD_HEARTBEAT_NS * 5);
        atomic_store(&h->sleeping, 0);
        now = psd_now_ns();
        PSD_STORE_RLX(&h->heartbeat_ns, now); /* read by psd_server_alive */
        L->beat.last = now;
        spin_from = now - L->spin_ns + L->spin_ns / 8; /* a short spin after waking */
    }
    return NULL;
}

static void loop_free(struct psd_loop *L) {
    free(L->heads);
    free(L->entry_map);
    free(L->dense);
    free(L->pieces);
    free(L->round_map);
    free(L->moved);
    free(L);
}

_Static_assert((PSD_CFG_KNOWN & PSD_CFG_LOOP_SQUARES_TAKEN) == 0, "the loop's own flag is never a stored one");

/* Copy the header's configuration into L as one unit and check it: known flags, optimizer, sync mode and
 * schedule, and the state vectors the arena was grown with. */
static bool take_config(struct psd_loop *L, const struct psd_map *m) {
    const struct psd_config *cfg = &L->cfg;
    L->cfg = psd_hdr(m)->cfg; /* written before the loop starts, never after: one copy */
    L->staleness_avg = psd_staleness_avg(psd_hdr(m)); /* the last server's running mean */
    L->staleness_held = psd_staleness_held(psd_hdr(m)); /* and its hold, which goes on */
    return !(cfg->cfg_flags & ~PSD_CFG_KNOWN) && cfg->async_momentum <= PSD_ASYNC_MOMENTUM_AUTO &&
           cfg->optimizer <= PSD_OPT_ADAGRAD &&
           cfg->sync_mode <= PSD_SYNC_KASYNC && cfg->schedule <= PSD_SCHED_COSINE &&
           psd_state_vectors(cfg->optimizer, cfg->sync_mode) == m->g.state_vectors;
}

int psd_loop_start(struct psd_map *m, uint32_t threads, uint32_t spin_us, const struct psd_piece_geom *pieces,
                   uint64_t n_pieces, uint64_t buffers_set, struct psd_loop **out) {
    if (!psd_has_model(m))
        return EINVAL;
    const struct psd_piece_geom whole = {0, m->g.n_train, 1};
    if (!pieces) {
        pieces = &whole;
        n_pieces = 1;
    }
    /* The pieces must tile the trainable prefix exactly, as the header says. */
    uint64_t off = 0;
    for (uint64_t k = 0; k < n_pieces; k++) {
        if (pieces[k].off != off || pieces[k].len == 0 || pieces[k].len > m->g.n_train - off ||
            pieces[k].row_len == 0 || pieces[k].len % pieces[k].row_len)
            return EINVAL;
        off += pieces[k].len;
    }
    if (off != m->g.n_train || n_pieces != m->g.n_pieces || buffers_set > m->g.n_buffers)
        return EINVAL;
    struct psd_loop *L = calloc(1, sizeof *L);
    if (!L)
        return ENOMEM;
    L->pieces = malloc(n_pieces * sizeof *L->pieces);
    L->round_map = malloc(n_pieces);
    L->moved = malloc(n_pieces * sizeof *L->moved);
    L->entry_map = malloc(n_pieces);
    L->heads = calloc(m->g.n_slots, sizeof *L->heads);
    if (!L->pieces || !L->round_map || !L->moved || !L->entry_map || !L->heads) {
        loop_free(L);
        return ENOMEM;
    }
    memcpy(L->pieces, pieces, n_pieces * sizeof *L->pieces);
    for (uint64_t k = 0; k < n_pieces; k++)
        L->moved[k] = 1.0;
    L->n_pieces = n_pieces;
    L->buffers_set = buffers_set;
    L->map = *m;
    L->m = &L->map;
    if (!take_config(L, m)) {
        loop_free(L);
        return EINVAL;
    }
    L->clock = PSD_LOAD_RLX(&psd_hdr(m)->clock); /* restored before READY, or the last server's */
    /* A test hook (tests/test_sync.py), as PSD_TEST_CRASH_AFTER: PSD_TEST_CRASH_IN_ROUND=N[:before|after|closed]
     * makes the loop SIGKILL its own process in round N's finish: before its update, after it (the default),
     * or once the round is closed, before the entry that finished it is handed back. Unset in a real job. */
    const char *crash = getenv("PSD_TEST_CRASH_IN_ROUND");
    if (crash) {
        char *rest;
        L->crash_round = strtoull(crash, &rest, 10);
        L->crash_stage = !strcmp(rest, ":before") ? CRASH_BEFORE : !strcmp(rest, ":closed") ? CRASH_CLOSED : CRASH_AFTER;
    }
    L->log = (struct psd_rowlog_writer){L->m, PSD_LOAD_RLX(&psd_hdr(m)->rowlog_head)};
    /* A new server starts each ring where the last one left it (a free slot's head is 0). The
     * load-acquire of state pairs with its store-release in claim / release / reap / free_slot. */
    for (uint32_t i = 0; i < m->g.n_slots; i++) {
        uint32_t st = PSD_LOAD_ACQ(&psd_slot_at(m, i)->state);
        L->heads[i] = st == PSD_SLOT_ACTIVE || st == PSD_SLOT_DRAINING ? PSD_LOAD_RLX(&psd_slot_at(m, i)->head) : 0;
        L->learners += st == PSD_SLOT_ACTIVE || st == PSD_SLOT_DRAINING; /* no departure at a restart */
    }
    L->threads = threads ? threads : 1;
    L->spin_ns = (uint64_t)spin_us * 1000;
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    L->cpus = cpus > 0 ? (uint32_t)cpus : 1;
    atomic_init(&L->stop, 0);
    L->beat = (struct psd_beat){&psd_hdr(m)->heartbeat_ns, psd_now_ns()};
    PSD_STORE_RLX(L->beat.at, L->beat.last);
    int rc = pthread_create(&L->thread, NULL, loop_main, L);
    if (rc) {
        loop_free(L);
        return rc;
    }
    *out = L;
    return 0;
}

int psd_loop_stop(struct psd_loop *L) {
    atomic_store_explicit(&L->stop, 1, memory_order_release);
    psd_cond_broadcast(&psd_hdr(L->m)->doorbell);
    int rc = pthread_join(L->thread, NULL);
    loop_free(L);
    return rc;
}
