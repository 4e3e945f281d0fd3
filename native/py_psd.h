/*
 * py_psd.h -- what the files of the binding psd._native share (private: only
 * native/py_*.c include it).
 *
 * The binding wraps one mapping of an arena as `Arena` (py_arena.c), whose
 * methods live in the file named after who calls them: py_learner.c (learner
 * side), py_server.c (server side), py_inspect.c (status and inspection).
 * py_module.c builds the module, joins the method tables and turns C error
 * codes into subclasses of psd.Error. Blocking calls release the GIL and retry
 * on EINTR while PyErr_CheckSignals() allows, so Ctrl-C works.
 */
#ifndef PY_PSD_H
#define PY_PSD_H

#define PY_SSIZE_T_CLEAN
#define _GNU_SOURCE
#include <Python.h>

#include "psd.h"

/* One mapping of an arena, exported through the buffer protocol (so
 * torch.frombuffer gives zero-copy tensors over the weights and ring entries);
 * it refuses to unmap while any buffer is still exported. */
typedef struct {
    PyObject_HEAD struct psd_map map;
    Py_ssize_t exports;
    struct psd_loop *loop;
    char name[256];
} Arena;

/* Run `call` with the GIL released until it returns something other than EINTR or a signal handler
 * raises (PEP 475's rule for a blocking call: a handler that returns lets the wait go on). A call given a
 * timeout takes what is left of it (psd_left_ns), so signals do not stretch the wait. */
#define BLOCKING(rc, call)                                                                         \
    do {                                                                                           \
        for (;;) {                                                                                 \
            Py_BEGIN_ALLOW_THREADS rc = (call);                                                    \
            Py_END_ALLOW_THREADS if (rc != EINTR) break;                                           \
            if (PyErr_CheckSignals())                                                              \
                return NULL;                                                                       \
        }                                                                                          \
    } while (0)

/* Nanoseconds from now to `deadline` (CLOCK_MONOTONIC, psd_now_ns), 0 once it has passed. */
static inline uint64_t psd_left_ns(uint64_t deadline) {
    uint64_t now = psd_now_ns();
    return deadline > now ? deadline - now : 0;
}

extern PyTypeObject ArenaType;  /* py_arena.c */
extern PyTypeObject PullerType; /* py_learner.c */
extern PyTypeObject StepperType; /* py_learner.c */

/* py_arena.c */
Arena *new_arena(const char *name);
/* Stop and join the update loop, if this mapping runs one. */
void stop_loop(Arena *a);
/* 0, or -1 with an exception set: the arena was closed (ValueError), or lost to a SIGBUS (ArenaLost). */
int check_open(Arena *a);
/* 0, or -1 with an exception set: closed or lost (check_open), or a mapping of a lesser role than `most`
 * (enum psd_role: a reader's or a learner's mapping asked for a server's call, whose write would fault:
 * PermissionError, not a SIGSEGV). A learner's mapping in its offer window may also set the state. */
int check_role(Arena *a, uint32_t most);
/* 0, or -1 with an exception set: closed, not grown yet, or no such slot. */
int check_slot(Arena *a, unsigned int slot);
/* `r` (a new reference, or NULL with an exception set), unless the mapping was lost to a SIGBUS while it was
 * read (sigbus.c's recovery: the reads saw zeros): then NULL with ArenaLost. */
PyObject *unless_lost(Arena *a, PyObject *r);

/* py_module.c */
/* The class psd.errors.<cls> (a new reference), or NULL with an exception set. */
PyObject *error_type(const char *cls);
/* Raise for `code` as "operation: description"; always returns NULL. */
PyObject *raise_code(int code, const char *op, const char *filename);
/* The index of `name` in `names` (n of them), or -1 with ValueError naming `what`. */
int name_index(const char *what, const char *name, const char *const *names, int n);
/* Names of enum psd_optimizer, psd_sync and psd_schedule, in their order. */
#define N_OPTIMIZERS 6
#define N_SYNCS 4
#define N_SCHEDULES 3
extern const char *const optimizer_names[N_OPTIMIZERS];
extern const char *const sync_names[N_SYNCS];
extern const char *const schedule_names[N_SCHEDULES];

static inline uint64_t seconds_to_ns(double s) { return s <= 0 ? 0 : (uint64_t)(s * 1e9); }

/* Method tables of Arena, by caller, each ending with a NULL entry; py_module.c joins them. */
extern PyMethodDef py_arena_methods[], py_learner_methods[], py_server_methods[], py_inspect_methods[];
/* Module-level functions, by caller. */
extern PyMethodDef py_arena_functions[], py_server_functions[];

#endif
