/*
 * py_module.c -- psd._native itself: module init, the module-level functions
 * that need no arena (sizes, liveness, the update kernels for `psd bench`), the
 * joined method table of Arena, and the one table that turns C error codes
 * into subclasses of psd.Error (raise_code). The rest of the binding is in the
 * other native/py_*.c files (py_psd.h says which holds what).
 */
#include "py_psd.h"

#include <omp.h>
#include <string.h>

#include "psd_sigbus.h"

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
    {PSD_EINIT, "ArenaIncomplete"}, {PSD_EGEOMETRY, "ArenaCorrupt"},
    {PSD_EEVICTED, "Evicted"},       {PSD_ELOST, "ArenaLost"},
};

PyObject *error_type(const char *cls) { return PyObject_GetAttrString(errors_module, cls); }

PyObject *raise_code(int code, const char *op, const char *filename) {
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
    PyObject *type = error_type(cls);
    if (!type)
        return NULL;
    PyErr_Format(type, "%s: %s", op, psd_strerror(code));
    Py_DECREF(type);
    return NULL;
}

int name_index(const char *what, const char *name, const char *const *names, int n) {
    for (int i = 0; i < n; i++)
        if (strcmp(name, names[i]) == 0)
            return i;
    PyErr_Format(PyExc_ValueError, "unknown %s '%s'", what, name);
    return -1;
}

const char *const optimizer_names[N_OPTIMIZERS] = {"sgd", "momentum", "nesterov", "adam", "adamw", "adagrad"};
const char *const sync_names[N_SYNCS] = {"asp", "ssp", "bsp", "kasync"};
const char *const schedule_names[N_SCHEDULES] = {"constant", "step", "cosine"};

static PyObject *mod_install_sigbus_handler(PyObject *self, PyObject *args) {
    (void)self;
    int status, recover = 0;
    if (!PyArg_ParseTuple(args, "i|p", &status, &recover))
        return NULL;
    int rc = psd_sigbus_install(status);
    if (rc)
        return raise_code(rc, "install SIGBUS handler", NULL);
    psd_sigbus_recover(recover);
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
    long long pid; /* whatever an arena held: a value no pid takes is simply not alive */
    unsigned long long start;
    if (!PyArg_ParseTuple(args, "LK", &pid, &start))
        return NULL;
    return PyBool_FromLong(pid > 0 && pid <= INT32_MAX && psd_owner_alive((pid_t)pid, start));
}

static PyObject *mod_pid_ns(PyObject *self, PyObject *noargs) {
    (void)self;
    (void)noargs;
    return PyLong_FromUnsignedLongLong(psd_pid_ns());
}

static PyObject *mod_liveness(PyObject *self, PyObject *args) {
    (void)self;
    long long pid; /* whatever an arena held: a value no pid takes is "dead" */
    int lease_only = 0;
    unsigned long long start, pid_ns;
    if (!PyArg_ParseTuple(args, "LKK|p", &pid, &start, &pid_ns, &lease_only))
        return NULL;
    struct psd_header h; /* only cfg.cfg_flags is read */
    h.cfg.cfg_flags = lease_only ? PSD_CFG_LEASE_ONLY : 0;
    static const char *const names[] = {"unknown", "alive", "dead"};
    pid_t p = pid > 0 && pid <= INT32_MAX ? (pid_t)pid : 0;
    return PyUnicode_FromString(names[psd_liveness(&h, p, start, pid_ns)]);
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

static PyObject *mod_state_vectors(PyObject *self, PyObject *args) {
    (void)self;
    const char *opt, *sync;
    if (!PyArg_ParseTuple(args, "ss", &opt, &sync))
        return NULL;
    int o = name_index("optimizer", opt, optimizer_names, N_OPTIMIZERS), y = name_index("sync mode", sync, sync_names, N_SYNCS);
    if (o < 0 || y < 0)
        return NULL;
    return PyLong_FromUnsignedLong(psd_state_vectors((uint32_t)o, (uint32_t)y));
}

static PyObject *mod_omp_info(PyObject *self, PyObject *noargs) {
    (void)self;
    (void)noargs;
    return Py_BuildValue("{s:i,s:i}", "max_threads", omp_get_max_threads(), "num_procs", omp_get_num_procs());
}

/* apply_sgd / apply_sgd_bf16 / apply_sgd_kernel: w -= lr*g in place through `fn`, whose last
 * argument (threads, or which kernel) comes from Python; g holds as many elements as w, of
 * `g_size` bytes each (float32, or bfloat16 for apply_sgd_bf16); EINVAL: no such kernel. */
typedef int (*sgd_fn)(float *restrict w, const void *restrict g, uint64_t n, float lr, int arg);

static int sgd_threads(float *restrict w, const void *restrict g, uint64_t n, float lr, int threads) {
    psd_apply_sgd(w, g, PSD_DTYPE_F32, n, lr, threads, NULL, NULL);
    return 0;
}

static int sgd_threads_bf16(float *restrict w, const void *restrict g, uint64_t n, float lr, int threads) {
    psd_apply_sgd(w, g, PSD_DTYPE_BF16, n, lr, threads, NULL, NULL);
    return 0;
}

static int sgd_kernel(float *restrict w, const void *restrict g, uint64_t n, float lr, int kernel) {
    return psd_apply_sgd_kernel(w, g, n, lr, kernel);
}

static PyObject *sgd_call(PyObject *args, const char *name, sgd_fn fn, Py_ssize_t g_size) {
    Py_buffer w, g;
    float lr;
    int arg, rc = 0;
    if (!PyArg_ParseTuple(args, "w*y*fi", &w, &g, &lr, &arg))
        return NULL;
    if (w.len % (Py_ssize_t)sizeof(float) || g.len != w.len / (Py_ssize_t)sizeof(float) * g_size) {
        PyErr_Format(PyExc_ValueError, "%s: w must be float32 and g %s, of one length", name,
                     g_size == 2 ? "bfloat16" : "float32");
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
    return sgd_call(args, "apply_sgd", sgd_threads, 4);
}

static PyObject *mod_apply_sgd_bf16(PyObject *self, PyObject *args) {
    (void)self;
    return sgd_call(args, "apply_sgd_bf16", sgd_threads_bf16, 2);
}

static PyObject *mod_apply_sgd_kernel(PyObject *self, PyObject *args) {
    (void)self;
    return sgd_call(args, "apply_sgd_kernel", sgd_kernel, 4);
}

/* optimizer_step(optimizer, w, g, s0, s1, lr, t, threads, weight_decay, momentum, beta1, beta2, eps, gscale,
 * grad_bf16) -> non-finite count: one update of the server's optimizer kernel over plain buffers, as the
 * update loop makes it (psd_optimizer_step with a configuration of the optimizer's settings alone), for
 * `psd bench` against torch's fused optimizers and for the kernel tests. s0/s1: the state vectors the
 * optimizer needs (None otherwise); g float32, or bfloat16 with grad_bf16. */
static PyObject *mod_optimizer_step(PyObject *self, PyObject *args) {
    (void)self;
    const char *opt;
    Py_buffer w = {0}, g = {0}, s0 = {0}, s1 = {0};
    PyObject *o0, *o1;
    double lr, wd, mom, b1, b2, eps;
    float gscale;
    unsigned long long t;
    int threads, bf16;
    if (!PyArg_ParseTuple(args, "sw*y*OOdKidddddfp", &opt, &w, &g, &o0, &o1, &lr, &t, &threads, &wd, &mom, &b1,
                          &b2, &eps, &gscale, &bf16))
        return NULL;
    PyObject *result = NULL;
    int o = name_index("optimizer", opt, optimizer_names, N_OPTIMIZERS);
    if (o < 0)
        goto out;
    uint64_t n = (uint64_t)w.len / sizeof(float);
    uint32_t vectors = psd_state_vectors((uint32_t)o, PSD_SYNC_ASP);
    if (w.len % (Py_ssize_t)sizeof(float) || (uint64_t)g.len != n * (bf16 ? 2u : 4u) || t < 1 || threads < 1) {
        PyErr_SetString(PyExc_ValueError, "optimizer_step: w float32, g of w's length (float32, or bfloat16 with "
                                          "grad_bf16), t >= 1, threads >= 1");
        goto out;
    }
    if ((vectors >= 1 && (o0 == Py_None || PyObject_GetBuffer(o0, &s0, PyBUF_WRITABLE) < 0)) ||
        (vectors >= 2 && (o1 == Py_None || PyObject_GetBuffer(o1, &s1, PyBUF_WRITABLE) < 0))) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_ValueError, "optimizer_step: %s needs %u state vector(s)", opt, vectors);
        goto out;
    }
    if ((s0.buf && (uint64_t)s0.len != n * 4) || (s1.buf && (uint64_t)s1.len != n * 4)) {
        PyErr_SetString(PyExc_ValueError, "optimizer_step: state vectors are float32 of w's length");
        goto out;
    }
    const struct psd_config c = {.optimizer = (uint32_t)o, .momentum = mom, .beta1 = b1, .beta2 = b2, .eps = eps,
                                 .weight_decay = wd, .async_momentum = PSD_ASYNC_MOMENTUM_OFF};
    _Atomic uint64_t bad = 0;
    Py_BEGIN_ALLOW_THREADS psd_optimizer_step(&c, mom, w.buf, g.buf, bf16 ? PSD_DTYPE_BF16 : PSD_DTYPE_F32, gscale,
                                              s0.buf, s1.buf, n, lr, t, threads, NULL, &bad);
    Py_END_ALLOW_THREADS result = PyLong_FromUnsignedLongLong(PSD_LOAD_RLX(&bad));
out:
    PyBuffer_Release(&w);
    PyBuffer_Release(&g);
    if (s0.buf)
        PyBuffer_Release(&s0);
    if (s1.buf)
        PyBuffer_Release(&s1);
    return result;
}

static PyMethodDef module_methods[] = {
    {"optimizer_step", mod_optimizer_step, METH_VARARGS,
     "optimizer_step(optimizer, w, g, s0, s1, lr, t, threads, weight_decay, momentum, beta1, beta2, eps, gscale, "
     "grad_bf16) -> non-finite values taken as 0: one update of the server's kernel over plain buffers"},
    {"proc_start_time", mod_proc_start_time, METH_VARARGS, "proc_start_time(pid) -> int (0: no such process)"},
    {"install_sigbus_handler", mod_install_sigbus_handler, METH_VARARGS,
     "install_sigbus_handler(status, recover=False): a SIGBUS on an arena mapping prints why and exits with "
     "status; with recover, the mapping becomes zero pages and its reads raise ArenaLost (Arena.lost())"},
    {"pid_ns", mod_pid_ns, METH_NOARGS, "pid_ns() -> int: inode of this process's PID namespace (0: unknown)"},
    {"liveness", mod_liveness, METH_VARARGS,
     "liveness(pid, start_time, pid_ns, lease_only=False) -> 'alive' | 'dead' | 'unknown' (/proc cannot tell: "
     "the lease decides)"},
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
    {"apply_sgd_bf16", mod_apply_sgd_bf16, METH_VARARGS,
     "apply_sgd_bf16(w, g, lr, threads): w -= lr*g in place, g bfloat16 (--grad-dtype bf16's kernel)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT, "psd._native", "psd's C core: arena, rings, robust locks, update loop.", -1,
    module_methods, NULL, NULL, NULL, NULL,
};

#define HEADER_NAME_FMT(f, how) "s"
#define HEADER_NAME_ARG(f, how) , #f

/* Arena's methods: the tables of every file of the binding, joined once. */
static PyMethodDef *join_methods(void) {
    PyMethodDef *const parts[] = {py_arena_methods, py_learner_methods, py_server_methods, py_inspect_methods};
    size_t n = 1;
    for (size_t p = 0; p < sizeof parts / sizeof parts[0]; p++)
        for (const PyMethodDef *d = parts[p]; d->ml_name; d++)
            n++;
    PyMethodDef *all = PyMem_Calloc(n, sizeof *all), *out = all;
    for (size_t p = 0; all && p < sizeof parts / sizeof parts[0]; p++)
        for (const PyMethodDef *d = parts[p]; d->ml_name; d++)
            *out++ = *d;
    return all; /* ends with the zeroed sentinel; lives as long as the type */
}

/* {field: byte offset} of a struct's fields, for fault injection (tests, psd chaos); NULL on error. */
static PyObject *offsets(void) {
    PyObject *all = Py_BuildValue("{s:N,s:N,s:N,s:N}", "header", PyDict_New(), "slot", PyDict_New(), "lslot",
                                  PyDict_New(), "entry", PyDict_New());
    if (!all)
        return NULL;
    PyObject *h = PyDict_GetItemString(all, "header"), *s = PyDict_GetItemString(all, "slot"),
             *ls = PyDict_GetItemString(all, "lslot"), *e = PyDict_GetItemString(all, "entry");
    int bad = 0;
#define PUT(d, key, type, f)                                                                       \
    do {                                                                                           \
        PyObject *v_ = PyLong_FromSize_t(offsetof(type, f));                                       \
        bad |= !v_ || PyDict_SetItemString((d), (key), v_);                                        \
        Py_XDECREF(v_);                                                                            \
    } while (0);
/* The field's path in struct psd_header for each kind of PSD_HEADER_FIELDS: a configuration field is in cfg. */
#define PATH_CFG(f) cfg.f
#define PATH_CFG_REAL(f) cfg.f
#define PATH_FIXED(f) f
#define PATH_MODEL(f) f
#define PATH_PLAIN(f) f
#define PATH_ATOMIC(f) f
#define PATH_PID(f) f
#define PATH_PLAIN_PID(f) f
#define PATH_SIGNED(f) f
#define PATH_REAL(f) f
#define HEADER_OFFSET(f, how) PUT(h, #f, struct psd_header, PATH_##how(f))
#define SLOT_OFFSET(key, f, how) PUT(s, #key, struct psd_slot, f)
#define LSLOT_OFFSET(key, f, how) PUT(ls, #key, struct psd_lslot, f)
#define ENTRY_OFFSET(f) PUT(e, #f, struct psd_entry, f)
    PSD_HEADER_FIELDS(HEADER_OFFSET)
    PUT(h, "staleness_avg_bits", struct psd_header, staleness_avg_bits)
    PUT(h, "staleness_held_bits", struct psd_header, staleness_held_bits)
    PUT(h, "state_cond.waiters", struct psd_header, state_cond.waiters)
    PUT(h, "doorbell.waiters", struct psd_header, doorbell.waiters)
    PUT(h, "sync_cond.waiters", struct psd_header, sync_cond.waiters)
    PSD_SLOT_FIELDS(SLOT_OFFSET)
    PSD_LSLOT_FIELDS(LSLOT_OFFSET)
    PUT(s, "not_full.seq", struct psd_slot, not_full.seq)
    PSD_ENTRY_FIELDS(ENTRY_OFFSET)
#undef HEADER_OFFSET
#undef SLOT_OFFSET
#undef LSLOT_OFFSET
#undef ENTRY_OFFSET
#undef PUT
    if (bad)
        Py_CLEAR(all);
    return all;
}

PyMODINIT_FUNC PyInit__native(void) {
    if (!ArenaType.tp_methods && !(ArenaType.tp_methods = join_methods())) {
        PyErr_NoMemory();
        return NULL;
    }
    if (PyType_Ready(&ArenaType) < 0 || PyType_Ready(&PullerType) < 0 || PyType_Ready(&StepperType) < 0)
        return NULL;
    errors_module = PyImport_ImportModule("psd.errors");
    if (!errors_module)
        return NULL;
    PyObject *m = PyModule_Create(&native_module);
    if (!m)
        return NULL;
    Py_INCREF(&ArenaType);
    if (PyModule_AddObject(m, "Arena", (PyObject *)&ArenaType) < 0 ||
        PyModule_AddFunctions(m, py_arena_functions) < 0 || PyModule_AddFunctions(m, py_server_functions) < 0)
        return NULL;
    PyObject *offs = offsets();
    if (!offs || PyModule_AddObject(m, "OFFSETS", offs) < 0) {
        Py_XDECREF(offs);
        return NULL;
    }
    /* The header's fields by name, in the order of PSD_HEADER_FIELDS: what Arena.field reads (psd.arena's
     * HeaderView is made from it). */
    PyObject *names = Py_BuildValue("(" PSD_HEADER_FIELDS(HEADER_NAME_FMT) ")" PSD_HEADER_FIELDS(HEADER_NAME_ARG));
    if (!names || PyModule_AddObject(m, "HEADER_FIELDS", names) < 0) {
        Py_XDECREF(names);
        return NULL;
    }
    PyModule_AddIntConstant(m, "LAYOUT_VERSION", PSD_LAYOUT_VERSION);
    PyModule_AddIntConstant(m, "PIECE_WORDS", PSD_PIECE_WORDS);
    PyModule_AddIntConstant(m, "HEADER_SIZE", PSD_HEADER_SIZE);
    PyModule_AddIntConstant(m, "MAX_SLOTS", PSD_MAX_SLOTS);
    PyModule_AddIntConstant(m, "MAX_RING", PSD_MAX_RING);
    PyModule_AddIntConstant(m, "SLOT_RANK_OFFSET", (long)offsetof(struct psd_slot, rank));
    PyModule_AddIntConstant(m, "SLOT_TAIL_OFFSET", (long)offsetof(struct psd_lslot, tail));
    PyModule_AddIntConstant(m, "LSLOT_SIZE", (long)sizeof(struct psd_lslot));
    PyModule_AddIntConstant(m, "SLOT_RECORD_SIZE", (long)sizeof(struct psd_slot));
    PyModule_AddIntConstant(m, "ENTRY_SEQ_OFFSET", (long)offsetof(struct psd_entry, seq));
    PyModule_AddIntConstant(m, "DTYPE_F32", PSD_DTYPE_F32);
    PyModule_AddIntConstant(m, "DTYPE_BF16", PSD_DTYPE_BF16);
    PyModule_AddIntConstant(m, "DTYPE_F16", PSD_DTYPE_F16);
    PyModule_AddIntConstant(m, "PIECE_ABSENT", PSD_PIECE_ABSENT);
    PyModule_AddIntConstant(m, "PIECE_DENSE", PSD_PIECE_DENSE);
    PyModule_AddIntConstant(m, "PIECE_SPARSE", PSD_PIECE_SPARSE);
    PyModule_AddIntConstant(m, "PIECE_DENSE_BF16", PSD_PIECE_DENSE_BF16);
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
    PyModule_AddIntConstant(m, "SLOT_EVICTED", PSD_SLOT_EVICTED);
    PyModule_AddIntConstant(m, "OUTCOME_PENDING", PSD_OUTCOME_PENDING);
    PyModule_AddIntConstant(m, "OUTCOME_APPLIED", PSD_OUTCOME_APPLIED);
    PyModule_AddIntConstant(m, "ENTRY_BUFFERS", PSD_ENTRY_BUFFERS);
    PyModule_AddIntConstant(m, "ENTRY_BUF_RANGE", PSD_ENTRY_BUF_RANGE);
    PyModule_AddIntConstant(m, "OUTCOME_REJECTED", PSD_OUTCOME_REJECTED);
    PyModule_AddIntConstant(m, "OUTCOME_DROPPED", PSD_OUTCOME_DROPPED);
    PyModule_AddIntConstant(m, "OUTCOME_IGNORED", PSD_OUTCOME_IGNORED);
    PyModule_AddIntConstant(m, "REAP_EXITED", PSD_REAP_EXITED);
    PyModule_AddIntConstant(m, "REAP_LEASE", PSD_REAP_LEASE);
    PyModule_AddIntConstant(m, "REAP_UNCLAIMED", PSD_REAP_UNCLAIMED);
    PyModule_AddIntConstant(m, "LIVE_BY_PROC", PSD_LIVE_BY_PROC);
    PyModule_AddIntConstant(m, "LIVE_BY_LEASE", PSD_LIVE_BY_LEASE);
    PyModule_AddIntConstant(m, "SLOT_LEASE_BEAT_OFFSET", (long)offsetof(struct psd_lslot, lease_beat));
    PyModule_AddIntConstant(m, "HEADER_SHARED_OFFSET", (long)offsetof(struct psd_header, admission));
    PyModule_AddIntConstant(m, "ENTRY_CLAIM_OFFSET", (long)offsetof(struct psd_entry, claim));
    PyModule_AddIntConstant(m, "CFG_STALENESS_LR", PSD_CFG_STALENESS_LR);
    PyModule_AddIntConstant(m, "CFG_GRAD_BF16", PSD_CFG_GRAD_BF16);
    PyModule_AddIntConstant(m, "CFG_PREDICT", PSD_CFG_PREDICT);
    PyModule_AddIntConstant(m, "CFG_OVERLAP", PSD_CFG_OVERLAP);
    PyModule_AddIntConstant(m, "CFG_NO_OVERLAP", PSD_CFG_NO_OVERLAP);
    PyModule_AddIntConstant(m, "CFG_LEASE_ONLY", PSD_CFG_LEASE_ONLY);
    return m;
}
