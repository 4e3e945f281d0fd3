/*
 * py_inspect.c -- reading an arena for `psd status`, metrics, the watchdog
 * and tests: the header and slot fields (listed once, in psd.h), the spec,
 * counters, indices, clocks and ranks. Nothing here writes shared memory.
 */
#include "py_psd.h"

#include <string.h>

/* d[key] = the new reference `o`; on failure drop d and return NULL from the caller. */
#define SET(d, key, o)                                                                             \
    do {                                                                                           \
        PyObject *o_ = (o);                                                                        \
        if (!o_ || PyDict_SetItemString((d), (key), o_)) {                                        \
            Py_XDECREF(o_);                                                                        \
            Py_DECREF(d);                                                                          \
            return NULL;                                                                           \
        }                                                                                          \
        Py_DECREF(o_);                                                                             \
    } while (0)

/* How each kind of field in PSD_HEADER_FIELDS / PSD_SLOT_FIELDS (psd.h) is read from the struct
 * at `o` and shown; geometry comes from this mapping's checked copy (`a` is the Arena). */
#define READ_PLAIN(o, f) PyLong_FromUnsignedLongLong((unsigned long long)(o)->f)
#define READ_FIXED(o, f) READ_PLAIN(&a->map.g, f)
#define READ_MODEL(o, f) PyLong_FromUnsignedLongLong(psd_has_model(&a->map) ? a->map.g.f : (o)->f)
#define READ_ATOMIC(o, f) PyLong_FromUnsignedLongLong((unsigned long long)atomic_load(&(o)->f))
#define READ_PID(o, f) PyLong_FromUnsignedLong((uint32_t)atomic_load(&(o)->f))
#define READ_PLAIN_PID(o, f) PyLong_FromUnsignedLong((uint32_t)(o)->f)
#define READ_SIGNED(o, f) PyLong_FromLong(atomic_load(&(o)->f))
#define READ_REAL(o, f) PyFloat_FromDouble((o)->f)
#define READ_BITS(o, f) PyFloat_FromDouble(bits_to_double(atomic_load(&(o)->f)))
#define READ_CFG(o, f) READ_PLAIN(&(o)->cfg, f)
#define READ_CFG_REAL(o, f) READ_REAL(&(o)->cfg, f)

static double bits_to_double(uint64_t bits) {
    double v;
    memcpy(&v, &bits, sizeof v);
    return v;
}

/* A fixed-size text field of the header, cut at its first NUL. */
static PyObject *text_field(const char *field, size_t cap) {
    return PyUnicode_DecodeUTF8(field, (Py_ssize_t)strnlen(field, cap), "replace");
}

/* The server's current learning rate: the scheduled lr of the last update (before any, that of the
 * first one), as `psd status` and a learner's Optimizer.param_groups show it. */
static double current_lr(struct psd_header *h) {
    /* Pairs with the store-release of opt_steps in update_weights, which follows that of lr_bits. */
    if (PSD_LOAD_ACQ(&h->opt_steps) == 0)
        return psd_scheduled_lr(&h->cfg, 0);
    return bits_to_double(PSD_LOAD_RLX(&h->lr_bits));
}

static PyObject *read_header(Arena *a, PyObject *noargs) {
    (void)noargs;
    if (check_open(a))
        return NULL;
    struct psd_header *h = psd_hdr(&a->map);
    PyObject *d = PyDict_New();
    if (!d)
        return NULL;
#define HEADER_FIELD(f, how) SET(d, #f, READ_##how(h, f));
    PSD_HEADER_FIELDS(HEADER_FIELD)
#undef HEADER_FIELD
    SET(d, "psd_version", text_field(h->psd_version, PSD_VERSION_LEN));
    SET(d, "fail_msg", text_field(h->fail_msg, PSD_MSG_LEN));
    uint64_t beat = atomic_load(&h->heartbeat_ns);
    SET(d, "heartbeat_age_s", PyFloat_FromDouble(beat ? (double)(psd_now_ns() - beat) / 1e9 : -1.0));
    SET(d, "mapped_size", PyLong_FromSize_t(a->map.size));
    SET(d, "state_vectors", PyLong_FromUnsignedLong(psd_state_vectors(h->cfg.optimizer, h->cfg.sync_mode)));
    SET(d, "learners_wait_for_their_own",
        PyBool_FromLong(psd_learners_wait_for_their_own(&h->cfg)));
    SET(d, "lr_now", PyFloat_FromDouble(current_lr(h)));
    double level = psd_gain_level(h);
    SET(d, "momentum_now", PyFloat_FromDouble(psd_async_momentum(&h->cfg, psd_rule_staleness(h), level)));
    SET(d, "gain_level", PyFloat_FromDouble(level));
    SET(d, "damping", PyFloat_FromDouble(psd_damping(h)));
    SET(d, "staleness_avg", READ_BITS(h, staleness_avg_bits));
    SET(d, "staleness_held", READ_BITS(h, staleness_held_bits));
    SET(d, "staleness_rule", PyFloat_FromDouble(psd_rule_staleness(h)));
    PyObject *hist = PyList_New(PSD_HIST_BUCKETS);
    for (int i = 0; hist && i < PSD_HIST_BUCKETS; i++) {
        PyObject *v = PyLong_FromUnsignedLongLong(atomic_load(&h->staleness_hist[i]));
        if (!v)
            Py_CLEAR(hist);
        else
            PyList_SET_ITEM(hist, i, v);
    }
    SET(d, "staleness_hist", hist);
    return d;
}

static PyObject *read_slot_info(Arena *a, PyObject *args) {
    unsigned int i;
    if (!PyArg_ParseTuple(args, "I", &i) || check_slot(a, i))
        return NULL;
    struct psd_slot *s = psd_slot_at(&a->map, i);
    PyObject *d = PyDict_New();
    if (!d)
        return NULL;
#define SLOT_FIELD(key, f, how) SET(d, #key, READ_##how(s, f));
    PSD_SLOT_FIELDS(SLOT_FIELD)
#undef SLOT_FIELD
    if (psd_has_model(&a->map)) { /* the learner pages exist once the arena holds its model */
        struct psd_lslot *l = psd_lslot_at(&a->map, i);
#define LSLOT_FIELD(key, f, how) SET(d, #key, READ_##how(l, f));
        PSD_LSLOT_FIELDS(LSLOT_FIELD)
#undef LSLOT_FIELD
    }
    return d;
}

static PyObject *read_spec(Arena *a, PyObject *noargs) {
    (void)noargs;
    if (check_open(a))
        return NULL;
    struct psd_header *h = psd_hdr(&a->map);
    if (PSD_LOAD_ACQ(&h->state) < PSD_ARENA_SPEC_OFFERED)
        Py_RETURN_NONE;
    uint64_t len = h->spec_len; /* written by the offerer: checked against the spec region */
    if (len > a->map.g.spec_cap)
        return raise_code(PSD_ESPEC, "read the offered spec (longer than the spec region)", a->name);
    return PyBytes_FromStringAndSize((const char *)a->map.base + a->map.g.spec_off, (Py_ssize_t)len);
}

static PyObject *read_training(Arena *a, PyObject *noargs) {
    (void)noargs;
    if (check_open(a))
        return NULL;
    const struct psd_config *c = &psd_hdr(&a->map)->cfg;
    return Py_BuildValue("{s:s,s:s,s:s}", "optimizer",
                         c->optimizer < N_OPTIMIZERS ? optimizer_names[c->optimizer] : "?", "sync",
                         c->sync_mode < N_SYNCS ? sync_names[c->sync_mode] : "?", "schedule",
                         c->schedule < N_SCHEDULES ? schedule_names[c->schedule] : "?");
}

static PyObject *read_rounds(Arena *a, PyObject *noargs) {
    (void)noargs;
    if (check_open(a))
        return NULL;
    /* Pairs with the store of rounds in finish_round (update.c). */
    return PyLong_FromUnsignedLongLong(PSD_LOAD_ACQ(&psd_hdr(&a->map)->rounds));
}

static PyObject *read_counters(Arena *a, PyObject *noargs) {
    (void)noargs;
    if (check_open(a))
        return NULL;
    struct psd_header *h = psd_hdr(&a->map);
    uint64_t pushed = atomic_load(&h->retired_pushed), pending = 0;
    uint32_t active = 0;
    if (PSD_LOAD_ACQ(&h->state) == PSD_ARENA_READY && psd_has_model(&a->map)) {
        for (uint32_t i = 0; i < a->map.g.n_slots; i++) {
            struct psd_slot *s = psd_slot_at(&a->map, i);
            uint32_t st = atomic_load(&s->state);
            if (st != PSD_SLOT_ACTIVE && st != PSD_SLOT_DRAINING)
                continue;
            /* The server's own count of what it took, plus what waits in the ring: the learner's
             * tail only as far as the ring holds (a runaway tail is the loop's to evict). */
            uint64_t tail = atomic_load(&psd_lslot_at(&a->map, i)->tail), head = atomic_load(&s->head);
            uint64_t waiting = tail >= head && tail - head <= a->map.g.ring_k ? tail - head : 0;
            pushed += head + waiting;
            pending += waiting;
            active += st == PSD_SLOT_ACTIVE;
        }
    }
    return Py_BuildValue("{s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:I}", "pushed", (unsigned long long)pushed,
                         "applied", (unsigned long long)atomic_load(&h->applied), "rejected",
                         (unsigned long long)atomic_load(&h->rejected), "dropped",
                         (unsigned long long)atomic_load(&h->dropped), "ignored",
                         (unsigned long long)atomic_load(&h->ignored), "pending",
                         (unsigned long long)pending, "clock", (unsigned long long)atomic_load(&h->clock),
                         "active_learners", active);
}

static PyObject *read_tail(Arena *a, PyObject *args) {
    unsigned int slot;
    if (!PyArg_ParseTuple(args, "I", &slot) || check_slot(a, slot))
        return NULL;
    return PyLong_FromUnsignedLongLong(PSD_LOAD_RLX(&psd_lslot_at(&a->map, slot)->tail));
}

static PyObject *read_head(Arena *a, PyObject *args) {
    unsigned int slot;
    if (!PyArg_ParseTuple(args, "I", &slot) || check_slot(a, slot))
        return NULL;
    /* Pairs with the store of head in take_entry (update.c): the entries before it are free. */
    return PyLong_FromUnsignedLongLong(PSD_LOAD_ACQ(&psd_slot_at(&a->map, slot)->head));
}

static PyObject *read_clock(Arena *a, PyObject *noargs) {
    (void)noargs;
    if (check_open(a))
        return NULL;
    /* Pairs with the store-release of clock in update_weights: weights copied
     * after this load are at least this fresh. */
    return PyLong_FromUnsignedLongLong(PSD_LOAD_ACQ(&psd_hdr(&a->map)->clock));
}

static PyObject *read_lr_now(Arena *a, PyObject *noargs) {
    (void)noargs;
    if (check_open(a))
        return NULL;
    return PyFloat_FromDouble(current_lr(psd_hdr(&a->map)));
}

static PyObject *read_generation(Arena *a, PyObject *noargs) {
    (void)noargs;
    if (check_open(a))
        return NULL;
    return PyLong_FromUnsignedLongLong(atomic_load(&psd_hdr(&a->map)->generation));
}

static PyObject *read_ranks(Arena *a, PyObject *noargs) {
    (void)noargs;
    if (check_open(a))
        return NULL;
    PyObject *list = PyList_New(a->map.g.n_slots);
    if (!list)
        return NULL;
    for (uint32_t r = 0; r < a->map.g.n_slots; r++) {
        PyObject *v = PyLong_FromUnsignedLongLong(atomic_load(&psd_rank_at(&a->map, r)->applied));
        if (!v) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, r, v);
    }
    return list;
}

static PyObject *read_server_alive(Arena *a, PyObject *args) {
    double stale = 0;
    if (!PyArg_ParseTuple(args, "|d", &stale) || check_open(a))
        return NULL;
    return PyBool_FromLong(psd_server_alive(&a->map, seconds_to_ns(stale)));
}

/* One header field by its name in PSD_HEADER_FIELDS (psd.h), read as arena_header reads it: what a
 * poller that needs one field calls instead of building the whole dict. */
static PyObject *read_field(Arena *a, PyObject *args) {
    const char *name;
    if (!PyArg_ParseTuple(args, "s", &name) || check_open(a))
        return NULL;
    struct psd_header *h = psd_hdr(&a->map);
#define HEADER_FIELD(f, how)                                                                       \
    if (strcmp(name, #f) == 0)                                                                     \
        return READ_##how(h, f);
    PSD_HEADER_FIELDS(HEADER_FIELD)
#undef HEADER_FIELD
    PyErr_Format(PyExc_KeyError, "%s is not a header field (native/psd.h PSD_HEADER_FIELDS)", name);
    return NULL;
}

/* Every method here reads the mapping: a SIGBUS that a supervising process recovered from while it read
 * (sigbus.c) turns what it read, zeros, into ArenaLost (unless_lost). */
#define LOST_CHECKED(n)                                                                            \
    static PyObject *arena_##n(Arena *a, PyObject *args) { return unless_lost(a, read_##n(a, args)); }
LOST_CHECKED(header)
LOST_CHECKED(slot_info)
LOST_CHECKED(spec)
LOST_CHECKED(training)
LOST_CHECKED(rounds)
LOST_CHECKED(counters)
LOST_CHECKED(tail)
LOST_CHECKED(head)
LOST_CHECKED(clock)
LOST_CHECKED(lr_now)
LOST_CHECKED(generation)
LOST_CHECKED(ranks)
LOST_CHECKED(server_alive)
LOST_CHECKED(field)
#undef LOST_CHECKED

PyMethodDef py_inspect_methods[] = {
    {"field", (PyCFunction)arena_field, METH_VARARGS, "field(name) -> one header field (header()'s value)"},
    {"header", (PyCFunction)arena_header, METH_NOARGS, "All header fields, as a dict."},
    {"slot_info", (PyCFunction)arena_slot_info, METH_VARARGS, "One learner slot's fields, as a dict."},
    {"spec", (PyCFunction)arena_spec, METH_NOARGS, "The parameter spec bytes, or None before one was offered."},
    {"training", (PyCFunction)arena_training, METH_NOARGS, "optimizer, sync mode and schedule, by name."},
    {"rounds", (PyCFunction)arena_rounds, METH_NOARGS, "bsp / kasync rounds completed."},
    {"counters", (PyCFunction)arena_counters, METH_NOARGS, "pushed, applied, rejected, pending, clock."},
    {"tail", (PyCFunction)arena_tail, METH_VARARGS, "tail(slot) -> the slot's producer index"},
    {"head", (PyCFunction)arena_head, METH_VARARGS, "head(slot) -> the slot's consumer index"},
    {"clock", (PyCFunction)arena_clock, METH_NOARGS, "The weights clock (load-acquire)."},
    {"lr_now", (PyCFunction)arena_lr_now, METH_NOARGS,
     "The server's current learning rate: the scheduled lr of the last update (before any, of the first)."},
    {"generation", (PyCFunction)arena_generation, METH_NOARGS, "Servers started on this arena so far."},
    {"ranks", (PyCFunction)arena_ranks, METH_NOARGS, "Gradients applied per learner rank."},
    {"server_alive", (PyCFunction)arena_server_alive, METH_VARARGS, "server_alive(stale_s=0) -> bool"},
    {NULL, NULL, 0, NULL},
};
