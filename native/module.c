/*
 * module.c -- psd._native, the only file in native/ that knows about Python.
 *
 * It wraps one mapping of an arena as `Arena`, which exports the mapping
 * through the buffer protocol (so torch.frombuffer gives zero-copy tensors
 * over the weights and ring entries) and refuses to unmap while any buffer is
 * still exported. Blocking calls release the GIL and retry on EINTR as long as
 * PyErr_CheckSignals() allows, so Ctrl-C works. C error codes become
 * subclasses of psd.Error through one table (raise_code).
 */
#define PY_SSIZE_T_CLEAN
#define _GNU_SOURCE
#include <Python.h>
#include <errno.h>
#include <omp.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "psd.h"

static PyObject *errors_module; /* psd.errors, imported at module init */

static const struct {
    int code;
    const char *cls;
} error_table[] = {
    {PSD_EBADMAGIC, "ArenaCorrupt"}, {PSD_EVERSION, "VersionMismatch"},
    {PSD_ENOSLOT, "NoFreeSlot"},     {PSD_ESTATE, "StateError"},
    {PSD_ESPEC, "SpecError"},        {PSD_EOWNERDEAD, "Error"},
    {PSD_EEXPORTS, "ArenaBusy"},     {PSD_ESERVER, "ServerGone"},
    {PSD_ETIMEOUT, "Timeout"},       {PSD_ESLOT, "SlotLost"},
    {PSD_EINIT, "ArenaIncomplete"},
};

/* Raise for `code` as "operation: description"; always returns NULL. */
static PyObject *raise_code(int code, const char *op, const char *filename) {
    if (code > 0) {
        PyObject *args = filename ? Py_BuildValue("(iss)", code, strerror(code), filename)
                                  : Py_BuildValue("(is)", code, strerror(code));
        if (args) {
            PyErr_SetObject(PyExc_OSError, args);
            Py_DECREF(args);
        }
        return NULL;
    }
    const char *cls = "Error";
    for (size_t i = 0; i < sizeof error_table / sizeof error_table[0]; i++)
        if (error_table[i].code == code)
            cls = error_table[i].cls;
    PyObject *type = PyObject_GetAttrString(errors_module, cls);
    if (!type)
        return NULL;
    PyErr_Format(type, "%s: %s", op, psd_strerror(code));
    Py_DECREF(type);
    return NULL;
}

typedef struct {
    PyObject_HEAD struct psd_map map;
    Py_ssize_t exports;
    struct psd_loop *loop;
    char name[256];
} Arena;

static PyTypeObject ArenaType;

static int check_open(Arena *a) {
    if (!a->map.base) {
        PyErr_SetString(PyExc_ValueError, "arena is closed");
        return -1;
    }
    return 0;
}

static int check_slot(Arena *a, unsigned int slot) {
    if (check_open(a))
        return -1;
    struct psd_header *h = psd_hdr(&a->map);
    if (PSD_LOAD_ACQ(&h->state) < PSD_ARENA_INIT_WEIGHTS || a->map.size < h->total_size) {
        raise_code(PSD_ESTATE, "slot", NULL);
        return -1;
    }
    if (slot >= h->n_slots) {
        PyErr_Format(PyExc_IndexError, "slot %u out of range (job has %u)", slot, h->n_slots);
        return -1;
    }
    return 0;
}

static Arena *new_arena(const char *name) {
    Arena *a = PyObject_New(Arena, &ArenaType);
    if (!a)
        return NULL;
    a->map.fd = -1;
    a->map.base = NULL;
    a->map.size = 0;
    a->exports = 0;
    a->loop = NULL;
    snprintf(a->name, sizeof a->name, "%s", name);
    return a;
}

static void arena_dealloc(Arena *a) {
    if (a->loop) {
        Py_BEGIN_ALLOW_THREADS psd_loop_stop(a->loop);
        Py_END_ALLOW_THREADS a->loop = NULL;
    }
    psd_arena_close(&a->map);
    PyObject_Free(a);
}

static int arena_getbuffer(Arena *a, Py_buffer *view, int flags) {
    if (check_open(a))
        return -1;
    if (PyBuffer_FillInfo(view, (PyObject *)a, a->map.base, (Py_ssize_t)a->map.size, 0, flags))
        return -1;
    a->exports++;
    return 0;
}

static void arena_releasebuffer(Arena *a, Py_buffer *view) {
    (void)view;
    a->exports--;
}

static PyBufferProcs arena_as_buffer = {(getbufferproc)arena_getbuffer,
                                        (releasebufferproc)arena_releasebuffer};

/* ---- module functions ---------------------------------------------------- */

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

static PyObject *mod_open(PyObject *self, PyObject *args) {
    (void)self;
    const char *name;
    if (!PyArg_ParseTuple(args, "s", &name))
        return NULL;
    Arena *a = new_arena(name);
    if (!a)
        return NULL;
    int rc = psd_arena_open(&a->map, name);
    if (rc == PSD_EVERSION) {
        struct psd_header *h = psd_hdr(&a->map);
        char made_by[PSD_VERSION_LEN + 1];
        memcpy(made_by, h->psd_version, PSD_VERSION_LEN);
        made_by[PSD_VERSION_LEN] = '\0';
        PyObject *type = PyObject_GetAttrString(errors_module, "VersionMismatch");
        if (type) {
            PyObject *exc = PyObject_CallFunction(type, "sssII", "open arena", name, made_by,
                                                  h->layout_version, (unsigned)PSD_LAYOUT_VERSION);
            if (exc) {
                PyErr_SetObject(type, exc);
                Py_DECREF(exc);
            }
            Py_DECREF(type);
        }
        Py_DECREF(a);
        return NULL;
    }
    if (rc) {
        Py_DECREF(a);
        return raise_code(rc, "open arena", name);
    }
    return (PyObject *)a;
}

static PyObject *mod_unlink(PyObject *self, PyObject *args) {
    (void)self;
    const char *name;
    if (!PyArg_ParseTuple(args, "s", &name))
        return NULL;
    if (shm_unlink(name) != 0)
        return raise_code(errno, "remove arena", name);
    Py_RETURN_NONE;
}

static PyObject *mod_proc_start_time(PyObject *self, PyObject *args) {
    (void)self;
    int pid;
    if (!PyArg_ParseTuple(args, "i", &pid))
        return NULL;
    return PyLong_FromUnsignedLongLong(psd_proc_start_time(pid));
}

static PyObject *mod_owner_alive(PyObject *self, PyObject *args) {
    (void)self;
    int pid;
    unsigned long long start;
    if (!PyArg_ParseTuple(args, "iK", &pid, &start))
        return NULL;
    return PyBool_FromLong(psd_owner_alive(pid, start));
}

static PyObject *mod_arena_size(PyObject *self, PyObject *args) {
    (void)self;
    unsigned int n_slots, ring_k, vectors = 0;
    unsigned long long spec_cap, n_params, n_train = 0, n_buffers = 0, n_pieces = 1;
    if (!PyArg_ParseTuple(args, "IIKK|IKKK", &n_slots, &ring_k, &spec_cap, &n_params, &vectors, &n_train,
                          &n_buffers, &n_pieces))
        return NULL;
    if (n_params == 0)
        return PyLong_FromSize_t(psd_header_span(n_slots, spec_cap));
    const struct psd_model model = {n_params, n_train ? n_train : n_params, n_buffers, n_pieces};
    struct psd_geom g;
    int rc = psd_geometry(n_slots, ring_k, spec_cap, &model, vectors, &g);
    if (rc) {
        PyErr_Format(PyExc_ValueError,
                     "bad arena geometry: learners must be 1..%d, the ring depth a power of two 1..%d, "
                     "the model non-empty and the arena addressable",
                     PSD_MAX_SLOTS, PSD_MAX_RING);
        return NULL;
    }
    return PyLong_FromUnsignedLongLong(g.total_size);
}

static int name_index(const char *what, const char *name, const char *const *names, int n) {
    for (int i = 0; i < n; i++)
        if (strcmp(name, names[i]) == 0)
            return i;
    PyErr_Format(PyExc_ValueError, "unknown %s '%s'", what, name);
    return -1;
}

/* Names of enum psd_optimizer, psd_sync and psd_schedule, in their order. */
static const char *const optimizer_names[] = {"sgd", "momentum", "nesterov", "adam", "adamw", "adagrad"};
static const char *const sync_names[] = {"asp", "ssp", "bsp", "kasync"};
static const char *const schedule_names[] = {"constant", "step", "cosine"};

static PyObject *mod_state_vectors(PyObject *self, PyObject *args) {
    (void)self;
    const char *opt, *sync;
    if (!PyArg_ParseTuple(args, "ss", &opt, &sync))
        return NULL;
    int o = name_index("optimizer", opt, optimizer_names, 6), y = name_index("sync mode", sync, sync_names, 4);
    if (o < 0 || y < 0)
        return NULL;
    return PyLong_FromUnsignedLong(psd_state_vectors((uint32_t)o, (uint32_t)y));
}

static PyObject *mod_omp_info(PyObject *self, PyObject *noargs) {
    (void)self;
    (void)noargs;
    return Py_BuildValue("{s:i,s:i}", "max_threads", omp_get_max_threads(), "num_procs", omp_get_num_procs());
}

/* apply_sgd / apply_sgd_kernel: w -= lr*g in place through `fn`, whose last
 * argument (threads, or which kernel) comes from Python; EINVAL: no such kernel. */
typedef int (*sgd_fn)(float *restrict w, const float *restrict g, uint64_t n, float lr, int arg);

static int sgd_threads(float *restrict w, const float *restrict g, uint64_t n, float lr, int threads) {
    psd_apply_sgd(w, g, n, lr, threads);
    return 0;
}

static PyObject *sgd_call(PyObject *args, const char *name, sgd_fn fn) {
    Py_buffer w, g;
    float lr;
    int arg, rc = 0;
    if (!PyArg_ParseTuple(args, "w*y*fi", &w, &g, &lr, &arg))
        return NULL;
    if (w.len != g.len || w.len % (Py_ssize_t)sizeof(float)) {
        PyErr_Format(PyExc_ValueError, "%s: w and g must be float32 buffers of one size", name);
    } else {
        Py_BEGIN_ALLOW_THREADS rc = fn(w.buf, g.buf, (uint64_t)w.len / sizeof(float), lr, arg);
        Py_END_ALLOW_THREADS if (rc) PyErr_Format(PyExc_ValueError, "%s: no kernel %d", name, arg);
    }
    PyBuffer_Release(&w);
    PyBuffer_Release(&g);
    if (PyErr_Occurred())
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *mod_apply_sgd(PyObject *self, PyObject *args) {
    (void)self;
    return sgd_call(args, "apply_sgd", sgd_threads);
}

static PyObject *mod_apply_sgd_kernel(PyObject *self, PyObject *args) {
    (void)self;
    return sgd_call(args, "apply_sgd_kernel", psd_apply_sgd_kernel);
}

/* ---- Arena methods ------------------------------------------------------ */

#define U64(d, key, v)                                                                             \
    do {                                                                                           \
        PyObject *o_ = PyLong_FromUnsignedLongLong((unsigned long long)(v));                       \
        if (!o_ || PyDict_SetItemString((d), (key), o_)) {                                        \
            Py_XDECREF(o_);                                                                        \
            Py_DECREF(d);                                                                          \
            return NULL;                                                                           \
        }                                                                                          \
        Py_DECREF(o_);                                                                             \
    } while (0)

/* The server's current learning rate: the scheduled lr of the last update (before any, that of the
 * first one), as `psd status` and a learner's Optimizer.param_groups show it. */
static double current_lr(struct psd_header *h) {
    /* Pairs with the store-release of opt_steps in update_weights, which follows that of lr_bits. */
    if (PSD_LOAD_ACQ(&h->opt_steps) == 0)
        return psd_scheduled_lr(h, 0);
    uint64_t bits = PSD_LOAD_RLX(&h->lr_bits);
    double lr;
    memcpy(&lr, &bits, sizeof lr);
    return lr;
}

static PyObject *arena_header(Arena *a, PyObject *noargs) {
    (void)noargs;
    if (check_open(a))
        return NULL;
    struct psd_header *h = psd_hdr(&a->map);
    PyObject *d = PyDict_New();
    if (!d)
        return NULL;
    char ver[PSD_VERSION_LEN + 1];
    memcpy(ver, h->psd_version, PSD_VERSION_LEN);
    ver[PSD_VERSION_LEN] = '\0';
    char msg[PSD_MSG_LEN + 1];
    memcpy(msg, h->fail_msg, PSD_MSG_LEN);
    msg[PSD_MSG_LEN] = '\0';
    PyObject *o = Py_BuildValue("{s:s,s:s,s:d,s:d}", "psd_version", ver, "fail_msg", msg, "lr",
                                h->lr, "heartbeat_age_s",
                                h->heartbeat_ns ? (double)(psd_now_ns() - atomic_load(&h->heartbeat_ns)) / 1e9 : -1.0);
    if (!o || PyDict_Update(d, o)) {
        Py_XDECREF(o);
        Py_DECREF(d);
        return NULL;
    }
    Py_DECREF(o);
    U64(d, "layout_version", h->layout_version);
    U64(d, "fingerprint", h->fingerprint);
    U64(d, "n_slots", h->n_slots);
    U64(d, "ring_k", h->ring_k);
    U64(d, "spec_cap", h->spec_cap);
    U64(d, "created_unix_ns", h->created_unix_ns);
    U64(d, "total_size", h->total_size);
    U64(d, "mapped_size", a->map.size);
    U64(d, "n_params", h->n_params);
    U64(d, "n_train", h->n_train);
    U64(d, "n_buffers", h->n_buffers);
    U64(d, "n_pieces", h->n_pieces);
    U64(d, "buffers_off", h->buffers_off);
    U64(d, "pieces_off", h->pieces_off);
    U64(d, "weights_off", h->weights_off);
    U64(d, "weights_bytes", h->weights_bytes);
    U64(d, "optstate_off", h->optstate_off);
    U64(d, "optstate_bytes", h->optstate_bytes);
    U64(d, "slots_off", h->slots_off);
    U64(d, "slot_stride", h->slot_stride);
    U64(d, "entry_stride", h->entry_stride);
    U64(d, "spec_len", h->spec_len);
    U64(d, "spec_hash", h->spec_hash);
    U64(d, "offer_pid", (uint32_t)h->offer_pid);
    U64(d, "offer_start_time", h->offer_start_time);
    U64(d, "optimizer", h->optimizer);
    U64(d, "sync_mode", h->sync_mode);
    U64(d, "threads", h->threads);
    U64(d, "spin_us", h->spin_us);
    U64(d, "state", atomic_load(&h->state));
    U64(d, "server_pid", (uint32_t)atomic_load(&h->server_pid));
    U64(d, "server_start_time", h->server_start_time);
    U64(d, "generation", atomic_load(&h->generation));
    U64(d, "clock", atomic_load(&h->clock));
    U64(d, "applied", atomic_load(&h->applied));
    U64(d, "rejected", atomic_load(&h->rejected));
    U64(d, "retired_pushed", atomic_load(&h->retired_pushed));
    U64(d, "staleness_sum", atomic_load(&h->staleness_sum));
    U64(d, "staleness_max", atomic_load(&h->staleness_max));
    U64(d, "reclaimed", atomic_load(&h->reclaimed));
    U64(d, "lock_recoveries", atomic_load(&h->lock_recoveries));
    U64(d, "evicted", atomic_load(&h->evicted));
    U64(d, "evicted_pid", (uint32_t)atomic_load(&h->evicted_pid));
    U64(d, "evicted_rule", atomic_load(&h->evicted_rule));
    U64(d, "ranks_off", h->ranks_off);
    U64(d, "pause_req", atomic_load(&h->pause_req));
    U64(d, "paused", atomic_load(&h->paused));
    U64(d, "hold_clock", atomic_load(&h->hold_clock));
    U64(d, "holder_pid", (uint32_t)atomic_load(&h->holder_pid));
    U64(d, "held", atomic_load(&h->held));
    U64(d, "watchdog_pid", (uint32_t)atomic_load(&h->watchdog_pid));
    U64(d, "watchdog_start_time", atomic_load(&h->watchdog_start_time));
    U64(d, "checkpoint_clock", atomic_load(&h->checkpoint_clock));
    U64(d, "checkpoint_unix_ns", atomic_load(&h->checkpoint_unix_ns));
    U64(d, "server_restarts", atomic_load(&h->server_restarts));
    U64(d, "server_started_unix_ns", h->server_started_unix_ns);
    PyObject *hist = PyList_New(PSD_HIST_BUCKETS);
    if (!hist) {
        Py_DECREF(d);
        return NULL;
    }
    for (int i = 0; i < PSD_HIST_BUCKETS; i++)
        PyList_SET_ITEM(hist, i, PyLong_FromUnsignedLongLong(atomic_load(&h->staleness_hist[i])));
    if (PyDict_SetItemString(d, "staleness_hist", hist)) {
        Py_DECREF(hist);
        Py_DECREF(d);
        return NULL;
    }
    Py_DECREF(hist);
    U64(d, "sleeping", atomic_load(&h->sleeping));
    U64(d, "sync_param", h->sync_param);
    U64(d, "push_every", h->push_every);
    U64(d, "schedule", h->schedule);
    U64(d, "cfg_flags", h->cfg_flags);
    U64(d, "step_size", h->step_size);
    U64(d, "t_max", h->t_max);
    U64(d, "warmup", h->warmup);
    U64(d, "max_staleness", h->max_staleness);
    U64(d, "opt_steps", atomic_load(&h->opt_steps));
    U64(d, "rounds", atomic_load(&h->rounds));
    U64(d, "acc_count", atomic_load(&h->acc_count));
    U64(d, "acc_members", atomic_load(&h->acc_members));
    U64(d, "acc_staleness", atomic_load(&h->acc_staleness));
    U64(d, "dropped", atomic_load(&h->dropped));
    U64(d, "state_vectors", psd_state_vectors(h->optimizer, h->sync_mode));
    double lr_now = current_lr(h);
    uint64_t avg_bits = atomic_load(&h->staleness_avg_bits);
    double staleness_avg;
    memcpy(&staleness_avg, &avg_bits, sizeof staleness_avg);
    U64(d, "async_momentum", h->async_momentum);
    o = Py_BuildValue("{s:d,s:d,s:d,s:d,s:d,s:d,s:d,s:d,s:d,s:d,s:d,s:d}", "momentum", h->momentum, "dampening",
                      h->dampening, "beta1", h->beta1, "beta2", h->beta2, "eps", h->eps, "weight_decay",
                      h->weight_decay, "lr_decay", h->lr_decay, "gamma", h->gamma, "eta_min", h->eta_min,
                      "lr_now", lr_now, "staleness_avg", staleness_avg, "momentum_now", psd_async_momentum(h));
    if (!o || PyDict_Update(d, o)) {
        Py_XDECREF(o);
        Py_DECREF(d);
        return NULL;
    }
    Py_DECREF(o);
    return d;
}

static PyObject *arena_slot_info(Arena *a, PyObject *args) {
    unsigned int i;
    if (!PyArg_ParseTuple(args, "I", &i) || check_slot(a, i))
        return NULL;
    struct psd_slot *s = psd_slot_at(&a->map, i);
    PyObject *d = PyDict_New();
    if (!d)
        return NULL;
    uint64_t loss_bits = atomic_load(&s->last_loss_bits);
    double loss;
    memcpy(&loss, &loss_bits, sizeof loss);
    PyObject *o = PyFloat_FromDouble(loss);
    if (!o || PyDict_SetItemString(d, "last_loss", o)) {
        Py_XDECREF(o);
        Py_DECREF(d);
        return NULL;
    }
    Py_DECREF(o);
    U64(d, "state", atomic_load(&s->state));
    U64(d, "pid", (uint32_t)PSD_LOAD_RLX(&s->pid));
    U64(d, "start_time", PSD_LOAD_RLX(&s->start_time));
    U64(d, "claims", PSD_LOAD_RLX(&s->claims));
    PyObject *r = PyLong_FromLong(PSD_LOAD_RLX(&s->rank));
    if (!r || PyDict_SetItemString(d, "rank", r)) {
        Py_XDECREF(r);
        Py_DECREF(d);
        return NULL;
    }
    Py_DECREF(r);
    U64(d, "waiters", atomic_load(&s->not_full.waiters));
    U64(d, "tail", atomic_load(&s->tail));
    U64(d, "head", atomic_load(&s->head));
    U64(d, "learner_clock", atomic_load(&s->learner_clock));
    U64(d, "pulls", atomic_load(&s->pulls));
    U64(d, "pulls_skipped", atomic_load(&s->pulls_skipped));
    U64(d, "full_waits", atomic_load(&s->full_waits));
    U64(d, "applied", atomic_load(&s->applied));
    U64(d, "rejected", atomic_load(&s->rejected));
    U64(d, "staleness_sum", atomic_load(&s->staleness_sum));
    U64(d, "staleness_max", atomic_load(&s->staleness_max));
    U64(d, "dropped", atomic_load(&s->dropped));
    U64(d, "ssp_base", atomic_load(&s->ssp_base));
    U64(d, "round_joined", atomic_load(&s->round_joined));
    return d;
}

static PyObject *arena_spec(Arena *a, PyObject *noargs) {
    (void)noargs;
    if (check_open(a))
        return NULL;
    struct psd_header *h = psd_hdr(&a->map);
    if (PSD_LOAD_ACQ(&h->state) < PSD_ARENA_SPEC_OFFERED)
        Py_RETURN_NONE;
    return PyBytes_FromStringAndSize((const char *)a->map.base + h->spec_off, (Py_ssize_t)h->spec_len);
}

static PyObject *arena_set_spec(Arena *a, PyObject *args) {
    Py_buffer spec;
    unsigned long long hash, start;
    struct psd_model model;
    int pid;
    if (!PyArg_ParseTuple(args, "y*K(KKKK)iK", &spec, &hash, &model.n_params, &model.n_train, &model.n_buffers,
                          &model.n_pieces, &pid, &start))
        return NULL;
    int rc = check_open(a) ? -1 : psd_arena_set_spec(&a->map, spec.buf, (uint64_t)spec.len, hash, &model, pid, start);
    PyBuffer_Release(&spec);
    if (rc == -1)
        return NULL;
    if (rc == PSD_ESTATE)
        Py_RETURN_FALSE; /* another learner offered first */
    if (rc)
        return raise_code(rc, "offer spec", a->name);
    Py_RETURN_TRUE;
}

static PyObject *arena_grow(Arena *a, PyObject *noargs) {
    (void)noargs;
    if (check_open(a))
        return NULL;
    if (a->exports)
        return raise_code(PSD_EEXPORTS, "grow arena", NULL);
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = psd_arena_grow(&a->map);
    Py_END_ALLOW_THREADS if (rc) return raise_code(rc, "grow arena", a->name);
    Py_RETURN_NONE;
}

static PyObject *arena_remap(Arena *a, PyObject *noargs) {
    (void)noargs;
    if (check_open(a))
        return NULL;
    if (a->exports)
        return raise_code(PSD_EEXPORTS, "remap arena", NULL);
    int rc = psd_arena_remap(&a->map);
    if (rc)
        return raise_code(rc, "remap arena", a->name);
    Py_RETURN_NONE;
}

static PyObject *arena_set_state(Arena *a, PyObject *args) {
    unsigned int st;
    const char *msg = NULL;
    if (!PyArg_ParseTuple(args, "I|z", &st, &msg) || check_open(a))
        return NULL;
    if (msg) {
        struct psd_header *h = psd_hdr(&a->map);
        snprintf(h->fail_msg, PSD_MSG_LEN, "%s", msg);
    }
    psd_arena_set_state(&a->map, st);
    Py_RETURN_NONE;
}

/* Run `call` with the GIL released, in slices, until it returns something
 * other than EINTR or a signal handler raises. */
#define BLOCKING(rc, call)                                                                         \
    do {                                                                                           \
        for (;;) {                                                                                 \
            Py_BEGIN_ALLOW_THREADS rc = (call);                                                    \
            Py_END_ALLOW_THREADS if (rc != EINTR) break;                                           \
            if (PyErr_CheckSignals())                                                              \
                return NULL;                                                                       \
        }                                                                                          \
    } while (0)

static uint64_t seconds_to_ns(double s) { return s <= 0 ? 0 : (uint64_t)(s * 1e9); }

static PyObject *arena_wait_state(Arena *a, PyObject *args) {
    unsigned int not_state;
    double timeout;
    if (!PyArg_ParseTuple(args, "Id", &not_state, &timeout) || check_open(a))
        return NULL;
    uint64_t deadline = psd_now_ns() + seconds_to_ns(timeout);
    int rc;
    BLOCKING(rc, psd_arena_wait_state(&a->map, not_state,
                                      deadline > psd_now_ns() ? deadline - psd_now_ns() : 0));
    if (rc == PSD_ETIMEOUT)
        Py_RETURN_FALSE;
    if (rc)
        return raise_code(rc, "wait for arena state", a->name);
    Py_RETURN_TRUE;
}

static PyObject *arena_claim(Arena *a, PyObject *args) {
    int pid, rank = -1;
    unsigned long long start;
    if (!PyArg_ParseTuple(args, "iK|i", &pid, &start, &rank) || check_open(a))
        return NULL;
    uint32_t slot = 0;
    uint64_t claim = 0;
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = psd_slot_claim(&a->map, pid, start, rank, &slot, &claim);
    Py_END_ALLOW_THREADS if (rc) return raise_code(rc, "claim learner slot", a->name);
    return Py_BuildValue("(IK)", slot, (unsigned long long)claim);
}

static PyObject *arena_release(Arena *a, PyObject *args) {
    unsigned int slot;
    unsigned long long claim;
    if (!PyArg_ParseTuple(args, "IK", &slot, &claim) || check_slot(a, slot))
        return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = psd_slot_release(&a->map, slot, claim);
    Py_END_ALLOW_THREADS if (rc) return raise_code(rc, "release learner slot", a->name);
    Py_RETURN_NONE;
}

static PyObject *arena_push(Arena *a, PyObject *args) {
    unsigned int slot, batch;
    unsigned long long clock;
    double loss;
    float scale = 1.0f;
    PyObject *bo = Py_None;
    if (!PyArg_ParseTuple(args, "IKId|fO", &slot, &clock, &batch, &loss, &scale, &bo) || check_slot(a, slot))
        return NULL;
    const double *bufdelta = bo == Py_None ? NULL : PyLong_AsVoidPtr(bo);
    if (PyErr_Occurred())
        return NULL;
    int rc;
    if (psd_hdr(&a->map)->n_params < (UINT64_C(1) << 16)) {
        rc = psd_push(&a->map, slot, clock, batch, loss, scale, bufdelta);
    } else {
        Py_BEGIN_ALLOW_THREADS rc = psd_push(&a->map, slot, clock, batch, loss, scale, bufdelta);
        Py_END_ALLOW_THREADS
    }
    if (rc)
        return raise_code(rc, "push gradient", a->name);
    Py_RETURN_NONE;
}

/* push_from(slot, clock, batch, loss, scale, ptrs, lens, dtype=0, bufdelta=None, sparse=None): copy
 * the gradient from the tensors at the addresses `ptrs` (0: no gradient) of
 * `lens` elements of `dtype` (enum psd_dtype) into the entry at the tail,
 * checking it on the way, and publish it. `sparse` lists (k, rows_ptr, nnz,
 * row_len) for the tensors whose gradient is nnz rows (ptrs[k] the values).
 * `bufdelta` is the address of n_buffers doubles. The caller (Learner.step)
 * keeps the tensors alive and vouches for the addresses. */
static PyObject *arena_push_from(Arena *a, PyObject *args) {
    unsigned int slot, batch, dtype = PSD_DTYPE_F32;
    unsigned long long clock;
    double loss;
    float scale;
    PyObject *ptrs, *lens, *bo = Py_None, *sparse = Py_None;
    if (!PyArg_ParseTuple(args, "IKIdfOO|IOO", &slot, &clock, &batch, &loss, &scale, &ptrs, &lens, &dtype, &bo,
                          &sparse) ||
        check_slot(a, slot))
        return NULL;
    PyObject *p = PySequence_Fast(ptrs, "push_from: ptrs must be a sequence of addresses");
    if (!p)
        return NULL;
    PyObject *l = PySequence_Fast(lens, "push_from: lens must be a sequence of lengths");
    if (!l) {
        Py_DECREF(p);
        return NULL;
    }
    Py_ssize_t count = PySequence_Fast_GET_SIZE(p);
    struct psd_src *src = NULL;
    const double *bufdelta = NULL;
    int rc = 0;
    if (count != PySequence_Fast_GET_SIZE(l) || (uint64_t)count != psd_hdr(&a->map)->n_pieces) {
        PyErr_Format(PyExc_ValueError, "push_from: ptrs and lens must both have one item per trainable tensor (%llu)",
                     (unsigned long long)psd_hdr(&a->map)->n_pieces);
        goto out;
    }
    src = PyMem_Calloc((size_t)count + 1, sizeof *src);
    if (!src) {
        PyErr_NoMemory();
        goto out;
    }
    for (Py_ssize_t k = 0; k < count; k++) {
        src[k].data = PyLong_AsVoidPtr(PySequence_Fast_GET_ITEM(p, k));
        src[k].len = PyLong_AsUnsignedLongLong(PySequence_Fast_GET_ITEM(l, k));
        if (PyErr_Occurred())
            goto out;
    }
    if (bo != Py_None && !(bufdelta = PyLong_AsVoidPtr(bo)) && PyErr_Occurred())
        goto out;
    if (sparse != Py_None) {
        PyObject *sp = PySequence_Fast(sparse, "push_from: sparse must be a sequence of (k, rows, nnz, row_len)");
        if (!sp)
            goto out;
        for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(sp); i++) {
            Py_ssize_t k;
            PyObject *rows;
            unsigned long long nnz, row_len;
            if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(sp, i), "nOKK", &k, &rows, &nnz, &row_len))
                break;
            if (k < 0 || k >= count) {
                PyErr_SetString(PyExc_IndexError, "push_from: sparse tensor index out of range");
                break;
            }
            src[k].rows = PyLong_AsVoidPtr(rows);
            src[k].nnz = nnz;
            src[k].row_len = row_len;
            if (PyErr_Occurred())
                break;
        }
        Py_DECREF(sp);
        if (PyErr_Occurred())
            goto out;
    }
    if (psd_hdr(&a->map)->n_params < (UINT64_C(1) << 16)) {
        rc = psd_push_from(&a->map, slot, clock, batch, loss, scale, src, (uint32_t)count, dtype, bufdelta);
    } else {
        Py_BEGIN_ALLOW_THREADS rc =
            psd_push_from(&a->map, slot, clock, batch, loss, scale, src, (uint32_t)count, dtype, bufdelta);
        Py_END_ALLOW_THREADS
    }
    if (rc == EINVAL)
        PyErr_Format(PyExc_ValueError, "push_from: the tensors do not match the job's %llu trainable elements, "
                     "or a sparse gradient names rows outside its tensor", (unsigned long long)psd_hdr(&a->map)->n_train);
    else if (rc)
        raise_code(rc, "push gradient", a->name);
out:
    PyMem_Free(src);
    Py_DECREF(p);
    Py_DECREF(l);
    if (PyErr_Occurred())
        return NULL;
    Py_RETURN_NONE;
}

enum wait_kind { WAIT_SPACE, WAIT_DRAINED, WAIT_FREED };

static PyObject *wait_common(Arena *a, PyObject *args, enum wait_kind kind) {
    unsigned int slot;
    unsigned long long claim;
    double timeout;
    if (!PyArg_ParseTuple(args, "IKd", &slot, &claim, &timeout) || check_slot(a, slot))
        return NULL;
    uint64_t deadline = psd_now_ns() + seconds_to_ns(timeout);
    int rc;
#define LEFT() (deadline > psd_now_ns() ? deadline - psd_now_ns() : 0)
    static const char *const what[] = {"wait for ring space", "wait for ring to drain",
                                       "wait for slot to be freed"};
    if (kind == WAIT_DRAINED)
        BLOCKING(rc, psd_wait_drained(&a->map, slot, claim, LEFT()));
    else if (kind == WAIT_FREED)
        BLOCKING(rc, psd_wait_freed(&a->map, slot, claim, LEFT()));
    else
        BLOCKING(rc, psd_wait_space(&a->map, slot, claim, LEFT()));
#undef LEFT
    if (rc)
        return raise_code(rc, what[kind], a->name);
    Py_RETURN_NONE;
}

static PyObject *arena_wait_space(Arena *a, PyObject *args) { return wait_common(a, args, WAIT_SPACE); }
static PyObject *arena_wait_drained(Arena *a, PyObject *args) { return wait_common(a, args, WAIT_DRAINED); }
static PyObject *arena_wait_freed(Arena *a, PyObject *args) { return wait_common(a, args, WAIT_FREED); }

static PyObject *arena_has_space(Arena *a, PyObject *args) {
    unsigned int slot;
    if (!PyArg_ParseTuple(args, "I", &slot) || check_slot(a, slot))
        return NULL;
    struct psd_slot *s = psd_slot_at(&a->map, slot);
    /* Pairs with the store-release of head in the update loop. */
    return PyBool_FromLong(PSD_LOAD_RLX(&s->tail) - PSD_LOAD_ACQ(&s->head) < psd_hdr(&a->map)->ring_k);
}

static PyObject *arena_reap(Arena *a, PyObject *noargs) {
    (void)noargs;
    if (check_open(a))
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

static PyObject *arena_server_alive(Arena *a, PyObject *args) {
    double stale = 0;
    if (!PyArg_ParseTuple(args, "|d", &stale) || check_open(a))
        return NULL;
    return PyBool_FromLong(psd_server_alive(&a->map, seconds_to_ns(stale)));
}

static PyObject *arena_become_server(Arena *a, PyObject *args) {
    int pid;
    unsigned long long start;
    double lr;
    unsigned int threads, spin_us;
    if (!PyArg_ParseTuple(args, "iKdII", &pid, &start, &lr, &threads, &spin_us) || check_open(a))
        return NULL;
    struct psd_header *h = psd_hdr(&a->map);
    h->lr = lr;
    h->threads = threads;
    h->spin_us = spin_us;
    h->server_start_time = start;
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    h->server_started_unix_ns = (uint64_t)now.tv_sec * 1000000000ull + (uint64_t)now.tv_nsec;
    atomic_store(&h->server_pid, pid);
    /* Pairs with the learners' load of generation: a new server is visible. */
    uint64_t gen = atomic_fetch_add(&h->generation, 1) + 1;
    if (gen > 1)
        atomic_fetch_add(&h->server_restarts, 1);
    return PyLong_FromUnsignedLongLong(gen);
}


/* Server: the training configuration (before the arena is grown: the
 * optimizer and sync mode size the optimizer state). */
static PyObject *arena_configure(Arena *a, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"optimizer", "sync", "sync_param", "push_every", "schedule", "staleness_lr",
                             "predict", "momentum", "dampening", "beta1", "beta2", "eps", "weight_decay",
                             "lr_decay", "gamma", "eta_min", "step_size", "t_max", "warmup", "max_staleness",
                             "async_momentum", NULL};
    const char *opt = "sgd", *sync = "asp", *sched = "constant";
    unsigned int sync_param = 0, push_every = 1, async_momentum = 0;
    int staleness_lr = 0, predict = 0;
    double momentum = 0, dampening = 0, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, wd = 0, lr_decay = 0,
           gamma = 0.1, eta_min = 0;
    unsigned long long step_size = 0, t_max = 0, warmup = 0, max_staleness = UINT64_MAX;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|ssIIsppdddddddddKKKKI", kwlist, &opt, &sync, &sync_param,
                                     &push_every, &sched, &staleness_lr, &predict, &momentum, &dampening,
                                     &beta1, &beta2, &eps, &wd, &lr_decay, &gamma, &eta_min, &step_size,
                                     &t_max, &warmup, &max_staleness, &async_momentum) ||
        check_open(a))
        return NULL;
    int o = name_index("optimizer", opt, optimizer_names, 6), y = name_index("sync mode", sync, sync_names, 4),
        c = name_index("schedule", sched, schedule_names, 3);
    if (o < 0 || y < 0 || c < 0)
        return NULL;
    struct psd_header *h = psd_hdr(&a->map);
    h->optimizer = (uint32_t)o;
    h->sync_mode = (uint32_t)y;
    h->sync_param = sync_param;
    h->push_every = push_every ? push_every : 1;
    h->schedule = (uint32_t)c;
    h->cfg_flags = (staleness_lr ? PSD_CFG_STALENESS_LR : 0) | (predict ? PSD_CFG_PREDICT : 0);
    h->momentum = momentum;
    h->async_momentum = async_momentum;
    h->dampening = dampening;
    h->beta1 = beta1;
    h->beta2 = beta2;
    h->eps = eps;
    h->weight_decay = wd;
    h->lr_decay = lr_decay;
    h->gamma = gamma;
    h->eta_min = eta_min;
    h->step_size = step_size;
    h->t_max = t_max;
    h->warmup = warmup;
    h->max_staleness = max_staleness;
    Py_RETURN_NONE;
}

static PyObject *arena_training(Arena *a, PyObject *noargs) {
    (void)noargs;
    if (check_open(a))
        return NULL;
    struct psd_header *h = psd_hdr(&a->map);
    return Py_BuildValue("{s:s,s:s,s:s}", "optimizer", h->optimizer < 6 ? optimizer_names[h->optimizer] : "?",
                         "sync", h->sync_mode < 4 ? sync_names[h->sync_mode] : "?", "schedule",
                         h->schedule < 3 ? schedule_names[h->schedule] : "?");
}

static PyObject *arena_rounds(Arena *a, PyObject *noargs) {
    (void)noargs;
    if (check_open(a))
        return NULL;
    /* Pairs with the store of rounds in finish_round (update.c). */
    return PyLong_FromUnsignedLongLong(PSD_LOAD_ACQ(&psd_hdr(&a->map)->rounds));
}

static PyObject *arena_wait_round(Arena *a, PyObject *args) {
    unsigned int slot;
    unsigned long long claim, rounds;
    double timeout;
    if (!PyArg_ParseTuple(args, "IKKd", &slot, &claim, &rounds, &timeout) || check_slot(a, slot))
        return NULL;
    int rc;
    BLOCKING(rc, psd_wait_round(&a->map, slot, claim, rounds, seconds_to_ns(timeout)));
    if (rc)
        return raise_code(rc, "wait for the bsp round", a->name);
    Py_RETURN_NONE;
}

static PyObject *arena_wait_ssp(Arena *a, PyObject *args) {
    unsigned int slot;
    unsigned long long claim;
    double timeout;
    if (!PyArg_ParseTuple(args, "IKd", &slot, &claim, &timeout) || check_slot(a, slot))
        return NULL;
    int rc;
    BLOCKING(rc, psd_wait_ssp(&a->map, slot, claim, seconds_to_ns(timeout)));
    if (rc)
        return raise_code(rc, "wait for the slowest learner (ssp)", a->name);
    Py_RETURN_NONE;
}

static PyObject *arena_predict_into(Arena *a, PyObject *args) {
    Py_buffer dst;
    double staleness;
    if (!PyArg_ParseTuple(args, "w*d", &dst, &staleness))
        return NULL;
    if (check_open(a)) {
        PyBuffer_Release(&dst);
        return NULL;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = psd_predict(&a->map, dst.buf, (uint64_t)dst.len / sizeof(float), staleness);
    Py_END_ALLOW_THREADS PyBuffer_Release(&dst);
    if (rc == EINVAL) {
        PyErr_SetString(PyExc_ValueError, "predict_into: the buffer must hold exactly the model's float32 weights");
        return NULL;
    }
    if (rc)
        return raise_code(rc, "predict weights (the optimizer publishes no update direction)", a->name);
    Py_RETURN_NONE;
}

static PyObject *arena_entry_meta(Arena *a, PyObject *args) {
    unsigned int slot;
    unsigned long long seq;
    if (!PyArg_ParseTuple(args, "IK", &slot, &seq) || check_slot(a, slot))
        return NULL;
    struct psd_entry *e = psd_entry_at(&a->map, slot, seq);
    /* Pairs with the store-release of head in take_entry (update.c). */
    uint64_t head = PSD_LOAD_ACQ(&psd_slot_at(&a->map, slot)->head);
    if (e->seq != seq || head <= seq)
        Py_RETURN_NONE; /* overwritten, or not consumed yet */
    return Py_BuildValue("{s:K,s:K,s:K,s:I,s:I}", "seq", (unsigned long long)e->seq, "clock",
                         (unsigned long long)e->clock, "applied_clock", (unsigned long long)e->applied_clock,
                         "outcome", e->outcome, "flags", e->flags);
}

/* start_loop(pieces=None, buffers_set=0): pieces lists (len, row_len) of
 * every trainable tensor in spec order (None: the model is one tensor);
 * buffers_set: leading buffer elements that entries set rather than add to. */
static PyObject *arena_start_loop(Arena *a, PyObject *args) {
    PyObject *po = Py_None;
    unsigned long long buffers_set = 0;
    if (!PyArg_ParseTuple(args, "|OK", &po, &buffers_set) || check_open(a))
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
    int rc = psd_loop_start(&a->map, h->threads, h->spin_us, pieces, (uint64_t)n, buffers_set, &a->loop);
    PyMem_Free(pieces);
    if (rc == EINVAL) {
        PyErr_SetString(PyExc_ValueError, "start_loop: the pieces do not tile the job's trainable weights");
        return NULL;
    }
    if (rc)
        return raise_code(rc, "start update loop", a->name);
    Py_RETURN_NONE;
}

static PyObject *arena_stop_loop(Arena *a, PyObject *noargs) {
    (void)noargs;
    if (a->loop) {
        Py_BEGIN_ALLOW_THREADS psd_loop_stop(a->loop);
        Py_END_ALLOW_THREADS a->loop = NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *arena_counters(Arena *a, PyObject *noargs) {
    (void)noargs;
    if (check_open(a))
        return NULL;
    struct psd_header *h = psd_hdr(&a->map);
    uint64_t pushed = atomic_load(&h->retired_pushed), pending = 0;
    uint32_t active = 0;
    if (PSD_LOAD_ACQ(&h->state) == PSD_ARENA_READY && a->map.size >= h->total_size) {
        for (uint32_t i = 0; i < h->n_slots; i++) {
            struct psd_slot *s = psd_slot_at(&a->map, i);
            if (atomic_load(&s->state) == PSD_SLOT_FREE)
                continue;
            uint64_t tail = atomic_load(&s->tail), head = atomic_load(&s->head);
            pushed += tail;
            pending += tail - head;
            active += atomic_load(&s->state) == PSD_SLOT_ACTIVE;
        }
    }
    return Py_BuildValue("{s:K,s:K,s:K,s:K,s:K,s:K,s:I}", "pushed", (unsigned long long)pushed,
                         "applied", (unsigned long long)atomic_load(&h->applied), "rejected",
                         (unsigned long long)atomic_load(&h->rejected), "dropped",
                         (unsigned long long)atomic_load(&h->dropped), "pending",
                         (unsigned long long)pending, "clock", (unsigned long long)atomic_load(&h->clock),
                         "active_learners", active);
}

static PyObject *arena_grad_offset(Arena *a, PyObject *args) {
    unsigned int slot, k;
    if (!PyArg_ParseTuple(args, "II", &slot, &k) || check_slot(a, slot))
        return NULL;
    struct psd_header *h = psd_hdr(&a->map);
    if (k >= h->ring_k) {
        PyErr_Format(PyExc_IndexError, "ring entry %u out of range (ring has %u)", k, h->ring_k);
        return NULL;
    }
    uint8_t *g = (uint8_t *)psd_entry_grad(psd_entry_at(&a->map, slot, k));
    return PyLong_FromSize_t((size_t)(g - a->map.base));
}

static PyObject *arena_tail(Arena *a, PyObject *args) {
    unsigned int slot;
    if (!PyArg_ParseTuple(args, "I", &slot) || check_slot(a, slot))
        return NULL;
    return PyLong_FromUnsignedLongLong(PSD_LOAD_RLX(&psd_slot_at(&a->map, slot)->tail));
}

static PyObject *arena_head(Arena *a, PyObject *args) {
    unsigned int slot;
    if (!PyArg_ParseTuple(args, "I", &slot) || check_slot(a, slot))
        return NULL;
    /* Pairs with the store of head in take_entry (update.c): the entries before it are free. */
    return PyLong_FromUnsignedLongLong(PSD_LOAD_ACQ(&psd_slot_at(&a->map, slot)->head));
}

static PyObject *arena_clock(Arena *a, PyObject *noargs) {
    (void)noargs;
    if (check_open(a))
        return NULL;
    /* Pairs with the store-release of clock in update_weights: weights copied
     * after this load are at least this fresh. */
    return PyLong_FromUnsignedLongLong(PSD_LOAD_ACQ(&psd_hdr(&a->map)->clock));
}

static PyObject *arena_lr_now(Arena *a, PyObject *noargs) {
    (void)noargs;
    if (check_open(a))
        return NULL;
    return PyFloat_FromDouble(current_lr(psd_hdr(&a->map)));
}

static PyObject *arena_generation(Arena *a, PyObject *noargs) {
    (void)noargs;
    if (check_open(a))
        return NULL;
    return PyLong_FromUnsignedLongLong(atomic_load(&psd_hdr(&a->map)->generation));
}

static PyObject *arena_pull_into(Arena *a, PyObject *args) {
    unsigned int slot;
    unsigned long long known;
    Py_buffer dst;
    if (!PyArg_ParseTuple(args, "Iw*K", &slot, &dst, &known))
        return NULL;
    if (check_slot(a, slot)) {
        PyBuffer_Release(&dst);
        return NULL;
    }
    struct psd_header *h = psd_hdr(&a->map);
    struct psd_slot *s = psd_slot_at(&a->map, slot);
    if ((uint64_t)dst.len != h->n_params * sizeof(float)) {
        PyBuffer_Release(&dst);
        PyErr_SetString(PyExc_ValueError, "pull_into: the buffer must hold n_params float32");
        return NULL;
    }
    /* Pairs with the store-release of clock in the update loop. */
    uint64_t clock = PSD_LOAD_ACQ(&h->clock);
    if (clock == known) {
        PSD_ADD_RLX(&s->pulls_skipped, 1);
    } else {
        Py_BEGIN_ALLOW_THREADS memcpy(dst.buf, psd_weights(&a->map), (size_t)dst.len);
        Py_END_ALLOW_THREADS PSD_ADD_RLX(&s->pulls, 1);
        PSD_STORE_RLX(&s->learner_clock, clock);
    }
    PyBuffer_Release(&dst);
    return PyLong_FromUnsignedLongLong(clock);
}

static PyObject *arena_note_pull(Arena *a, PyObject *args) {
    unsigned int slot, skipped;
    unsigned long long clock;
    if (!PyArg_ParseTuple(args, "IKp", &slot, &clock, &skipped) || check_slot(a, slot))
        return NULL;
    struct psd_slot *s = psd_slot_at(&a->map, slot);
    PSD_STORE_RLX(&s->learner_clock, clock);
    PSD_ADD_RLX(skipped ? &s->pulls_skipped : &s->pulls, 1);
    Py_RETURN_NONE;
}

static PyObject *arena_pause(Arena *a, PyObject *args) {
    int pid;
    unsigned long long start;
    double timeout;
    if (!PyArg_ParseTuple(args, "iKd", &pid, &start, &timeout) || check_open(a))
        return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = psd_pause(&a->map, pid, start, seconds_to_ns(timeout));
    Py_END_ALLOW_THREADS if (rc == EINTR && PyErr_CheckSignals()) return NULL;
    if (rc)
        return raise_code(rc, "pause the update loop", a->name);
    Py_RETURN_NONE;
}

static PyObject *arena_hold(Arena *a, PyObject *args) {
    int pid;
    unsigned long long start;
    long long clock;
    if (!PyArg_ParseTuple(args, "iKL", &pid, &start, &clock) || check_open(a))
        return NULL;
    psd_hold(&a->map, pid, start, (int64_t)clock);
    Py_RETURN_NONE;
}

static PyObject *arena_resume(Arena *a, PyObject *noargs) {
    (void)noargs;
    if (check_open(a))
        return NULL;
    psd_resume(&a->map);
    Py_RETURN_NONE;
}

static PyObject *arena_beat(Arena *a, PyObject *noargs) {
    (void)noargs;
    if (check_open(a))
        return NULL;
    PSD_STORE_RLX(&psd_hdr(&a->map)->heartbeat_ns, psd_now_ns());
    Py_RETURN_NONE;
}

static PyObject *arena_identity(Arena *a, PyObject *noargs) {
    (void)noargs;
    struct stat st;
    if (check_open(a))
        return NULL;
    if (fstat(a->map.fd, &st) != 0)
        return raise_code(errno, "stat arena", a->name);
    return Py_BuildValue("(KK)", (unsigned long long)st.st_dev, (unsigned long long)st.st_ino);
}

static PyObject *arena_ranks(Arena *a, PyObject *noargs) {
    (void)noargs;
    if (check_open(a))
        return NULL;
    struct psd_header *h = psd_hdr(&a->map);
    PyObject *list = PyList_New(h->n_slots);
    if (!list)
        return NULL;
    for (uint32_t r = 0; r < h->n_slots; r++) {
        PyObject *v = PyLong_FromUnsignedLongLong(atomic_load(&psd_rank_at(&a->map, r)->applied));
        if (!v) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, r, v);
    }
    return list;
}

static PyObject *arena_restore(Arena *a, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"clock", "generation", "ranks", "opt_steps", "rounds", "acc_count", "acc_staleness",
                             "lr_now", NULL};
    unsigned long long clock, generation, opt_steps = 0, rounds = 0, acc_count = 0, acc_staleness = 0;
    double lr_now = 0;
    PyObject *ranks;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "KKO|KKKKd", kwlist, &clock, &generation, &ranks, &opt_steps,
                                     &rounds, &acc_count, &acc_staleness, &lr_now) ||
        check_open(a))
        return NULL;
    struct psd_header *h = psd_hdr(&a->map);
    if (PSD_LOAD_ACQ(&h->state) == PSD_ARENA_READY)
        return raise_code(PSD_ESTATE, "restore a checkpoint into a running arena", a->name);
    PyObject *seq = PySequence_Fast(ranks, "ranks must be a sequence of ints");
    if (!seq)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    for (Py_ssize_t r = 0; r < n && (uint64_t)r < h->n_slots; r++) {
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
    uint64_t lr_bits;
    memcpy(&lr_bits, &lr_now, sizeof lr_bits);
    PSD_STORE_RLX(&h->lr_bits, lr_bits);
    atomic_store(&h->generation, generation);
    Py_RETURN_NONE;
}

static PyObject *arena_note_watchdog(Arena *a, PyObject *args) {
    int pid;
    unsigned long long start;
    if (!PyArg_ParseTuple(args, "iK", &pid, &start) || check_open(a))
        return NULL;
    struct psd_header *h = psd_hdr(&a->map);
    atomic_store(&h->watchdog_start_time, start);
    atomic_store(&h->watchdog_pid, pid);
    Py_RETURN_NONE;
}

static PyObject *arena_note_checkpoint(Arena *a, PyObject *args) {
    unsigned long long clock, unix_ns;
    if (!PyArg_ParseTuple(args, "KK", &clock, &unix_ns) || check_open(a))
        return NULL;
    struct psd_header *h = psd_hdr(&a->map);
    atomic_store(&h->checkpoint_clock, clock);
    atomic_store(&h->checkpoint_unix_ns, unix_ns);
    Py_RETURN_NONE;
}

/* Fault injection for tests and chaos scripts: take one of the arena's robust
 * mutexes and keep it, so that the process can be killed while holding it. */
static pthread_mutex_t *named_mutex(Arena *a, const char *which, unsigned int slot) {
    if (check_open(a))
        return NULL;
    if (strcmp(which, "admission") == 0)
        return &psd_hdr(&a->map)->admission;
    if (strcmp(which, "slot") == 0 && check_slot(a, slot) == 0)
        return &psd_slot_at(&a->map, slot)->mutex;
    if (!PyErr_Occurred())
        PyErr_Format(PyExc_ValueError, "no mutex %s (use 'admission' or 'slot')", which);
    return NULL;
}

static PyObject *arena_hold_mutex(Arena *a, PyObject *args) {
    const char *which;
    unsigned int slot = 0;
    if (!PyArg_ParseTuple(args, "s|I", &which, &slot))
        return NULL;
    pthread_mutex_t *mu = named_mutex(a, which, slot);
    if (!mu)
        return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = psd_mutex_lock(psd_hdr(&a->map), mu);
    Py_END_ALLOW_THREADS if (!psd_locked(rc)) return raise_code(rc, "lock", a->name);
    return PyBool_FromLong(rc == PSD_EOWNERDEAD); /* True: taken over from a dead owner */
}

static PyObject *arena_release_mutex(Arena *a, PyObject *args) {
    const char *which;
    unsigned int slot = 0;
    if (!PyArg_ParseTuple(args, "s|I", &which, &slot))
        return NULL;
    pthread_mutex_t *mu = named_mutex(a, which, slot);
    if (!mu)
        return NULL;
    psd_mutex_unlock(mu);
    Py_RETURN_NONE;
}

static PyObject *arena_close(Arena *a, PyObject *noargs) {
    (void)noargs;
    if (a->exports)
        return raise_code(PSD_EEXPORTS, "close arena", NULL);
    if (a->loop) {
        Py_BEGIN_ALLOW_THREADS psd_loop_stop(a->loop);
        Py_END_ALLOW_THREADS a->loop = NULL;
    }
    psd_arena_close(&a->map);
    Py_RETURN_NONE;
}

static PyObject *arena_get_name(Arena *a, void *closure) {
    (void)closure;
    return PyUnicode_FromString(a->name);
}
static PyObject *arena_get_state(Arena *a, void *closure) {
    (void)closure;
    if (check_open(a))
        return NULL;
    return PyLong_FromUnsignedLong(PSD_LOAD_ACQ(&psd_hdr(&a->map)->state));
}
static PyObject *arena_get_closed(Arena *a, void *closure) {
    (void)closure;
    return PyBool_FromLong(a->map.base == NULL);
}
static PyObject *arena_get_exports(Arena *a, void *closure) {
    (void)closure;
    return PyLong_FromSsize_t(a->exports);
}

/* ---- Puller: a learner's native pull thread ------------------------------ */

typedef struct {
    PyObject_HEAD struct psd_puller *p;
    PyObject *arena; /* keeps the mapping alive while the thread reads it */
    Py_buffer front, back;
} Puller;

static PyTypeObject PullerType;

static void puller_stop_now(Puller *P) {
    if (P->p) {
        Py_BEGIN_ALLOW_THREADS psd_puller_stop(P->p);
        Py_END_ALLOW_THREADS P->p = NULL;
        ((Arena *)P->arena)->exports--; /* the mapping may be closed again */
        PyBuffer_Release(&P->front);
        PyBuffer_Release(&P->back);
        Py_CLEAR(P->arena);
    }
}

static void puller_dealloc(Puller *P) {
    puller_stop_now(P);
    PyObject_Free(P);
}

static PyObject *puller_request(Puller *P, PyObject *noargs) {
    (void)noargs;
    if (P->p)
        psd_puller_request(P->p);
    Py_RETURN_NONE;
}

static PyObject *puller_take(Puller *P, PyObject *noargs) {
    (void)noargs;
    uint64_t clock = 0;
    int idx = P->p ? psd_puller_take(P->p, &clock) : -1;
    if (idx < 0)
        Py_RETURN_NONE;
    return Py_BuildValue("(iK)", idx, (unsigned long long)clock);
}

static PyObject *puller_set_front_clock(Puller *P, PyObject *args) {
    unsigned long long clock;
    if (!PyArg_ParseTuple(args, "K", &clock))
        return NULL;
    if (P->p)
        psd_puller_set_front_clock(P->p, clock);
    Py_RETURN_NONE;
}

static PyObject *puller_stop(Puller *P, PyObject *noargs) {
    (void)noargs;
    puller_stop_now(P);
    Py_RETURN_NONE;
}

static PyMethodDef puller_methods[] = {
    {"request", (PyCFunction)puller_request, METH_NOARGS, "Ask for a pull (a queue of one)."},
    {"take", (PyCFunction)puller_take, METH_NOARGS,
     "If fresher weights are ready: (index of the new front buffer, their clock); else None."},
    {"set_front_clock", (PyCFunction)puller_set_front_clock, METH_VARARGS, "The front buffer now holds this clock."},
    {"stop", (PyCFunction)puller_stop, METH_NOARGS, "Stop and join the thread."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject PullerType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "psd._native.Puller",
    .tp_basicsize = sizeof(Puller),
    .tp_dealloc = (destructor)puller_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A learner's native pull thread; made by Arena.start_puller().",
    .tp_methods = puller_methods,
};

static PyObject *arena_start_puller(Arena *a, PyObject *args) {
    unsigned int slot;
    unsigned long long clock;
    PyObject *fo, *bo;
    if (!PyArg_ParseTuple(args, "IOOK", &slot, &fo, &bo, &clock) || check_slot(a, slot))
        return NULL;
    Puller *P = PyObject_New(Puller, &PullerType);
    if (!P)
        return NULL;
    P->p = NULL;
    P->arena = NULL;
    if (PyObject_GetBuffer(fo, &P->front, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS)) {
        PyObject_Free(P);
        return NULL;
    }
    if (PyObject_GetBuffer(bo, &P->back, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS)) {
        PyBuffer_Release(&P->front);
        PyObject_Free(P);
        return NULL;
    }
    uint64_t n = psd_hdr(&a->map)->n_params;
    if ((uint64_t)P->front.len != n * sizeof(float) || (uint64_t)P->back.len != n * sizeof(float)) {
        PyBuffer_Release(&P->front);
        PyBuffer_Release(&P->back);
        PyObject_Free(P);
        PyErr_SetString(PyExc_ValueError, "start_puller: buffers must hold n_params float32 each");
        return NULL;
    }
    int rc = psd_puller_start(&a->map, slot, P->front.buf, P->back.buf, n, clock, &P->p);
    if (rc) {
        PyBuffer_Release(&P->front);
        PyBuffer_Release(&P->back);
        PyObject_Free(P);
        return raise_code(rc, "start pull thread", a->name);
    }
    Py_INCREF(a);
    P->arena = (PyObject *)a;
    a->exports++; /* a running puller reads the mapping: it must not be closed under it */
    return (PyObject *)P;
}

static PyMethodDef arena_methods[] = {
    {"header", (PyCFunction)arena_header, METH_NOARGS, "All header fields, as a dict."},
    {"slot_info", (PyCFunction)arena_slot_info, METH_VARARGS, "One learner slot's fields, as a dict."},
    {"spec", (PyCFunction)arena_spec, METH_NOARGS, "The parameter spec bytes, or None before one was offered."},
    {"set_spec", (PyCFunction)arena_set_spec, METH_VARARGS,
     "set_spec(data, hash, (n_params, n_train, n_buffers, n_pieces), pid, start_time) -> bool: offer a spec; "
     "False if one was offered already."},
    {"grow", (PyCFunction)arena_grow, METH_NOARGS, "Server: grow the arena for the offered spec."},
    {"remap", (PyCFunction)arena_remap, METH_NOARGS, "Map the arena at its current size."},
    {"set_state", (PyCFunction)arena_set_state, METH_VARARGS, "set_state(state, message=None)"},
    {"wait_state", (PyCFunction)arena_wait_state, METH_VARARGS,
     "wait_state(not_state, timeout) -> bool: wait until the state is not `not_state`."},
    {"claim", (PyCFunction)arena_claim, METH_VARARGS, "claim(pid, start_time) -> (slot, claim)"},
    {"release", (PyCFunction)arena_release, METH_VARARGS, "release(slot, claim)"},
    {"push", (PyCFunction)arena_push, METH_VARARGS,
     "push(slot, clock, batch, loss, scale=1, bufdelta=None): scale and check the entry at the tail (every tensor "
     "dense), copy n_buffers doubles from the address bufdelta along, publish it."},
    {"push_from", (PyCFunction)arena_push_from, METH_VARARGS,
     "push_from(slot, clock, batch, loss, scale, ptrs, lens, dtype=0, bufdelta=None, sparse=None): copy the "
     "gradient tensor by tensor from the addresses ptrs (0: none) into the entry at the tail, converted to float32, "
     "scaled and checked, and publish it; sparse: (k, rows_ptr, nnz, row_len) per sparse tensor."},
    {"wait_space", (PyCFunction)arena_wait_space, METH_VARARGS, "wait_space(slot, claim, timeout)"},
    {"wait_drained", (PyCFunction)arena_wait_drained, METH_VARARGS, "wait_drained(slot, claim, timeout)"},
    {"wait_freed", (PyCFunction)arena_wait_freed, METH_VARARGS, "wait_freed(slot, claim, timeout)"},
    {"has_space", (PyCFunction)arena_has_space, METH_VARARGS, "has_space(slot) -> bool"},
    {"reap", (PyCFunction)arena_reap, METH_NOARGS, "Server: mark slots of dead learners draining; returns their pids."},
    {"server_alive", (PyCFunction)arena_server_alive, METH_VARARGS, "server_alive(stale_s=0) -> bool"},
    {"become_server", (PyCFunction)arena_become_server, METH_VARARGS,
     "become_server(pid, start_time, lr, threads, spin_us) -> generation"},
    {"configure", (PyCFunction)(void (*)(void))arena_configure, METH_VARARGS | METH_KEYWORDS,
     "Server: the training configuration (optimizer, sync mode, schedule, staleness control)."},
    {"training", (PyCFunction)arena_training, METH_NOARGS, "optimizer, sync mode and schedule, by name."},
    {"rounds", (PyCFunction)arena_rounds, METH_NOARGS, "bsp / kasync rounds completed."},
    {"wait_round", (PyCFunction)arena_wait_round, METH_VARARGS,
     "wait_round(slot, claim, rounds, timeout): bsp, until more than `rounds` rounds are complete"},
    {"wait_ssp", (PyCFunction)arena_wait_ssp, METH_VARARGS,
     "wait_ssp(slot, claim, timeout): ssp, until this learner is at most S pushes ahead of the slowest"},
    {"predict_into", (PyCFunction)arena_predict_into, METH_VARARGS,
     "predict_into(weights, staleness): weights -= lr * staleness * the optimizer's update direction"},
    {"entry_meta", (PyCFunction)arena_entry_meta, METH_VARARGS,
     "entry_meta(slot, seq) -> clock, applied_clock, outcome of a consumed gradient, or None"},
    {"start_loop", (PyCFunction)arena_start_loop, METH_VARARGS,
     "start_loop(pieces=None, buffers_set=0): Server: start the native update loop; pieces: (len, row_len) per "
     "trainable tensor; buffers_set: leading buffer elements that entries set (the rest they add to)."},
    {"stop_loop", (PyCFunction)arena_stop_loop, METH_NOARGS, "Server: stop the update loop and join it."},
    {"counters", (PyCFunction)arena_counters, METH_NOARGS, "pushed, applied, rejected, pending, clock."},
    {"grad_offset", (PyCFunction)arena_grad_offset, METH_VARARGS, "grad_offset(slot, k) -> byte offset"},
    {"tail", (PyCFunction)arena_tail, METH_VARARGS, "tail(slot) -> the slot's producer index"},
    {"head", (PyCFunction)arena_head, METH_VARARGS, "head(slot) -> the slot's consumer index"},
    {"clock", (PyCFunction)arena_clock, METH_NOARGS, "The weights clock (load-acquire)."},
    {"lr_now", (PyCFunction)arena_lr_now, METH_NOARGS,
     "The server's current learning rate: the scheduled lr of the last update (before any, of the first)."},
    {"generation", (PyCFunction)arena_generation, METH_NOARGS, "Servers started on this arena so far."},
    {"note_pull", (PyCFunction)arena_note_pull, METH_VARARGS, "note_pull(slot, clock, skipped)"},
    {"pause", (PyCFunction)arena_pause, METH_VARARGS,
     "pause(pid, start_time, timeout): stop the update loop between two gradients (for a snapshot)"},
    {"resume", (PyCFunction)arena_resume, METH_NOARGS, "Let a paused update loop go on."},
    {"hold", (PyCFunction)arena_hold, METH_VARARGS,
     "hold(pid, start_time, clock): the update loop stops right after the update that brings its clock to "
     "clock, or before any while it is there (clock < 0: no hold), until the hold is moved or cleared, or "
     "the holder dies; header()['held'] says it stopped"},
    {"beat", (PyCFunction)arena_beat, METH_NOARGS, "Server: store a heartbeat now."},
    {"identity", (PyCFunction)arena_identity, METH_NOARGS, "(device, inode) of the mapped object"},
    {"ranks", (PyCFunction)arena_ranks, METH_NOARGS, "Gradients applied per learner rank."},
    {"restore", (PyCFunction)(void (*)(void))arena_restore, METH_VARARGS | METH_KEYWORDS,
     "restore(clock, generation, ranks): server, before READY: continue from a checkpoint"},
    {"note_watchdog", (PyCFunction)arena_note_watchdog, METH_VARARGS, "note_watchdog(pid, start_time)"},
    {"note_checkpoint", (PyCFunction)arena_note_checkpoint, METH_VARARGS, "note_checkpoint(clock, unix_ns)"},
    {"hold_mutex", (PyCFunction)arena_hold_mutex, METH_VARARGS,
     "hold_mutex('admission'|'slot', slot=0) -> bool: fault injection; True if a dead owner's lock was recovered. "
     "Keep the arena mapped while holding it: the kernel frees a dead owner's lock only through a live mapping"},
    {"release_mutex", (PyCFunction)arena_release_mutex, METH_VARARGS, "release_mutex('admission'|'slot', slot=0)"},
    {"pull_into", (PyCFunction)arena_pull_into, METH_VARARGS,
     "pull_into(slot, buffer, known_clock) -> clock: copy the weights into buffer unless still at known_clock"},
    {"start_puller", (PyCFunction)arena_start_puller, METH_VARARGS,
     "start_puller(slot, front, back, clock) -> Puller: a native thread that pulls into back"},
    {"close", (PyCFunction)arena_close, METH_NOARGS, "Unmap; fails while buffers are exported."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef arena_getset[] = {
    {"name", (getter)arena_get_name, NULL, "shared-memory object name", NULL},
    {"state", (getter)arena_get_state, NULL, "arena life-cycle state", NULL},
    {"closed", (getter)arena_get_closed, NULL, "whether unmapped", NULL},
    {"exports", (getter)arena_get_exports, NULL, "buffers exported over the mapping", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject ArenaType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "psd._native.Arena",
    .tp_basicsize = sizeof(Arena),
    .tp_dealloc = (destructor)arena_dealloc,
    .tp_as_buffer = &arena_as_buffer,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One mapping of a psd arena. Made by create() or open().",
    .tp_methods = arena_methods,
    .tp_getset = arena_getset,
};

static PyMethodDef module_methods[] = {
    {"create", mod_create, METH_VARARGS,
     "create(shm_name, mode, n_slots, ring_k, spec_cap, version) -> Arena (server only)"},
    {"open", mod_open, METH_VARARGS, "open(shm_name) -> Arena"},
    {"unlink", mod_unlink, METH_VARARGS, "unlink(shm_name): remove the shared-memory object"},
    {"proc_start_time", mod_proc_start_time, METH_VARARGS, "proc_start_time(pid) -> int (0: no such process)"},
    {"owner_alive", mod_owner_alive, METH_VARARGS,
     "owner_alive(pid, start_time) -> bool: that pid still names the process that started then"},
    {"arena_size", mod_arena_size, METH_VARARGS,
     "arena_size(n_slots, ring_k, spec_cap, n_params, vectors=0, n_train=n_params, n_buffers=0, n_pieces=1) "
     "-> bytes the arena will take"},
    {"state_vectors", mod_state_vectors, METH_VARARGS,
     "state_vectors(optimizer, sync) -> weight-sized vectors of optimizer state (and accumulator) an arena holds"},
    {"omp_info", mod_omp_info, METH_NOARGS, "OpenMP's view of this machine: max_threads, num_procs"},
    {"apply_sgd_kernel", mod_apply_sgd_kernel, METH_VARARGS,
     "apply_sgd_kernel(w, g, lr, kernel): w -= lr*g in place, one thread, kernel 0 scalar, 1 the compiler's "
     "vectorised loop, 2 and 3 vectors unrolled 4 and 8 times"},
    {"apply_sgd", mod_apply_sgd, METH_VARARGS,
     "apply_sgd(w, g, lr, threads): w -= lr*g in place, the update loop's kernel"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT, "psd._native", "psd's C core: arena, rings, robust locks, update loop.", -1,
    module_methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__native(void) {
    if (PyType_Ready(&ArenaType) < 0 || PyType_Ready(&PullerType) < 0)
        return NULL;
    errors_module = PyImport_ImportModule("psd.errors");
    if (!errors_module)
        return NULL;
    PyObject *m = PyModule_Create(&native_module);
    if (!m)
        return NULL;
    Py_INCREF(&ArenaType);
    if (PyModule_AddObject(m, "Arena", (PyObject *)&ArenaType) < 0)
        return NULL;
    PyModule_AddIntConstant(m, "LAYOUT_VERSION", PSD_LAYOUT_VERSION);
    PyModule_AddIntConstant(m, "HEADER_SIZE", PSD_HEADER_SIZE);
    PyModule_AddIntConstant(m, "MAX_SLOTS", PSD_MAX_SLOTS);
    PyModule_AddIntConstant(m, "MAX_RING", PSD_MAX_RING);
    PyModule_AddIntConstant(m, "SLOT_RANK_OFFSET", (long)offsetof(struct psd_slot, rank));
    PyModule_AddIntConstant(m, "SLOT_TAIL_OFFSET", (long)offsetof(struct psd_slot, tail));
    PyModule_AddIntConstant(m, "ENTRY_SEQ_OFFSET", (long)offsetof(struct psd_entry, seq));
    PyModule_AddIntConstant(m, "DTYPE_F32", PSD_DTYPE_F32);
    PyModule_AddIntConstant(m, "DTYPE_BF16", PSD_DTYPE_BF16);
    PyModule_AddIntConstant(m, "DTYPE_F16", PSD_DTYPE_F16);
    PyModule_AddIntConstant(m, "PIECE_ABSENT", PSD_PIECE_ABSENT);
    PyModule_AddIntConstant(m, "PIECE_DENSE", PSD_PIECE_DENSE);
    PyModule_AddIntConstant(m, "PIECE_SPARSE", PSD_PIECE_SPARSE);
    PyModule_AddIntConstant(m, "KERNEL_SCALAR", PSD_KERNEL_SCALAR);
    PyModule_AddIntConstant(m, "KERNEL_VECTOR", PSD_KERNEL_VECTOR);
    PyModule_AddIntConstant(m, "KERNEL_UNROLL4", PSD_KERNEL_UNROLL4);
    PyModule_AddIntConstant(m, "KERNEL_UNROLL8", PSD_KERNEL_UNROLL8);
    PyModule_AddIntConstant(m, "ARENA_WAITING_SPEC", PSD_ARENA_WAITING_SPEC);
    PyModule_AddIntConstant(m, "ARENA_SPEC_OFFERED", PSD_ARENA_SPEC_OFFERED);
    PyModule_AddIntConstant(m, "ARENA_INIT_WEIGHTS", PSD_ARENA_INIT_WEIGHTS);
    PyModule_AddIntConstant(m, "ARENA_READY", PSD_ARENA_READY);
    PyModule_AddIntConstant(m, "ARENA_STOPPED", PSD_ARENA_STOPPED);
    PyModule_AddIntConstant(m, "SLOT_FREE", PSD_SLOT_FREE);
    PyModule_AddIntConstant(m, "SLOT_ACTIVE", PSD_SLOT_ACTIVE);
    PyModule_AddIntConstant(m, "SLOT_DRAINING", PSD_SLOT_DRAINING);
    PyModule_AddIntConstant(m, "OUTCOME_PENDING", PSD_OUTCOME_PENDING);
    PyModule_AddIntConstant(m, "OUTCOME_APPLIED", PSD_OUTCOME_APPLIED);
    PyModule_AddIntConstant(m, "OUTCOME_REJECTED", PSD_OUTCOME_REJECTED);
    PyModule_AddIntConstant(m, "OUTCOME_DROPPED", PSD_OUTCOME_DROPPED);
    PyModule_AddIntConstant(m, "CFG_STALENESS_LR", PSD_CFG_STALENESS_LR);
    PyModule_AddIntConstant(m, "CFG_PREDICT", PSD_CFG_PREDICT);
    return m;
}
