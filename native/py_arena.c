/*
 * py_arena.c -- the Arena type: one mapping of an arena, its buffer views, and
 * opening, remapping and closing it. Fault injection (holding a robust mutex)
 * is here too: it needs nothing but the mapping.
 */
#include "py_psd.h"

#include <errno.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>

#include "psd_sigbus.h"

int check_open(Arena *a) {
    if (!a->map.base) {
        PyErr_SetString(PyExc_ValueError, "arena is closed");
        return -1;
    }
    if (psd_sigbus_lost(a->map.base, a->map.size)) {
        raise_code(PSD_ELOST, "read arena", a->name);
        return -1;
    }
    return 0;
}

PyObject *unless_lost(Arena *a, PyObject *r) {
    if (r && psd_sigbus_lost(a->map.base, a->map.size)) {
        Py_DECREF(r);
        return raise_code(PSD_ELOST, "read arena", a->name);
    }
    return r;
}

int check_role(Arena *a, uint32_t most) {
    static const char *const roles[] = {"full", "learner", "reader"};
    if (check_open(a))
        return -1;
    if (a->map.role <= most)
        return 0;
    PyErr_Format(PyExc_PermissionError,
                 "%s: this mapping is a %s's (read-only there); the call writes what only a %s's mapping may "
                 "(open_job(role=\"%s\"): the server, the watchdog)", a->name, roles[a->map.role % 3],
                 roles[most % 3], roles[most % 3]);
    return -1;
}

int check_slot(Arena *a, unsigned int slot) {
    if (check_open(a))
        return -1;
    struct psd_header *h = psd_hdr(&a->map);
    if (PSD_LOAD_ACQ(&h->state) < PSD_ARENA_INIT_WEIGHTS || !psd_has_model(&a->map)) {
        raise_code(PSD_ESTATE, "slot", NULL);
        return -1;
    }
    if (slot >= a->map.g.n_slots) {
        PyErr_Format(PyExc_IndexError, "slot %u out of range (job has %u)", slot, a->map.g.n_slots);
        return -1;
    }
    return 0;
}

void stop_loop(Arena *a) {
    if (a->loop) {
        Py_BEGIN_ALLOW_THREADS psd_loop_stop(a->loop);
        Py_END_ALLOW_THREADS a->loop = NULL;
    }
}

Arena *new_arena(const char *name) {
    Arena *a = PyObject_New(Arena, &ArenaType);
    if (!a)
        return NULL;
    a->map.fd = -1;
    a->map.base = NULL;
    a->map.size = 0;
    a->map.role = PSD_ROLE_FULL;
    a->map.offering = 0;
    a->map.n_held = 0;
    a->map.held = NULL;
    a->map.lease = NULL;
    a->exports = 0;
    a->loop = NULL;
    snprintf(a->name, sizeof a->name, "%s", name);
    return a;
}

static void arena_dealloc(Arena *a) {
    stop_loop(a);
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

static const char *const role_names[] = {"full", "learner", "reader"}; /* enum psd_role */

static PyObject *mod_open(PyObject *self, PyObject *args) {
    (void)self;
    const char *name, *role_name = "full";
    if (!PyArg_ParseTuple(args, "s|s", &name, &role_name))
        return NULL;
    int role = name_index("role", role_name, role_names, 3);
    if (role < 0)
        return NULL;
    Arena *a = new_arena(name);
    if (!a)
        return NULL;
    int rc = psd_arena_open_as(&a->map, name, (uint32_t)role);
    if (rc == PSD_EVERSION) {
        struct psd_header *h = psd_hdr(&a->map);
        char made_by[PSD_VERSION_LEN + 1];
        memcpy(made_by, h->psd_version, PSD_VERSION_LEN);
        made_by[PSD_VERSION_LEN] = '\0';
        PyObject *type = error_type("VersionMismatch");
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

static PyObject *arena_identity(Arena *a, PyObject *noargs) {
    (void)noargs;
    struct stat st;
    if (!a->map.base) { /* not check_open: this reads the file's status, which a lost mapping still has */
        PyErr_SetString(PyExc_ValueError, "arena is closed");
        return NULL;
    }
    if (fstat(a->map.fd, &st) != 0)
        return raise_code(errno, "stat arena", a->name);
    return Py_BuildValue("(KK)", (unsigned long long)st.st_dev, (unsigned long long)st.st_ino);
}

static PyObject *arena_grad_offset(Arena *a, PyObject *args) {
    unsigned int slot, k;
    if (!PyArg_ParseTuple(args, "II", &slot, &k) || check_slot(a, slot))
        return NULL;
    if (k >= a->map.g.ring_k) {
        PyErr_Format(PyExc_IndexError, "ring entry %u out of range (ring has %u)", k, a->map.g.ring_k);
        return NULL;
    }
    uint8_t *g = (uint8_t *)psd_entry_grad(psd_entry_at(&a->map, slot, k));
    return PyLong_FromSize_t((size_t)(g - a->map.base));
}

/* Fault injection for tests and chaos scripts: take one of the arena's robust
 * mutexes and keep it, so that the process can be killed while holding it. */
static pthread_mutex_t *named_mutex(Arena *a, const char *which, unsigned int slot) {
    if (check_open(a))
        return NULL;
    (void)slot; /* slots have no mutex: their owner changes only in the server process */
    if (strcmp(which, "admission") == 0)
        return &psd_hdr(&a->map)->admission;
    PyErr_Format(PyExc_ValueError, "no mutex %s (use 'admission')", which);
    return NULL;
}

/* hold_mutex / release_mutex: which mutex comes from the arguments ("s|I"). */
static PyObject *mutex_call(Arena *a, PyObject *args, bool hold) {
    const char *which;
    unsigned int slot = 0;
    if (!PyArg_ParseTuple(args, "s|I", &which, &slot))
        return NULL;
    pthread_mutex_t *mu = named_mutex(a, which, slot);
    if (!mu)
        return NULL;
    if (!hold) {
        psd_mutex_unlock(mu);
        Py_RETURN_NONE;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = psd_mutex_lock(psd_hdr(&a->map), mu);
    Py_END_ALLOW_THREADS if (!psd_locked(rc)) return raise_code(rc, "lock", a->name);
    return PyBool_FromLong(rc == PSD_EOWNERDEAD); /* True: taken over from a dead owner */
}

static PyObject *arena_hold_mutex(Arena *a, PyObject *args) { return mutex_call(a, args, true); }
static PyObject *arena_release_mutex(Arena *a, PyObject *args) { return mutex_call(a, args, false); }

static PyObject *arena_close(Arena *a, PyObject *noargs) {
    (void)noargs;
    if (a->exports)
        return raise_code(PSD_EEXPORTS, "close arena", NULL);
    stop_loop(a);
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
    return unless_lost(a, PyLong_FromUnsignedLong(PSD_LOAD_ACQ(&psd_hdr(&a->map)->state)));
}

static PyObject *arena_lost(Arena *a, PyObject *noargs) {
    (void)noargs;
    return PyBool_FromLong(psd_sigbus_lost(a->map.base, a->map.size));
}

static PyObject *arena_get_closed(Arena *a, void *closure) {
    (void)closure;
    return PyBool_FromLong(a->map.base == NULL);
}

static PyObject *arena_get_exports(Arena *a, void *closure) {
    (void)closure;
    return PyLong_FromSsize_t(a->exports);
}

static PyGetSetDef arena_getset[] = {
    {"name", (getter)arena_get_name, NULL, "shared-memory object name", NULL},
    {"state", (getter)arena_get_state, NULL, "arena life-cycle state", NULL},
    {"closed", (getter)arena_get_closed, NULL, "whether unmapped", NULL},
    {"exports", (getter)arena_get_exports, NULL, "buffers exported over the mapping", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyMethodDef py_arena_methods[] = {
    {"remap", (PyCFunction)arena_remap, METH_NOARGS, "Map the arena at its current size."},
    {"identity", (PyCFunction)arena_identity, METH_NOARGS, "(device, inode) of the mapped object"},
    {"grad_offset", (PyCFunction)arena_grad_offset, METH_VARARGS, "grad_offset(slot, k) -> byte offset"},
    {"hold_mutex", (PyCFunction)arena_hold_mutex, METH_VARARGS,
     "hold_mutex('admission'|'slot', slot=0) -> bool: fault injection; True if a dead owner's lock was recovered. "
     "Keep the arena mapped while holding it: the kernel frees a dead owner's lock only through a live mapping"},
    {"release_mutex", (PyCFunction)arena_release_mutex, METH_VARARGS, "release_mutex('admission'|'slot', slot=0)"},
    {"close", (PyCFunction)arena_close, METH_NOARGS, "Unmap; fails while buffers are exported."},
    {"lost", (PyCFunction)arena_lost, METH_NOARGS,
     "Whether the file was truncated under this mapping and a read of it recovered (install_sigbus_handler's "
     "recover): what was read from it since is zeros, not the arena. Ask after copying out of a buffer view."},
    {NULL, NULL, 0, NULL},
};

PyMethodDef py_arena_functions[] = {
    {"open", mod_open, METH_VARARGS,
     "open(shm_name, role='full') -> Arena: role full (read-write), learner (read-only but the header's shared "
     "page, its claimed slots and its offer window) or reader (read-only)"},
    {"unlink", mod_unlink, METH_VARARGS, "unlink(shm_name): remove the shared-memory object"},
    {NULL, NULL, 0, NULL},
};

/* tp_methods: the tables above joined by py_module.c before PyType_Ready. */
PyTypeObject ArenaType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "psd._native.Arena",
    .tp_basicsize = sizeof(Arena),
    .tp_dealloc = (destructor)arena_dealloc,
    .tp_as_buffer = &arena_as_buffer,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One mapping of a psd arena. Made by create() or open().",
    .tp_getset = arena_getset,
};
