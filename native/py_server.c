/*
 * py_server.c -- the server's side of the binding: creating and growing an
 * arena, the training configuration, starting and stopping the update loop,
 * reaping dead learners, pausing for snapshots, restoring a checkpoint, and
 * what the watchdog notes in the header.
 */
#include "py_psd.h"

#include <time.h>

static PyObject *mod_create(PyObject *self, PyObject *args) {
    (void)self;
    const char *name, *version;
    unsigned int mode, n_slots, ring_k;
    unsigned long long spec_cap;
    if (!PyArg_ParseTuple(args, "sIIIKs", &name, &mode, &n_slots, &ring_k, &spec_cap, &version))
        return NULL;
    Arena *a = new_arena(name);
    if (!a)
        return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = psd_arena_create(&a->map, name, (mode_t)mode, n_slots, ring_k, spec_cap, version);
    Py_END_ALLOW_THREADS if (rc) {
        Py_DECREF(a);
        return raise_code(rc, "create arena", name);
    }
    return (PyObject *)a;
}

static PyObject *arena_grow(Arena *a, PyObject *noargs) {
    (void)noargs;
    if (check_role(a, PSD_ROLE_FULL))
        return NULL;
    if (a->exports)
        return raise_code(PSD_EEXPORTS, "grow arena", NULL);
    if (a->loop) /* the loop has a copy of this mapping: growing would move it under the loop */
        return raise_code(PSD_ESTATE, "grow arena (the update loop runs on it; the state went back by a stray "
                                      "write?)", a->name);
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = psd_arena_grow(&a->map);
    Py_END_ALLOW_THREADS if (rc) return raise_code(rc, "grow arena", a->name);
    Py_RETURN_NONE;
}

static PyObject *arena_set_state(Arena *a, PyObject *args) {
    unsigned int st;
    const char *msg = NULL;
    if (!PyArg_ParseTuple(args, "I|z", &st, &msg) ||
        check_role(a, a->map.role == PSD_ROLE_LEARNER && a->map.offering ? PSD_ROLE_LEARNER : PSD_ROLE_FULL))
        return NULL;
    if (msg) {
        struct psd_header *h = psd_hdr(&a->map);
        snprintf(h->fail_msg, PSD_MSG_LEN, "%s", msg);
    }
    psd_arena_set_state(&a->map, st);
    Py_RETURN_NONE;
}

static PyObject *arena_reap(Arena *a, PyObject *noargs) {
    (void)noargs;
    if (check_role(a, PSD_ROLE_FULL))
        return NULL;
    int32_t pids[PSD_MAX_SLOTS];
    uint32_t n = 0;
    int rc = psd_reap(&a->map, pids, PSD_MAX_SLOTS, &n);
    if (rc)
        return raise_code(rc, "reap dead learners", a->name);
    PyObject *list = PyList_New(n);
    if (!list)
        return NULL;
    for (uint32_t i = 0; i < n; i++)
        PyList_SET_ITEM(list, i, PyLong_FromLong(pids[i]));
    return list;
}

static PyObject *arena_become_server(Arena *a, PyObject *args) {
    int pid;
    unsigned long long start;
    double lr;
    unsigned int threads, spin_us;
    if (!PyArg_ParseTuple(args, "iKdII", &pid, &start, &lr, &threads, &spin_us) || check_role(a, PSD_ROLE_FULL))
        return NULL;
    struct psd_header *h = psd_hdr(&a->map);
    h->cfg.lr = lr;
    h->cfg.threads = threads;
    h->cfg.spin_us = spin_us;
    h->server_start_time = start;
    h->server_pid_ns = psd_pid_ns(); /* learners in another PID namespace go by the heartbeat */
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    h->server_started_unix_ns = (uint64_t)now.tv_sec * 1000000000ull + (uint64_t)now.tv_nsec;
    atomic_store(&h->server_pid, pid);
    /* Pairs with the learners' load of generation: a new server is visible. */
    uint64_t gen = atomic_fetch_add(&h->generation, 1) + 1;
    if (gen > 1) {
        atomic_fetch_add(&h->server_restarts, 1);
        /* The last server may have died inside an update, its weights written and not logged. */
        atomic_fetch_add_explicit(&h->weights_epoch, 1, memory_order_release);
        /* Or paused (a snapshot) or held (a node link): its loop's flags, which a pauser or holder takes for this
         * server's. Left set, a snapshot would copy the weights while this server's loop writes them. */
        atomic_store(&h->paused, 0);
        atomic_store(&h->held, 0);
    }
    return PyLong_FromUnsignedLongLong(gen);
}

/* Server: the training configuration (before the arena is grown: the
 * optimizer and sync mode size the optimizer state). */
static PyObject *arena_configure(Arena *a, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"optimizer", "sync", "sync_param", "push_every", "schedule", "staleness_lr",
                             "predict", "momentum", "dampening", "beta1", "beta2", "eps", "weight_decay",
                             "lr_decay", "gamma", "eta_min", "step_size", "t_max", "warmup", "max_staleness",
                             "async_momentum", "lease_ms", "lease_only", "grad_bf16", "overlap", "nodes", "node_lag",
                             NULL};
    const char *opt = "sgd", *sync = "asp", *sched = "constant";
    unsigned int sync_param = 0, push_every = 1, async_momentum = 0, lease_ms = PSD_LEASE_MS_DEFAULT;
    int staleness_lr = 0, predict = 0, lease_only = 0, grad_bf16 = 0;
    unsigned int overlap = 0; /* choices.OVERLAP: 0 auto, 1 on, 2 off */
    unsigned int nodes = 1;
    double node_lag = 0;
    double momentum = 0, dampening = 0, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, wd = 0, lr_decay = 0,
           gamma = 0.1, eta_min = 0;
    unsigned long long step_size = 0, t_max = 0, warmup = 0, max_staleness = UINT64_MAX;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|ssIIsppdddddddddKKKKIIppIId", kwlist, &opt, &sync, &sync_param,
                                     &push_every, &sched, &staleness_lr, &predict, &momentum, &dampening,
                                     &beta1, &beta2, &eps, &wd, &lr_decay, &gamma, &eta_min, &step_size,
                                     &t_max, &warmup, &max_staleness, &async_momentum, &lease_ms, &lease_only,
                                     &grad_bf16, &overlap, &nodes, &node_lag) ||
        check_role(a, PSD_ROLE_FULL))
        return NULL;
    int o = name_index("optimizer", opt, optimizer_names, N_OPTIMIZERS), y = name_index("sync mode", sync, sync_names, N_SYNCS),
        c = name_index("schedule", sched, schedule_names, N_SCHEDULES);
    if (o < 0 || y < 0 || c < 0)
        return NULL;
    if (!(node_lag >= 0.0 && node_lag < 1e18)) {
        PyErr_Format(PyExc_ValueError, "node_lag must be a finite number >= 0, not %g", node_lag);
        return NULL;
    }
    if (overlap > 2) {
        PyErr_Format(PyExc_ValueError, "overlap must be 0 (auto), 1 (on) or 2 (off), not %u", overlap);
        return NULL;
    }
    struct psd_header *h = psd_hdr(&a->map);
    h->cfg.optimizer = (uint32_t)o;
    h->cfg.sync_mode = (uint32_t)y;
    h->cfg.sync_param = sync_param;
    h->cfg.push_every = push_every ? push_every : 1;
    h->cfg.schedule = (uint32_t)c;
    h->cfg.cfg_flags = (staleness_lr ? PSD_CFG_STALENESS_LR : 0) | (predict ? PSD_CFG_PREDICT : 0) |
                       (lease_only ? PSD_CFG_LEASE_ONLY : 0) | (grad_bf16 ? PSD_CFG_GRAD_BF16 : 0) |
                       (overlap == 1 ? PSD_CFG_OVERLAP : 0) | (overlap == 2 ? PSD_CFG_NO_OVERLAP : 0);
    h->cfg.lease_ms = lease_ms ? lease_ms : PSD_LEASE_MS_DEFAULT;
    h->cfg.momentum = momentum;
    h->cfg.async_momentum = async_momentum;
    h->cfg.nodes = nodes;
    h->cfg.node_lag = node_lag;
    h->cfg.dampening = dampening;
    h->cfg.beta1 = beta1;
    h->cfg.beta2 = beta2;
    h->cfg.eps = eps;
    h->cfg.weight_decay = wd;
    h->cfg.lr_decay = lr_decay;
    h->cfg.gamma = gamma;
    h->cfg.eta_min = eta_min;
    h->cfg.step_size = step_size;
    h->cfg.t_max = t_max;
    h->cfg.warmup = warmup;
    h->cfg.max_staleness = max_staleness;
    Py_RETURN_NONE;
}

/* start_loop(pieces=None, buffers_set=0): pieces lists (len, row_len) of
 * every trainable tensor in spec order (None: the model is one tensor);
 * buffers_set: leading buffer elements that entries set rather than add to. */
static PyObject *arena_start_loop(Arena *a, PyObject *args) {
    PyObject *po = Py_None;
    unsigned long long buffers_set = 0;
    if (!PyArg_ParseTuple(args, "|OK", &po, &buffers_set) || check_role(a, PSD_ROLE_FULL))
        return NULL;
    struct psd_header *h = psd_hdr(&a->map);
    if (a->loop) {
        PyErr_SetString(PyExc_RuntimeError, "update loop already running");
        return NULL;
    }
    if (PSD_LOAD_ACQ(&h->state) != PSD_ARENA_READY)
        return raise_code(PSD_ESTATE, "start update loop", a->name);
    struct psd_piece_geom *pieces = NULL;
    Py_ssize_t n = 0;
    if (po != Py_None) {
        PyObject *seq = PySequence_Fast(po, "start_loop: pieces must be a sequence of (len, row_len)");
        if (!seq)
            return NULL;
        n = PySequence_Fast_GET_SIZE(seq);
        pieces = PyMem_Calloc((size_t)n + 1, sizeof *pieces);
        uint64_t off = 0;
        for (Py_ssize_t k = 0; pieces && k < n; k++) {
            unsigned long long len, row_len;
            if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, k), "KK", &len, &row_len))
                break;
            pieces[k] = (struct psd_piece_geom){off, len, row_len};
            off += len;
        }
        Py_DECREF(seq);
        if (!pieces)
            return PyErr_NoMemory();
        if (PyErr_Occurred()) {
            PyMem_Free(pieces);
            return NULL;
        }
    }
    int rc = psd_loop_start(&a->map, h->cfg.threads, h->cfg.spin_us, pieces, (uint64_t)n, buffers_set, &a->loop);
    PyMem_Free(pieces);
    if (rc == EINVAL) {
        PyErr_SetString(PyExc_ValueError, "start_loop: the pieces do not tile the job's trainable weights, or the "
                                          "configuration is not one this psd knows (optimizer, sync mode, schedule, "
                                          "--async-momentum, flags, or state vectors other than the arena was grown "
                                          "with)");
        return NULL;
    }
    if (rc)
        return raise_code(rc, "start update loop", a->name);
    Py_RETURN_NONE;
}

static PyObject *arena_stop_loop(Arena *a, PyObject *noargs) {
    (void)noargs;
    stop_loop(a);
    Py_RETURN_NONE;
}

static PyObject *arena_pause(Arena *a, PyObject *args) {
    int pid;
    unsigned long long start;
    double timeout;
    if (!PyArg_ParseTuple(args, "iKd", &pid, &start, &timeout) || check_role(a, PSD_ROLE_FULL))
        return NULL;
    int rc;
    uint64_t deadline = psd_now_ns() + seconds_to_ns(timeout);
    /* A signal takes the pause request back (psd_pause): a handler that returns (the watchdog's SIGCHLD,
     * another SIGUSR1) asks again for what is left of the timeout. It raised InterruptedError, and the
     * watchdog died with its checkpoint half made. */
    BLOCKING(rc, psd_pause(&a->map, pid, start, psd_left_ns(deadline)));
    if (rc)
        return raise_code(rc, "pause the update loop", a->name);
    Py_RETURN_NONE;
}

static PyObject *arena_hold(Arena *a, PyObject *args) {
    int pid;
    unsigned long long start;
    long long clock;
    if (!PyArg_ParseTuple(args, "iKL", &pid, &start, &clock) || check_role(a, PSD_ROLE_FULL))
        return NULL;
    psd_hold(&a->map, pid, start, (int64_t)clock);
    Py_RETURN_NONE;
}

/* note_weights_written(): the weights were written outside an update (the node link's exchange):
 * learners that pull only what the rows log names copy everything at their next pull. */
static PyObject *arena_note_weights_written(Arena *a, PyObject *noargs) {
    (void)noargs;
    if (check_role(a, PSD_ROLE_FULL))
        return NULL;
    /* Pairs with a learner's load-acquire of weights_epoch (psd_pull_changed, psd_rowlog_mark). */
    atomic_fetch_add_explicit(&psd_hdr(&a->map)->weights_epoch, 1, memory_order_release);
    Py_RETURN_NONE;
}

static PyObject *arena_resume(Arena *a, PyObject *noargs) {
    (void)noargs;
    if (check_role(a, PSD_ROLE_FULL))
        return NULL;
    psd_resume(&a->map);
    Py_RETURN_NONE;
}

static PyObject *arena_beat(Arena *a, PyObject *noargs) {
    (void)noargs;
    if (check_role(a, PSD_ROLE_FULL))
        return NULL;
    PSD_STORE_RLX(&psd_hdr(&a->map)->heartbeat_ns, psd_now_ns());
    Py_RETURN_NONE;
}

/* Quarantine a slot per eviction record of a checkpoint (tuples of pid, start_time, pid_ns, rule,
 * unix_ns, entries, rank), as the update loop left them: that process is refused a slot again, and the
 * reaper frees the slot once it is gone. Records beyond the slots are dropped. */
static int restore_evicted(Arena *a, PyObject *records) {
    if (!psd_has_model(&a->map)) {
        PyErr_SetString(PyExc_RuntimeError, "restore eviction records: the arena holds no model yet");
        return -1;
    }
    PyObject *seq = PySequence_Fast(records, "evicted must be a sequence of tuples");
    if (!seq)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    for (Py_ssize_t k = 0; k < n && (uint64_t)k < a->map.g.n_slots; k++) {
        int pid, rank;
        unsigned int rule;
        unsigned long long start, ns, unix_ns, entries;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, k), "iKKIKKi", &pid, &start, &ns, &rule, &unix_ns,
                              &entries, &rank)) {
            Py_DECREF(seq);
            return -1;
        }
        struct psd_slot *s = psd_slot_at(&a->map, (uint32_t)k);
        if (PSD_LOAD_ACQ(&s->state) != PSD_SLOT_FREE)
            continue;
        PSD_STORE_RLX(&s->evicted_pid, pid);
        PSD_STORE_RLX(&s->evicted_start_time, start);
        PSD_STORE_RLX(&s->evicted_pid_ns, ns);
        PSD_STORE_RLX(&s->evicted_rule, rule);
        PSD_STORE_RLX(&s->evicted_unix_ns, unix_ns);
        PSD_STORE_RLX(&s->evicted_entries, entries);
        PSD_STORE_RLX(&s->rank, rank);
        PSD_STORE_RLX(&s->lease_seen_ns, 0); /* the reaper judges the evicted process afresh */
        PSD_STORE_REL(&s->state, PSD_SLOT_EVICTED);
    }
    Py_DECREF(seq);
    return 0;
}

static PyObject *arena_restore(Arena *a, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"clock",         "generation",     "ranks",         "opt_steps",
                             "rounds",        "acc_count",      "acc_staleness", "lr_now",
                             "evicted",       "round_applying", "round_applied", NULL};
    unsigned long long clock, generation, opt_steps = 0, rounds = 0, acc_count = 0, acc_staleness = 0;
    unsigned long long round_applying = 0, round_applied = 0;
    double lr_now = 0;
    PyObject *ranks, *evicted = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "KKO|KKKKdOKK", kwlist, &clock, &generation, &ranks, &opt_steps,
                                     &rounds, &acc_count, &acc_staleness, &lr_now, &evicted, &round_applying,
                                     &round_applied) ||
        check_role(a, PSD_ROLE_FULL))
        return NULL;
    struct psd_header *h = psd_hdr(&a->map);
    if (PSD_LOAD_ACQ(&h->state) == PSD_ARENA_READY)
        return raise_code(PSD_ESTATE, "restore a checkpoint into a running arena", a->name);
    if (evicted && evicted != Py_None && restore_evicted(a, evicted) != 0)
        return NULL;
    PyObject *seq = PySequence_Fast(ranks, "ranks must be a sequence of ints");
    if (!seq)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    for (Py_ssize_t r = 0; r < n && (uint64_t)r < a->map.g.n_slots; r++) {
        unsigned long long v = PyLong_AsUnsignedLongLong(PySequence_Fast_GET_ITEM(seq, r));
        if (PyErr_Occurred()) {
            Py_DECREF(seq);
            return NULL;
        }
        PSD_STORE_RLX(&psd_rank_at(&a->map, (uint32_t)r)->applied, v);
    }
    Py_DECREF(seq);
    PSD_STORE_RLX(&h->clock, clock);
    PSD_STORE_RLX(&h->opt_steps, opt_steps);
    PSD_STORE_RLX(&h->rounds, rounds);
    PSD_STORE_RLX(&h->acc_count, acc_count);
    PSD_STORE_RLX(&h->acc_staleness, acc_staleness);
    PSD_STORE_RLX(&h->acc_members, 0);
    /* A round the snapshot's server was finishing: the loop finishes it (update.c recover_round). The entry that
     * finished it went with the rings. */
    PSD_STORE_RLX(&h->round_applied, round_applied);
    PSD_STORE_RLX(&h->round_slot, 0);
    PSD_STORE_RLX(&h->round_head, 0);
    PSD_STORE_RLX(&h->round_applying, round_applying);
    uint64_t lr_bits;
    memcpy(&lr_bits, &lr_now, sizeof lr_bits);
    PSD_STORE_RLX(&h->lr_bits, lr_bits);
    atomic_store(&h->generation, generation);
    Py_RETURN_NONE;
}

static PyObject *arena_note_watchdog(Arena *a, PyObject *args) {
    int pid;
    unsigned long long start;
    if (!PyArg_ParseTuple(args, "iK", &pid, &start) || check_role(a, PSD_ROLE_FULL))
        return NULL;
    struct psd_header *h = psd_hdr(&a->map);
    atomic_store(&h->watchdog_start_time, start);
    atomic_store(&h->watchdog_pid, pid);
    Py_RETURN_NONE;
}

static PyObject *arena_note_lineage(Arena *a, PyObject *args) {
    unsigned long long lineage, origin_unix_ns = 0, origin_clock = 0;
    if (!PyArg_ParseTuple(args, "K|KK", &lineage, &origin_unix_ns, &origin_clock) || check_role(a, PSD_ROLE_FULL))
        return NULL;
    struct psd_header *h = psd_hdr(&a->map);
    atomic_store(&h->origin_unix_ns, origin_unix_ns);
    atomic_store(&h->origin_clock, origin_clock);
    atomic_store(&h->lineage, lineage);
    Py_RETURN_NONE;
}

static PyObject *arena_note_checkpoint(Arena *a, PyObject *args) {
    unsigned long long clock, unix_ns;
    if (!PyArg_ParseTuple(args, "KK", &clock, &unix_ns) || check_role(a, PSD_ROLE_FULL))
        return NULL;
    struct psd_header *h = psd_hdr(&a->map);
    atomic_store(&h->checkpoint_clock, clock);
    atomic_store(&h->checkpoint_unix_ns, unix_ns);
    Py_RETURN_NONE;
}

/* set_gain_level(level, damping): how much of one process's momentum gain --async-momentum auto keeps, and
 * how much of the damping of staler-than-mean gradients it applies (psd/gain.py); the update loop reads
 * them at its next update. */
static PyObject *arena_set_gain_level(Arena *a, PyObject *args) {
    double level, damping;
    if (!PyArg_ParseTuple(args, "dd", &level, &damping) || check_role(a, PSD_ROLE_FULL))
        return NULL;
    if (!(level >= 0.0 && level <= 1.0) || !(damping >= 0.0 && damping <= 1.0)) {
        PyErr_Format(PyExc_ValueError, "the gain level and the damping are numbers from 0 to 1, not %g and %g",
                     level, damping);
        return NULL;
    }
    uint64_t bits;
    memcpy(&bits, &level, sizeof bits);
    PSD_STORE_RLX(&psd_hdr(&a->map)->gain_level_bits, bits);
    memcpy(&bits, &damping, sizeof bits);
    PSD_STORE_RLX(&psd_hdr(&a->map)->damping_bits, bits);
    Py_RETURN_NONE;
}

PyMethodDef py_server_methods[] = {
    {"grow", (PyCFunction)arena_grow, METH_NOARGS, "Server: grow the arena for the offered spec."},
    {"set_state", (PyCFunction)arena_set_state, METH_VARARGS, "set_state(state, message=None)"},
    {"reap", (PyCFunction)arena_reap, METH_NOARGS, "Server: mark slots of dead learners draining; returns their pids."},
    {"become_server", (PyCFunction)arena_become_server, METH_VARARGS,
     "become_server(pid, start_time, lr, threads, spin_us) -> generation"},
    {"configure", (PyCFunction)(void (*)(void))arena_configure, METH_VARARGS | METH_KEYWORDS,
     "Server: the training configuration (optimizer, sync mode, schedule, staleness control)."},
    {"start_loop", (PyCFunction)arena_start_loop, METH_VARARGS,
     "start_loop(pieces=None, buffers_set=0): Server: start the native update loop; pieces: (len, row_len) per "
     "trainable tensor; buffers_set: leading buffer elements that entries set (the rest they add to)."},
    {"stop_loop", (PyCFunction)arena_stop_loop, METH_NOARGS, "Server: stop the update loop and join it."},
    {"pause", (PyCFunction)arena_pause, METH_VARARGS,
     "pause(pid, start_time, timeout): stop the update loop between two gradients (for a snapshot)"},
    {"resume", (PyCFunction)arena_resume, METH_NOARGS, "Let a paused update loop go on."},
    {"hold", (PyCFunction)arena_hold, METH_VARARGS,
     "hold(pid, start_time, clock): the update loop stops right after the update that brings its clock to "
     "clock, or before any while it is there (clock < 0: no hold), until the hold is moved or cleared, or "
     "the holder dies; header()['held'] says it stopped"},
    {"note_weights_written", (PyCFunction)arena_note_weights_written, METH_NOARGS,
     "Server side: the weights were written outside an update; learners' next pulls copy them all."},
    {"beat", (PyCFunction)arena_beat, METH_NOARGS, "Server: store a heartbeat now."},
    {"restore", (PyCFunction)(void (*)(void))arena_restore, METH_VARARGS | METH_KEYWORDS,
     "restore(clock, generation, ranks, ..., evicted=[(pid, start_time, pid_ns, rule, unix_ns, entries, rank)], "
     "round_applying=0, round_applied=0): "
     "server, before READY: continue from a checkpoint"},
    {"note_watchdog", (PyCFunction)arena_note_watchdog, METH_VARARGS, "note_watchdog(pid, start_time)"},
    {"note_checkpoint", (PyCFunction)arena_note_checkpoint, METH_VARARGS, "note_checkpoint(clock, unix_ns)"},
    {"note_lineage", (PyCFunction)arena_note_lineage, METH_VARARGS,
     "note_lineage(lineage, origin_unix_ns=0, origin_clock=0): the job's lineage, which its checkpoints carry, and "
     "the checkpoint it was loaded from (psd_layout.h)"},
    {"set_gain_level", (PyCFunction)arena_set_gain_level, METH_VARARGS,
     "set_gain_level(level, damping): --async-momentum auto's gain level and damping, 0 to 1 (psd/gain.py)"},
    {NULL, NULL, 0, NULL},
};

PyMethodDef py_server_functions[] = {
    {"create", mod_create, METH_VARARGS,
     "create(shm_name, mode, n_slots, ring_k, spec_cap, version) -> Arena (server only)"},
    {NULL, NULL, 0, NULL},
};
