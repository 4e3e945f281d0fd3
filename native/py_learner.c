/*
 * py_learner.c -- the learner's side of the binding: offering a spec, claiming
 * and releasing a slot, pushing gradients, the waits (space, drained, freed,
 * bsp rounds, ssp), pulls (inline, and the Puller type that wraps pull.c's
 * thread), weight prediction and what a learner reads back about its entries.
 */
#include "py_psd.h"

#include <errno.h>
#include <string.h>

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

static PyObject *arena_wait_state(Arena *a, PyObject *args) {
    unsigned int not_state;
    double timeout;
    if (!PyArg_ParseTuple(args, "Id", &not_state, &timeout) || check_open(a))
        return NULL;
    uint64_t deadline = psd_now_ns() + seconds_to_ns(timeout);
    int rc;
    BLOCKING(rc, psd_arena_wait_state(&a->map, not_state, psd_left_ns(deadline)));
    if (rc == PSD_ETIMEOUT)
        Py_RETURN_FALSE;
    if (rc)
        return raise_code(rc, "wait for arena state", a->name);
    Py_RETURN_TRUE;
}

/* The offering learner writes the initial weights and buffers and the READY state only while
 * its offer window is open. */
static PyObject *arena_offer_window(Arena *a, PyObject *args) {
    int open;
    if (!PyArg_ParseTuple(args, "p", &open) || check_open(a))
        return NULL;
    int rc = psd_arena_offer_window(&a->map, open);
    if (rc)
        return raise_code(rc, open ? "open the offer window" : "close the offer window", a->name);
    Py_RETURN_NONE;
}

/* claim(pid, start_time, rank=-1, timeout=30.0) -> (slot, claim): ask the server's update loop
 * for a free slot and wait for its answer (GIL released). */
static PyObject *arena_claim(Arena *a, PyObject *args) {
    int pid, rank = -1;
    unsigned long long start;
    double timeout = 30.0;
    if (!PyArg_ParseTuple(args, "iK|id", &pid, &start, &rank, &timeout) || check_open(a))
        return NULL;
    uint32_t slot = 0;
    uint64_t claim = 0;
    uint64_t deadline = psd_now_ns() + seconds_to_ns(timeout);
    int rc;
    /* A signal withdraws a request not yet answered (psd_slot_claim keeps a slot admitted meanwhile): a
     * handler that returns (a DataLoader's SIGCHLD, a user's SIGALRM) lets the claim ask again, within the
     * timeout. */
    BLOCKING(rc, psd_slot_claim(&a->map, pid, start, rank, psd_left_ns(deadline), &slot, &claim));
    if (rc)
        return raise_code(rc, "claim learner slot", a->name);
    return Py_BuildValue("(IK)", slot, (unsigned long long)claim);
}

/* assign(pid, start_time, rank=-1) -> (slot, claim): a full mapping takes a free slot at once. */
static PyObject *arena_assign(Arena *a, PyObject *args) {
    int pid, rank = -1;
    unsigned long long start;
    if (!PyArg_ParseTuple(args, "iK|i", &pid, &start, &rank) || check_open(a))
        return NULL;
    uint32_t slot = 0;
    uint64_t claim = 0;
    int rc = psd_slot_assign(&a->map, pid, start, rank, &slot, &claim);
    if (rc)
        return raise_code(rc, "assign learner slot", a->name);
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

/* push(slot, clock, batch, loss, scale=1, bufdelta=None, present=None, lens=None): psd_push_present; `present`
 * (n_pieces bytes) and `lens` (n_pieces native uint64s) come together, or neither (every tensor). */
static PyObject *arena_push(Arena *a, PyObject *args) {
    unsigned int slot, batch;
    unsigned long long clock;
    double loss;
    float scale = 1.0f;
    PyObject *bo = Py_None, *po = Py_None, *lo = Py_None;
    if (!PyArg_ParseTuple(args, "IKId|fOOO", &slot, &clock, &batch, &loss, &scale, &bo, &po, &lo) ||
        check_slot(a, slot))
        return NULL;
    const double *bufdelta = bo == Py_None ? NULL : PyLong_AsVoidPtr(bo);
    if (PyErr_Occurred())
        return NULL;
    Py_buffer pb = {0}, lb = {0};
    if ((po == Py_None) != (lo == Py_None)) {
        PyErr_SetString(PyExc_TypeError, "push: give present and lens together, or neither");
        return NULL;
    }
    if (po != Py_None) {
        if (PyObject_GetBuffer(po, &pb, PyBUF_SIMPLE))
            return NULL;
        if (PyObject_GetBuffer(lo, &lb, PyBUF_SIMPLE)) {
            PyBuffer_Release(&pb);
            return NULL;
        }
        if ((uint64_t)pb.len != a->map.g.n_pieces || (uint64_t)lb.len != 8 * a->map.g.n_pieces) {
            PyErr_Format(PyExc_ValueError, "push: present must be %llu bytes and lens %llu uint64s (one per "
                         "trainable tensor)", (unsigned long long)a->map.g.n_pieces,
                         (unsigned long long)a->map.g.n_pieces);
            PyBuffer_Release(&pb);
            PyBuffer_Release(&lb);
            return NULL;
        }
    }
    const uint8_t *present = pb.obj ? pb.buf : NULL;
    const uint64_t *lens = lb.obj ? lb.buf : NULL;
    int rc;
    if (a->map.g.n_params < (UINT64_C(1) << 16)) {
        rc = psd_push_present(&a->map, slot, clock, batch, loss, scale, present, lens, bufdelta);
    } else {
        Py_BEGIN_ALLOW_THREADS rc = psd_push_present(&a->map, slot, clock, batch, loss, scale, present, lens, bufdelta);
        Py_END_ALLOW_THREADS
    }
    if (pb.obj)
        PyBuffer_Release(&pb);
    if (lb.obj)
        PyBuffer_Release(&lb);
    if (rc == EINVAL) {
        PyErr_Format(PyExc_ValueError, "push: the lengths do not add up to the job's %llu trainable elements",
                     (unsigned long long)a->map.g.n_train);
        return NULL;
    }
    if (rc)
        return raise_code(rc, "push gradient", a->name);
    Py_RETURN_NONE;
}

/* psd_push_from, without the GIL for models of 2^16 parameters or more; 0, or -1 with an exception
 * named after `op` (the caller's name) set. */
static int push_gradient(Arena *a, const char *op, uint32_t slot, uint64_t clock, uint32_t batch, double loss,
                         float scale, const struct psd_src *src, uint32_t count, uint32_t dtype, uint32_t store,
                         const double *bufdelta) {
    int rc;
    if (a->map.g.n_params < (UINT64_C(1) << 16)) {
        rc = psd_push_from(&a->map, slot, clock, batch, loss, scale, src, count, dtype, store, bufdelta);
    } else {
        Py_BEGIN_ALLOW_THREADS rc = psd_push_from(&a->map, slot, clock, batch, loss, scale, src, count, dtype, store,
                                                  bufdelta);
        Py_END_ALLOW_THREADS
    }
    if (rc == EINVAL)
        PyErr_Format(PyExc_ValueError, "%s: the tensors do not match the job's %llu trainable elements, a sparse "
                     "gradient names rows outside its tensor, or the dtype (%u) or the dtype to store (%u) is "
                     "unknown", op, (unsigned long long)a->map.g.n_train, dtype, store);
    else if (rc)
        raise_code(rc, "push gradient", a->name);
    return rc ? -1 : 0;
}

/* push_from(slot, clock, batch, loss, scale, ptrs, lens, dtype=0, bufdelta=None, sparse=None, store=0):
 * copy the gradient from the tensors at the addresses `ptrs` (0: no gradient) of
 * `lens` elements of `dtype` (enum psd_dtype) into the entry at the tail, as
 * `store` (PSD_DTYPE_F32, or PSD_DTYPE_BF16 for the dense tensors),
 * checking it on the way, and publish it. `sparse` lists (k, rows_ptr, nnz,
 * row_len) for the tensors whose gradient is nnz rows (ptrs[k] the values).
 * `bufdelta` is the address of n_buffers doubles. The caller (Learner.step)
 * keeps the tensors alive and vouches for the addresses. */
static PyObject *arena_push_from(Arena *a, PyObject *args) {
    unsigned int slot, batch, dtype = PSD_DTYPE_F32, store = PSD_DTYPE_F32;
    unsigned long long clock;
    double loss;
    float scale;
    PyObject *ptrs, *lens, *bo = Py_None, *sparse = Py_None;
    if (!PyArg_ParseTuple(args, "IKIdfOO|IOOI", &slot, &clock, &batch, &loss, &scale, &ptrs, &lens, &dtype, &bo,
                          &sparse, &store) ||
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
    if (count != PySequence_Fast_GET_SIZE(l) || (uint64_t)count != a->map.g.n_pieces) {
        PyErr_Format(PyExc_ValueError, "push_from: ptrs and lens must both have one item per trainable tensor (%llu)",
                     (unsigned long long)a->map.g.n_pieces);
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
    push_gradient(a, "push_from", slot, clock, batch, loss, scale, src, (uint32_t)count, dtype, store, bufdelta);
out:
    PyMem_Free(src);
    Py_DECREF(p);
    Py_DECREF(l);
    if (PyErr_Occurred())
        return NULL;
    Py_RETURN_NONE;
}

enum wait_kind { WAIT_SPACE, WAIT_DRAINED, WAIT_FREED, WAIT_SSP };

static PyObject *wait_common(Arena *a, PyObject *args, enum wait_kind kind) {
    unsigned int slot;
    unsigned long long claim;
    double timeout;
    if (!PyArg_ParseTuple(args, "IKd", &slot, &claim, &timeout) || check_slot(a, slot))
        return NULL;
    uint64_t deadline = psd_now_ns() + seconds_to_ns(timeout);
    int rc;
#define LEFT() psd_left_ns(deadline)
    static const char *const what[] = {"wait for ring space", "wait for ring to drain",
                                       "wait for slot to be freed", "wait for the slowest learner (ssp)"};
    if (kind == WAIT_SSP)
        BLOCKING(rc, psd_wait_ssp(&a->map, slot, claim, LEFT()));
    else if (kind == WAIT_DRAINED)
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

/* The waits for a count to reach a target (slot, claim, target, timeout): a signal's EINTR waits on for
 * what is left of the timeout. */
static PyObject *wait_target(Arena *a, PyObject *args,
                             int (*wait)(struct psd_map *, uint32_t, uint64_t, uint64_t, uint64_t), const char *what) {
    unsigned int slot;
    unsigned long long claim, target;
    double timeout;
    if (!PyArg_ParseTuple(args, "IKKd", &slot, &claim, &target, &timeout) || check_slot(a, slot))
        return NULL;
    uint64_t deadline = psd_now_ns() + seconds_to_ns(timeout);
    int rc;
    BLOCKING(rc, wait(&a->map, slot, claim, target, psd_left_ns(deadline)));
    if (rc)
        return raise_code(rc, what, a->name);
    Py_RETURN_NONE;
}

static PyObject *arena_wait_head(Arena *a, PyObject *args) {
    return wait_target(a, args, psd_wait_head, "wait for the server to take a ring entry");
}

static PyObject *arena_wait_drained(Arena *a, PyObject *args) { return wait_common(a, args, WAIT_DRAINED); }

static PyObject *arena_wait_freed(Arena *a, PyObject *args) { return wait_common(a, args, WAIT_FREED); }

static PyObject *arena_wait_ssp(Arena *a, PyObject *args) { return wait_common(a, args, WAIT_SSP); }

static PyObject *arena_has_space(Arena *a, PyObject *args) {
    unsigned int slot;
    if (!PyArg_ParseTuple(args, "I", &slot) || check_slot(a, slot))
        return NULL;
    return PyBool_FromLong(psd_ring_has_space(&a->map, slot));
}

/* set_push_buffers(lo, hi): the real-valued buffers this mapping's pushes set (a partial attach). */
static PyObject *arena_set_push_buffers(Arena *a, PyObject *args) {
    unsigned long long lo, hi;
    if (!PyArg_ParseTuple(args, "KK", &lo, &hi))
        return NULL;
    if (lo > hi || hi > a->map.g.n_buffers || hi > UINT32_MAX)
        return PyErr_Format(PyExc_ValueError, "buffer range [%llu, %llu) is not within the job's %llu buffers", lo,
                            hi, (unsigned long long)a->map.g.n_buffers);
    a->map.push_buf_partial = 1;
    a->map.push_buf_lo = (uint32_t)lo;
    a->map.push_buf_hi = (uint32_t)hi;
    Py_RETURN_NONE;
}

static PyObject *arena_wait_round(Arena *a, PyObject *args) {
    return wait_target(a, args, psd_wait_round, "wait for the bsp round");
}

static PyObject *arena_predict_into(Arena *a, PyObject *args) {
    Py_buffer dst;
    double staleness;
    long long lo = 0, hi = -1;
    if (!PyArg_ParseTuple(args, "w*d|LL", &dst, &staleness, &lo, &hi))
        return NULL;
    if (check_open(a)) {
        PyBuffer_Release(&dst);
        return NULL;
    }
    uint64_t end = hi < 0 ? a->map.g.n_train : (uint64_t)hi;
    if (lo < 0) {
        PyBuffer_Release(&dst);
        PyErr_SetString(PyExc_ValueError, "predict_into: lo must be 0 or more");
        return NULL;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = psd_predict(&a->map, dst.buf, (uint64_t)dst.len / sizeof(float), (uint64_t)lo, end,
                                            staleness);
    Py_END_ALLOW_THREADS PyBuffer_Release(&dst);
    if (rc == EINVAL) {
        PyErr_SetString(PyExc_ValueError, "predict_into: the buffer must hold exactly the model's float32 weights, "
                                          "and [lo, hi) lie within its trainable ones");
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

/* psd_take_weights with the GIL let go for a large copy (not when the learner already holds the clock
 * now: most pulls right after a push copy nothing, and taking the GIL back could cost a switch interval). */
static uint64_t take_weights(struct psd_map *m, uint32_t slot, void *dst, uint64_t known) {
    uint64_t clock;
    if (!dst || m->g.n_train < (UINT64_C(1) << 16) || PSD_LOAD_RLX(&psd_hdr(m)->clock) == known) {
        clock = psd_take_weights(m, slot, dst, known);
    } else {
        Py_BEGIN_ALLOW_THREADS clock = psd_take_weights(m, slot, dst, known);
        Py_END_ALLOW_THREADS
    }
    return clock;
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
    if ((uint64_t)dst.len != a->map.g.n_params * sizeof(float)) {
        PyBuffer_Release(&dst);
        PyErr_SetString(PyExc_ValueError, "pull_into: the buffer must hold n_params float32");
        return NULL;
    }
    uint64_t clock = take_weights(&a->map, slot, dst.buf, known);
    PyBuffer_Release(&dst);
    return PyLong_FromUnsignedLongLong(clock);
}

/* pull_changed(slot, buffer, known, pos, epoch, pieces) -> (clock, pos, epoch, bytes): psd_pull_changed
 * into the learner's float32 copy of the weights (n_params of them; the trainable prefix is written);
 * pieces: the job's trainable tensors as uint64 (off, len, row_len) triples, tiling n_train. */
static PyObject *arena_pull_changed(Arena *a, PyObject *args) {
    unsigned int slot;
    unsigned long long known, pos, epoch;
    Py_buffer dst, pb;
    if (!PyArg_ParseTuple(args, "Iw*KKKy*", &slot, &dst, &known, &pos, &epoch, &pb))
        return NULL;
    PyObject *out = NULL;
    uint8_t *whole = NULL;
    const struct psd_piece_geom *pieces = pb.buf;
    uint64_t n_pieces = (uint64_t)pb.len / sizeof *pieces, off = 0;
    if (check_slot(a, slot))
        goto done;
    if ((uint64_t)dst.len != a->map.g.n_params * sizeof(float) || (uint64_t)pb.len % sizeof *pieces ||
        n_pieces != a->map.g.n_pieces) {
        PyErr_SetString(PyExc_ValueError, "pull_changed: the buffer must hold n_params float32, and pieces one "
                                          "(off, len, row_len) uint64 triple per trainable tensor");
        goto done;
    }
    for (uint64_t k = 0; k < n_pieces; k++) { /* the pieces must tile the trainable prefix */
        if (pieces[k].off != off || pieces[k].row_len == 0 || pieces[k].len % pieces[k].row_len ||
            pieces[k].len > a->map.g.n_train - off) {
            PyErr_SetString(PyExc_ValueError, "pull_changed: pieces do not tile the job's trainable weights");
            goto done;
        }
        off += pieces[k].len;
    }
    if (off != a->map.g.n_train) {
        PyErr_SetString(PyExc_ValueError, "pull_changed: pieces do not tile the job's trainable weights");
        goto done;
    }
    whole = PyMem_Malloc(n_pieces ? n_pieces : 1);
    if (!whole) {
        PyErr_NoMemory();
        goto done;
    }
    uint64_t clock, p = pos, e = epoch, bytes = 0;
    Py_BEGIN_ALLOW_THREADS clock = psd_pull_changed(&a->map, slot, dst.buf, known, &p, &e, pieces, n_pieces, whole,
                                                    &bytes);
    Py_END_ALLOW_THREADS out = Py_BuildValue("KKKK", (unsigned long long)clock, (unsigned long long)p,
                                             (unsigned long long)e, (unsigned long long)bytes);
done:
    PyMem_Free(whole);
    PyBuffer_Release(&dst);
    PyBuffer_Release(&pb);
    return out;
}

/* rowlog_mark() -> (pos, epoch): psd_rowlog_mark, read before a full copy of the weights. */
static PyObject *arena_rowlog_mark(Arena *a, PyObject *noargs) {
    (void)noargs;
    if (check_open(a))
        return NULL;
    uint64_t pos, epoch;
    psd_rowlog_mark(&a->map, &pos, &epoch);
    return Py_BuildValue("KK", (unsigned long long)pos, (unsigned long long)epoch);
}

static PyObject *arena_note_pull(Arena *a, PyObject *args) {
    unsigned int slot, skipped;
    unsigned long long clock;
    if (!PyArg_ParseTuple(args, "IKp", &slot, &clock, &skipped) || check_slot(a, slot))
        return NULL;
    psd_note_pull(&a->map, slot, clock, skipped);
    Py_RETURN_NONE;
}

static PyObject *arena_note_sharpness(Arena *a, PyObject *args) {
    unsigned int slot;
    double sharpness;
    if (!PyArg_ParseTuple(args, "Id", &slot, &sharpness) || check_slot(a, slot))
        return NULL;
    psd_note_sharpness(&a->map, slot, sharpness);
    Py_RETURN_NONE;
}

/* seen_clock(slot) -> clock: a learner whose parameters are views of the shared weights
 * (pull="view") pulls nothing; it records the clock its next gradient is computed from. */
static PyObject *arena_seen_clock(Arena *a, PyObject *args) {
    unsigned int slot;
    if (!PyArg_ParseTuple(args, "I", &slot) || check_slot(a, slot))
        return NULL;
    return PyLong_FromUnsignedLongLong(take_weights(&a->map, slot, NULL, 0));
}

static PyObject *arena_stepper(Arena *a, PyObject *args); /* below, with the Stepper */

/* ---- Puller: a learner's native pull thread ------------------------------ */

typedef struct {
    PyObject_HEAD struct psd_puller *p;
    PyObject *arena; /* keeps the mapping alive while the thread reads it */
    Py_buffer front, back;
} Puller;

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

PyTypeObject PullerType = {
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
    uint64_t n = a->map.g.n_params;
    if ((uint64_t)P->front.len != n * sizeof(float) || (uint64_t)P->back.len != n * sizeof(float)) {
        PyBuffer_Release(&P->front);
        PyBuffer_Release(&P->back);
        PyObject_Free(P);
        PyErr_SetString(PyExc_ValueError, "start_puller: buffers must hold n_params float32 each");
        return NULL;
    }
    /* The thread copies the trainable weights alone (see take_weights): both buffers must hold the
     * frozen ones already. */
    int rc = psd_puller_start(&a->map, slot, P->front.buf, P->back.buf, a->map.g.n_train, clock, &P->p);
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

PyMethodDef py_learner_methods[] = {
    {"offer_window", (PyCFunction)arena_offer_window, METH_VARARGS,
     "offer_window(open): a learner mapping makes the header, spec, weights and buffers writable (True) or "
     "read-only again (False); other mappings ignore it"},
    {"set_spec", (PyCFunction)arena_set_spec, METH_VARARGS,
     "set_spec(data, hash, (n_params, n_train, n_buffers, n_pieces), pid, start_time) -> bool: offer a spec; "
     "False if one was offered already."},
    {"wait_state", (PyCFunction)arena_wait_state, METH_VARARGS,
     "wait_state(not_state, timeout) -> bool: wait until the state is not `not_state`."},
    {"claim", (PyCFunction)arena_claim, METH_VARARGS, "claim(pid, start_time, rank=-1, timeout=30.0) -> (slot, claim): the server answers"},
    {"assign", (PyCFunction)arena_assign, METH_VARARGS,
     "assign(pid, start_time, rank=-1) -> (slot, claim): a full mapping takes a free slot without the loop"},
    {"release", (PyCFunction)arena_release, METH_VARARGS, "release(slot, claim)"},
    {"push", (PyCFunction)arena_push, METH_VARARGS,
     "push(slot, clock, batch, loss, scale=1, bufdelta=None, present=None, lens=None): scale and check the entry "
     "at the tail (every tensor dense; with present, n_pieces bytes, and lens, n_pieces native uint64s: the tensors "
     "written in place, the others absent), copy n_buffers doubles from the address bufdelta along, publish it."},
    {"push_from", (PyCFunction)arena_push_from, METH_VARARGS,
     "push_from(slot, clock, batch, loss, scale, ptrs, lens, dtype=0, bufdelta=None, sparse=None, store=0): copy the "
     "gradient tensor by tensor from the addresses ptrs (0: none) into the entry at the tail, converted to float32 "
     "(store=DTYPE_BF16: the dense tensors to bfloat16), scaled and checked, and publish it; sparse: (k, rows_ptr, "
     "nnz, row_len) per sparse tensor."},
    {"wait_space", (PyCFunction)arena_wait_space, METH_VARARGS, "wait_space(slot, claim, timeout)"},
    {"wait_head", (PyCFunction)arena_wait_head, METH_VARARGS,
     "wait_head(slot, claim, head, timeout): until the server took the slot's entries before `head`"},
    {"wait_drained", (PyCFunction)arena_wait_drained, METH_VARARGS, "wait_drained(slot, claim, timeout)"},
    {"wait_freed", (PyCFunction)arena_wait_freed, METH_VARARGS, "wait_freed(slot, claim, timeout)"},
    {"has_space", (PyCFunction)arena_has_space, METH_VARARGS, "has_space(slot) -> bool"},
    {"set_push_buffers", (PyCFunction)arena_set_push_buffers, METH_VARARGS,
     "set_push_buffers(lo, hi): this mapping's pushes set only the job's real-valued buffers [lo, hi) (a partial "
     "attach)"},
    {"stepper", (PyCFunction)arena_stepper, METH_VARARGS,
     "stepper(slot, params, dtype, dtype_code, strided, front, store=0, own=False, claim=0) -> Stepper: the whole step "
     "in one call (None: a gradient it does not take, the general path's; -1: the ring is full or the server has "
     "yet to apply the push: the caller waits); own: pull only once the server applied the push (claim: the slot's "
     "claim token)"},
    {"seen_clock", (PyCFunction)arena_seen_clock, METH_VARARGS,
     "seen_clock(slot) -> clock: the weights clock now, recorded as the slot's learner clock (pull='view')"},
    {"wait_round", (PyCFunction)arena_wait_round, METH_VARARGS,
     "wait_round(slot, claim, rounds, timeout): bsp, until more than `rounds` rounds are complete"},
    {"wait_ssp", (PyCFunction)arena_wait_ssp, METH_VARARGS,
     "wait_ssp(slot, claim, timeout): ssp, until this learner is at most S pushes ahead of the slowest"},
    {"predict_into", (PyCFunction)arena_predict_into, METH_VARARGS,
     "predict_into(weights, staleness, lo=0, hi=-1): weights[lo:hi] -= lr * staleness * the optimizer's update "
     "direction (hi -1: the trainable weights' end)"},
    {"entry_meta", (PyCFunction)arena_entry_meta, METH_VARARGS,
     "entry_meta(slot, seq) -> clock, applied_clock, outcome of a consumed gradient, or None"},
    {"pull_changed", (PyCFunction)arena_pull_changed, METH_VARARGS,
     "pull_changed(slot, buffer, known, pos, epoch, pieces) -> (clock, pos, epoch, bytes): copy only what the "
     "updates since (clock known, rows log pos, weights epoch) changed; pieces: uint64 (off, len, row_len) each"},
    {"rowlog_mark", (PyCFunction)arena_rowlog_mark, METH_NOARGS,
     "rowlog_mark() -> (pos, epoch): where the rows log and weights epoch stand (read before a full copy)"},
    {"pull_into", (PyCFunction)arena_pull_into, METH_VARARGS,
     "pull_into(slot, buffer, known_clock) -> clock: copy the trainable weights into buffer (n_params float32; "
     "the frozen ones never move and are left as they are) unless still at known_clock"},
    {"note_pull", (PyCFunction)arena_note_pull, METH_VARARGS, "note_pull(slot, clock, skipped)"},
    {"note_sharpness", (PyCFunction)arena_note_sharpness, METH_VARARGS,
     "note_sharpness(slot, sharpness): the loss's largest curvature this learner measured (NaN: none)"},
    {"start_puller", (PyCFunction)arena_start_puller, METH_VARARGS,
     "start_puller(slot, front, back, clock) -> Puller: a native thread that pulls into back"},
    {NULL, NULL, 0, NULL},
};

/* ---- Stepper: a learner's whole step in one call -------------------------- */

/* For small models a step is dominated by per-call overhead, not bytes: the
 * Python path collects each p.grad, checks it, takes its address, resets it
 * and makes three more calls (push, ring space, pull). A Stepper is made once
 * per mapping with the model's trainable parameters, their lengths and the
 * pull to do, and step() does all of it in C for the common case: every
 * gradient None or a dense contiguous tensor of the model's dtype (an
 * unexpected one returns None before anything is touched, and the caller takes
 * its general path); the pull is either none (pull="view": record the clock)
 * or the inline copy into the front buffer. The learner keeps what needs
 * Python (waves, bsp/ssp waits, buffers, sparse rows, prediction) on its
 * general path and makes no Stepper for such a job. */
typedef struct {
    PyObject_HEAD PyObject *arena; /* Arena: kept open (exports) while the Stepper lives */
    unsigned int slot;
    unsigned int dtype_code;
    unsigned int store; /* enum psd_dtype the ring entry holds (--grad-dtype) */
    Py_ssize_t count;
    PyObject *params;  /* tuple of the trainable parameters, spec order */
    PyObject *dtype;   /* the model's torch dtype */
    PyObject *strided; /* torch.strided */
    PyObject **grads;  /* this step's gradients, held across the push */
    struct psd_src *src;
    int copy; /* pull: 1 = copy into front, 0 = view (none) */
    int own;  /* pull only once the server applied this push (asp/ssp without --overlap) */
    unsigned long long claim; /* the slot's claim token, for that wait */
    int busy; /* a step is running (its push may have released the GIL): close() must wait for it */
    Py_buffer front;
    unsigned long long push_ns;
} Stepper;

/* How long a step waits in C for the server to apply its gradient before leaving it to the general path. */
#define OWN_WAIT_NS 200000000ull

static PyObject *str_grad, *str_layout, *str_dtype, *str_is_contiguous, *str_data_ptr;

static void stepper_release(Stepper *S) {
    if (S->arena) {
        ((Arena *)S->arena)->exports--;
        Py_CLEAR(S->arena);
    }
    if (S->copy)
        PyBuffer_Release(&S->front);
    S->copy = 0;
    Py_CLEAR(S->params);
    Py_CLEAR(S->dtype);
    Py_CLEAR(S->strided);
    PyMem_Free(S->grads);
    PyMem_Free(S->src);
    S->grads = NULL;
    S->src = NULL;
}

static void stepper_dealloc(Stepper *S) {
    stepper_release(S);
    PyObject_Free(S);
}

/* 1: `g` is a dense, contiguous tensor of the model's dtype (its address in *data); 0: it is
 * something else (the general path handles it); -1: an exception. */
static int plain_gradient(Stepper *S, PyObject *g, const void **data) {
    PyObject *v = PyObject_GetAttr(g, str_layout);
    if (!v)
        return -1;
    int ok = v == S->strided;
    Py_DECREF(v);
    if (!ok)
        return 0;
    if (!(v = PyObject_GetAttr(g, str_dtype)))
        return -1;
    ok = v == S->dtype;
    Py_DECREF(v);
    if (!ok)
        return 0;
    if (!(v = PyObject_CallMethodNoArgs(g, str_is_contiguous)))
        return -1;
    ok = v == Py_True;
    Py_DECREF(v);
    if (!ok)
        return 0;
    if (!(v = PyObject_CallMethodNoArgs(g, str_data_ptr)))
        return -1;
    *data = PyLong_AsVoidPtr(v);
    Py_DECREF(v);
    return PyErr_Occurred() ? -1 : 1;
}

/* step(clock, loss, batch) -> the clock of the weights the model now has; -1: pushed, but the ring
 * is full (the caller waits for space and pulls); None: a gradient needs the general path, or there
 * is none at all (nothing was pushed or reset). An exception from resetting p.grad may leave some of them reset and nothing
 * pushed, as the general path would. */
static PyObject *stepper_step_locked(Stepper *S, unsigned long long clock, double loss, unsigned long batch);

static PyObject *stepper_step(Stepper *S, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "step(clock, loss, batch)");
        return NULL;
    }
    unsigned long long clock = PyLong_AsUnsignedLongLong(args[0]);
    if (clock == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    double loss = PyFloat_AsDouble(args[1]);
    if (loss == -1.0 && PyErr_Occurred())
        return NULL;
    unsigned long batch = PyLong_AsUnsignedLong(args[2]);
    if (batch == (unsigned long)-1 && PyErr_Occurred())
        return NULL;
    if (batch > PSD_MAX_BATCH) {
        PyErr_Format(PyExc_ValueError, "step: batch_size %lu is over the most psd records (%lu)", batch,
                     (unsigned long)PSD_MAX_BATCH);
        return NULL;
    }
    if (!S->arena) {
        PyErr_SetString(PyExc_ValueError, "step: this stepper was closed");
        return NULL;
    }
    if (S->busy) {
        PyErr_SetString(PyExc_RuntimeError, "step: another thread is in a step of this learner");
        return NULL;
    }
    S->busy = 1;
    PyObject *r = stepper_step_locked(S, clock, loss, batch);
    S->busy = 0;
    return r;
}

static PyObject *stepper_step_locked(Stepper *S, unsigned long long clock, double loss, unsigned long batch) {
    Arena *a = (Arena *)S->arena;
    if (check_slot(a, S->slot))
        return NULL;
    Py_ssize_t k, got = 0, present = 0;
    PyObject *result = NULL;
    for (k = 0; k < S->count; k++) {
        PyObject *g = PyObject_GetAttr(PyTuple_GET_ITEM(S->params, k), str_grad);
        if (!g)
            goto out;
        S->grads[got++] = g;
        S->src[k].data = NULL;
        if (g == Py_None)
            continue;
        present++;
        int plain = plain_gradient(S, g, &S->src[k].data);
        if (plain < 0)
            goto out;
        if (!plain) {
            result = Py_NewRef(Py_None);
            goto out;
        }
    }
    if (!present) { /* a step without gradients is no update: the general path pushes nothing */
        result = Py_NewRef(Py_None);
        goto out;
    }
    for (k = 0; k < S->count; k++) /* as zero_grad(): the next backward writes fresh gradients */
        if (S->grads[k] != Py_None && PyObject_SetAttr(PyTuple_GET_ITEM(S->params, k), str_grad, Py_None))
            goto out;
    struct psd_map *m = &a->map;
    uint64_t t0 = psd_now_ns();
    int failed = push_gradient(a, "step", S->slot, clock, (uint32_t)batch, loss, 1.0f, S->src, (uint32_t)S->count,
                               S->dtype_code, S->store, NULL);
    S->push_ns = psd_now_ns() - t0;
    if (failed)
        goto out;
    if (S->own && !psd_ring_drained(m, S->slot)) {
        /* The next gradient is computed on weights that hold this one (no --overlap): wait for the
         * server to apply it, a while here without the GIL; past that the general path waits, with the
         * learner's timeout and its checks on the server. */
        int rc;
        Py_BEGIN_ALLOW_THREADS rc = psd_wait_drained(m, S->slot, S->claim, OWN_WAIT_NS);
        Py_END_ALLOW_THREADS if (rc) {
            result = PyLong_FromLong(-1);
            goto out;
        }
    }
    if (!psd_ring_has_space(m, S->slot)) {
        result = PyLong_FromLong(-1);
        goto out;
    }
    uint64_t now = take_weights(m, S->slot, S->copy ? S->front.buf : NULL, clock);
    result = PyLong_FromUnsignedLongLong(now);
out:
    for (k = 0; k < got; k++)
        Py_DECREF(S->grads[k]);
    return result;
}

static PyObject *stepper_close(Stepper *S, PyObject *noargs) {
    (void)noargs;
    if (S->busy) { /* its push runs without the GIL: the mapping and the arrays must outlive it */
        PyErr_SetString(PyExc_RuntimeError, "close: a step of this learner is running in another thread");
        return NULL;
    }
    stepper_release(S);
    Py_RETURN_NONE;
}

static PyObject *stepper_push_ns(Stepper *S, void *closure) {
    (void)closure;
    return PyLong_FromUnsignedLongLong(S->push_ns);
}

static int stepper_set_push_ns(Stepper *S, PyObject *v, void *closure) {
    (void)closure;
    if (!v) {
        PyErr_SetString(PyExc_AttributeError, "push_ns cannot be deleted");
        return -1;
    }
    unsigned long long ns = PyLong_AsUnsignedLongLong(v);
    if (PyErr_Occurred())
        return -1;
    S->push_ns = ns;
    return 0;
}

static PyMethodDef stepper_methods[] = {
    {"step", (PyCFunction)(void (*)(void))stepper_step, METH_FASTCALL,
     "step(clock, loss, batch) -> clock now in the model; -1: pushed, ring full (wait, then pull); "
     "None: a gradient needs the general path (nothing pushed)"},
    {"close", (PyCFunction)stepper_close, METH_NOARGS, "Let go of the mapping and the buffers."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef stepper_getset[] = {
    {"push_ns", (getter)stepper_push_ns, (setter)stepper_set_push_ns, "how long the last push took", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyTypeObject StepperType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "psd._native.Stepper",
    .tp_basicsize = sizeof(Stepper),
    .tp_dealloc = (destructor)stepper_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A learner's whole step (push, ring space, pull) in one call; made by Arena.stepper().",
    .tp_methods = stepper_methods,
    .tp_getset = stepper_getset,
};

/* stepper(slot, params, dtype, dtype_code, strided, front, store=0) -> Stepper. `front`: the buffer an
 * inline pull copies into (n_params float32), or None for pull="view"; `store`: the enum psd_dtype
 * pushed into the ring (push_from's). */
static PyObject *arena_stepper(Arena *a, PyObject *args) {
    unsigned int slot, dtype_code, store = PSD_DTYPE_F32;
    PyObject *params, *dtype, *strided, *front;
    int own = 0;
    unsigned long long claim = 0;
    if (!PyArg_ParseTuple(args, "IO!OIOO|IpK", &slot, &PyTuple_Type, &params, &dtype, &dtype_code, &strided, &front,
                          &store, &own, &claim) ||
        check_slot(a, slot))
        return NULL;
    if ((uint64_t)PyTuple_GET_SIZE(params) != a->map.g.n_pieces) {
        PyErr_Format(PyExc_ValueError, "stepper: params must be the job's %llu trainable tensors",
                     (unsigned long long)a->map.g.n_pieces);
        return NULL;
    }
    if ((!str_grad && !(str_grad = PyUnicode_InternFromString("grad"))) ||
        (!str_layout && !(str_layout = PyUnicode_InternFromString("layout"))) ||
        (!str_dtype && !(str_dtype = PyUnicode_InternFromString("dtype"))) ||
        (!str_is_contiguous && !(str_is_contiguous = PyUnicode_InternFromString("is_contiguous"))) ||
        (!str_data_ptr && !(str_data_ptr = PyUnicode_InternFromString("data_ptr"))))
        return NULL;
    Stepper *S = PyObject_New(Stepper, &StepperType);
    if (!S)
        return NULL;
    S->arena = NULL;
    S->params = S->dtype = S->strided = NULL;
    S->grads = NULL;
    S->src = NULL;
    S->copy = 0;
    S->own = own;
    S->claim = claim;
    S->busy = 0;
    S->push_ns = 0;
    S->slot = slot;
    S->dtype_code = dtype_code;
    S->store = store;
    S->count = PyTuple_GET_SIZE(params);
    if (front != Py_None) {
        if (PyObject_GetBuffer(front, &S->front, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS))
            goto fail;
        S->copy = 1;
        if ((uint64_t)S->front.len != a->map.g.n_params * sizeof(float)) {
            PyErr_SetString(PyExc_ValueError, "stepper: the front buffer must hold n_params float32");
            goto fail;
        }
    }
    S->grads = PyMem_Calloc((size_t)S->count + 1, sizeof *S->grads);
    S->src = PyMem_Calloc((size_t)S->count + 1, sizeof *S->src);
    if (!S->grads || !S->src) {
        PyErr_NoMemory();
        goto fail;
    }
    for (Py_ssize_t k = 0; k < S->count; k++) {
        PyObject *n = PyObject_CallMethod(PyTuple_GET_ITEM(params, k), "numel", NULL);
        if (!n)
            goto fail;
        S->src[k].len = PyLong_AsUnsignedLongLong(n);
        Py_DECREF(n);
        if (PyErr_Occurred())
            goto fail;
    }
    S->params = Py_NewRef(params);
    S->dtype = Py_NewRef(dtype);
    S->strided = Py_NewRef(strided);
    S->arena = Py_NewRef((PyObject *)a);
    a->exports++; /* the stepper writes the ring and reads the weights: the mapping must stay */
    return (PyObject *)S;
fail:
    Py_DECREF(S);
    return NULL;
}
