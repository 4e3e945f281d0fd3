/*
 * arena.c -- creating, opening, growing and mapping a job's arena.
 *
 * The server creates a small arena (header + spec region) at start; the first
 * learner offers its model's spec; the server then grows the arena to hold the
 * weights and the learner rings. Space is reserved with posix_fallocate, so a
 * full /dev/shm is an error here and never a SIGBUS on first touch.
 *
 * Each process maps the arena with the least it needs to write (enum
 * psd_role): a learner's mapping is one read-only mmap of the whole object,
 * with its writable windows mapped over it at their offsets (MAP_FIXED, same
 * object, same offset), so every offset stays valid from one base and a stray
 * write elsewhere faults in the learner, not in the job. Windows opened later
 * (a claimed slot, the offer window) change protection in place (mprotect).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "psd.h"
#include "psd_sigbus.h"

static uint64_t round_up(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

static uint64_t ranks_bytes(uint32_t n_slots) {
    return round_up((uint64_t)n_slots * sizeof(struct psd_rank), PSD_PAGE);
}

static uint64_t slotrec_bytes(uint32_t n_slots) {
    return round_up((uint64_t)n_slots * sizeof(struct psd_slot), PSD_PAGE);
}

size_t psd_header_span(uint32_t n_slots, uint64_t spec_cap) {
    return (size_t)(PSD_HEADER_SIZE + ranks_bytes(n_slots) + slotrec_bytes(n_slots) + round_up(spec_cap, PSD_PAGE));
}

/* a + b and a * b, failing instead of wrapping. */
static bool add_ok(uint64_t a, uint64_t b, uint64_t *out) { return !__builtin_add_overflow(a, b, out); }
static bool mul_ok(uint64_t a, uint64_t b, uint64_t *out) { return !__builtin_mul_overflow(a, b, out); }
static bool page_ok(uint64_t v, uint64_t *out) {
    if (!add_ok(v, PSD_PAGE - 1, out))
        return false;
    *out = *out / PSD_PAGE * PSD_PAGE;
    return true;
}

int psd_geometry(uint32_t n_slots, uint32_t ring_k, uint64_t spec_cap, const struct psd_model *model,
                 uint32_t state_vectors, struct psd_geom *g) {
    const uint64_t max_elems = UINT64_C(1) << 40;
    if (state_vectors > 3 || n_slots == 0 || n_slots > PSD_MAX_SLOTS || ring_k == 0 || ring_k > PSD_MAX_RING ||
        (ring_k & (ring_k - 1)) != 0 || spec_cap > max_elems)
        return EINVAL;
    *g = (struct psd_geom){.n_slots = n_slots, .ring_k = ring_k, .spec_cap = spec_cap, .ranks_off = PSD_HEADER_SIZE,
                           .slotrec_off = PSD_HEADER_SIZE + ranks_bytes(n_slots),
                           .spec_off = PSD_HEADER_SIZE + ranks_bytes(n_slots) + slotrec_bytes(n_slots),
                           .total_size = psd_header_span(n_slots, spec_cap)};
    if (!model)
        return 0;
    if (model->n_params == 0 || model->n_params > max_elems || model->n_train == 0 ||
        model->n_train > model->n_params || model->n_buffers > max_elems || model->n_pieces == 0 ||
        model->n_pieces > model->n_train)
        return EINVAL;
    g->state_vectors = state_vectors;
    g->n_params = model->n_params;
    g->n_train = model->n_train;
    g->n_buffers = model->n_buffers;
    g->n_pieces = model->n_pieces;
    uint64_t payload = psd_grad_span(model->n_train) + model->n_buffers * sizeof(double) + model->n_pieces;
    g->entry_stride = sizeof(struct psd_entry) + round_up(payload, PSD_CACHELINE);
    g->weights_off = g->total_size;
    uint64_t weights_bytes = round_up(model->n_params * sizeof(float), PSD_PAGE);
    uint64_t state_bytes = psd_state_stride(model->n_train) * state_vectors;
    uint64_t buffer_bytes = round_up(model->n_buffers * sizeof(double), PSD_PAGE);
    uint64_t piece_bytes = round_up(model->n_pieces * sizeof(struct psd_piece), PSD_PAGE);
    g->rowlog_cap = psd_rowlog_cap(model->n_train);
    uint64_t rowlog_bytes = round_up(g->rowlog_cap * sizeof(struct psd_rowlog_entry), PSD_PAGE);
    uint64_t ring_bytes, slots_bytes;
    g->optstate_off = g->weights_off + weights_bytes;
    g->buffers_off = g->optstate_off + state_bytes;
    g->pieces_off = g->buffers_off + buffer_bytes;
    g->rowlog_off = g->pieces_off + piece_bytes;
    g->slots_off = g->rowlog_off + rowlog_bytes; /* all below 2^46: no wrap so far */
    g->weights_bytes = model->n_params * sizeof(float);
    g->optstate_bytes = state_bytes;
    if (!mul_ok(ring_k, g->entry_stride, &ring_bytes) || !add_ok(ring_bytes, sizeof(struct psd_lslot), &ring_bytes) ||
        !page_ok(ring_bytes, &g->slot_stride) || !mul_ok(n_slots, g->slot_stride, &slots_bytes) ||
        !add_ok(g->slots_off, slots_bytes, &g->total_size) || g->total_size > (uint64_t)SIZE_MAX / 2)
        return EINVAL;
    return 0;
}

/* Whether the header stores the offsets of model geometry g (psd_arena_grow wrote them). */
static bool header_matches(const struct psd_header *h, const struct psd_geom *g) {
    return h->total_size == g->total_size && h->weights_off == g->weights_off &&
           h->weights_bytes == g->weights_bytes && h->optstate_off == g->optstate_off &&
           h->optstate_bytes == g->optstate_bytes && h->buffers_off == g->buffers_off &&
           h->pieces_off == g->pieces_off && h->rowlog_off == g->rowlog_off && h->slots_off == g->slots_off && h->slot_stride == g->slot_stride &&
           h->entry_stride == g->entry_stride;
}

/* One reading of the header's geometry; EAGAIN if the state moved meanwhile. */
static int adopt_once(struct psd_map *m, struct psd_geom *out) {
    const struct psd_header *h = psd_hdr(m);
    /* Pairs with the store-release of state in psd_arena_set_state: the model geometry of a
     * grown arena was written before. */
    uint32_t state = PSD_LOAD_ACQ(&h->state);
    struct psd_geom fixed, full;
    if (psd_geometry(h->n_slots, h->ring_k, h->spec_cap, NULL, 0, &fixed) || h->ranks_off != fixed.ranks_off ||
        h->slotrec_off != fixed.slotrec_off || h->spec_off != fixed.spec_off || fixed.total_size > m->size)
        return PSD_EGEOMETRY;
    *out = fixed;
    bool grown = state == PSD_ARENA_INIT_WEIGHTS || state == PSD_ARENA_READY ||
                 (state == PSD_ARENA_STOPPED && h->weights_off != 0);
    if (!grown)
        return 0;
    const struct psd_model model = {h->n_params, h->n_train, h->n_buffers, h->n_pieces};
    int rc = psd_geometry(fixed.n_slots, fixed.ring_k, fixed.spec_cap, &model,
                          psd_state_vectors(h->cfg.optimizer, h->cfg.sync_mode), &full);
    if (PSD_LOAD_ACQ(&h->state) != state) /* pairs with the store-release in psd_arena_set_state */
        return EAGAIN;
    if (rc || !header_matches(h, &full))
        return PSD_EGEOMETRY;
    if (full.total_size <= m->size) /* else mapped before it grew: a remap adopts the model */
        *out = full;
    return 0;
}

int psd_arena_adopt(struct psd_map *m) {
    struct psd_geom g;
    int rc = EAGAIN;
    for (int tries = 0; rc == EAGAIN && tries < 8; tries++)
        rc = adopt_once(m, &g);
    if (rc == EAGAIN)
        rc = PSD_EGEOMETRY; /* the state kept moving: a server resetting the arena in a loop */
    if (rc == 0)
        m->g = g;
    return rc;
}

/* A grow reserves and clears the arena this many bytes at a time, storing the heartbeat after each:
 * several GB take seconds (4 GB/s here), and the watchdog restarts a server that has not beaten for
 * its --heartbeat-timeout (2 s). */
#define GROW_CHUNK (256ull << 20)

static void beat(struct psd_header *h) {
    if (h)
        PSD_STORE_RLX(&h->heartbeat_ns, psd_now_ns()); /* read by psd_server_alive, the watchdog */
}

/* Reserve [0, size) of the file; `h` (NULL: none yet) beats after each chunk. The file only ever grows: one
 * grown for a larger model that never arrived (its offerer died, psd/server.py) keeps its size for a smaller
 * one (the geometry asks total_size <= the file's size), so that a file shorter than a mapping of it always
 * means a truncation by another process (the watchdog restarts the server at once: ArenaWatch.truncated). */
static int reserve(int fd, uint64_t size, struct psd_header *h) {
    struct stat st;
    if (fstat(fd, &st) != 0)
        return errno;
    if ((uint64_t)st.st_size < size && ftruncate(fd, (off_t)size) != 0)
        return errno;
    for (uint64_t off = 0; off < size; off += GROW_CHUNK) {
        uint64_t len = size - off < GROW_CHUNK ? size - off : GROW_CHUNK;
        /* posix_fallocate returns the error instead of setting errno. */
        int rc = posix_fallocate(fd, (off_t)off, (off_t)len);
        if (rc)
            return rc == EINVAL ? 0 : rc; /* EINVAL: filesystem cannot reserve; ftruncate stands */
        beat(h);
    }
    return 0;
}

static void map_init(struct psd_map *m) {
    *m = (struct psd_map){.fd = -1, .role = PSD_ROLE_FULL}; /* every other field 0 (a new one too) */
}

/* [off, off + len) rounded out to pages, if it lies within the mapping: offsets read from
 * shared memory are checked before they steer a protection change. */
static bool span(const struct psd_map *m, uint64_t off, uint64_t len, uint64_t *lo, uint64_t *n) {
    uint64_t end;
    if (!add_ok(off, len, &end) || !page_ok(end, &end))
        return false;
    *lo = off / PSD_PAGE * PSD_PAGE;
    if (end > m->size || *lo > end)
        return false;
    *n = end - *lo;
    return true;
}

static int protect(struct psd_map *m, uint64_t off, uint64_t len, bool writable) {
    uint64_t lo, n;
    if (!span(m, off, len, &lo, &n))
        return EINVAL;
    if (n && mprotect(m->base + lo, n, PROT_READ | (writable ? PROT_WRITE : 0)) != 0)
        return errno;
    return 0;
}

/* Map the object's first `size` bytes with the role's protections, at a new base. */
static int map_role(struct psd_map *m, size_t size) {
    int prot = m->role == PSD_ROLE_FULL ? PROT_READ | PROT_WRITE : PROT_READ;
    void *base = mmap(NULL, size, prot, MAP_SHARED, m->fd, 0);
    if (base == MAP_FAILED)
        return errno;
    m->base = base;
    m->size = size;
    if (m->role == PSD_ROLE_LEARNER && size >= PSD_HEADER_SIZE) {
        /* The header's shared page, writable over the read-only mapping at its own offset. */
        void *p = mmap(m->base + PSD_PAGE, PSD_HEADER_SIZE - PSD_PAGE, PROT_READ | PROT_WRITE,
                       MAP_SHARED | MAP_FIXED, m->fd, PSD_PAGE);
        if (p == MAP_FAILED)
            return errno; /* the caller closes the mapping */
    }
    return 0;
}

int psd_arena_protect(struct psd_map *m) {
    if (m->role != PSD_ROLE_LEARNER)
        return 0;
    /* The mapping's own checked geometry, never the header's: a stray write there moves nothing. */
    const struct psd_geom *g = &m->g;
    bool offer = m->offering != 0;
    int rc = protect(m, 0, PSD_PAGE, offer);
    if (!rc)
        rc = protect(m, g->spec_off, g->spec_cap, offer);
    if (rc || !psd_has_model(m))
        return rc;
    if ((rc = protect(m, g->weights_off, g->weights_bytes, offer)) != 0 ||
        (rc = protect(m, g->buffers_off, g->n_buffers * sizeof(double), offer)) != 0)
        return rc;
    for (uint32_t i = 0; i < m->n_held && i < g->n_slots; i++) {
        uint64_t off;
        if (!mul_ok(i, g->slot_stride, &off) || !add_ok(off, g->slots_off, &off))
            return EINVAL;
        if ((rc = protect(m, off, g->slot_stride, PSD_LOAD_RLX(&m->held[i]) != 0)) != 0)
            return rc;
    }
    return 0;
}

int psd_arena_offer_window(struct psd_map *m, bool open) {
    if (m->role != PSD_ROLE_LEARNER)
        return 0;
    m->offering = open;
    return psd_arena_protect(m);
}

int psd_arena_create(struct psd_map *m, const char *shm_name, mode_t mode, uint32_t n_slots,
                     uint32_t ring_k, uint64_t spec_cap, const char *version) {
    struct psd_geom g;
    int rc = psd_geometry(n_slots, ring_k, spec_cap, NULL, 0, &g);
    if (rc)
        return rc;
    size_t size = (size_t)g.total_size;
    map_init(m);
    int fd = shm_open(shm_name, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, mode);
    if (fd < 0)
        return errno;
    if (fchmod(fd, mode) != 0 || (rc = reserve(fd, size, NULL)) != 0) {
        rc = rc ? rc : errno;
        close(fd);
        shm_unlink(shm_name);
        return rc;
    }
    void *base = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (base == MAP_FAILED) {
        rc = errno;
        close(fd);
        shm_unlink(shm_name);
        return rc;
    }
    m->fd = fd;
    m->base = base;
    m->size = size;
    m->g = g;

    struct psd_header *h = psd_hdr(m);
    memset(h, 0, sizeof *h);
    h->layout_version = PSD_LAYOUT_VERSION;
    h->fingerprint = psd_fingerprint();
    double full = 1.0; /* the damping applies until the server has measured the job (psd/gain.py damping) */
    uint64_t full_bits;
    memcpy(&full_bits, &full, sizeof full_bits);
    atomic_init(&h->damping_bits, full_bits);
    strncpy(h->psd_version, version, PSD_VERSION_LEN - 1);
    h->n_slots = n_slots;
    h->ring_k = ring_k;
    h->ranks_off = g.ranks_off;
    h->slotrec_off = g.slotrec_off;
    h->spec_off = g.spec_off;
    h->spec_cap = spec_cap;
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    h->created_unix_ns = (uint64_t)now.tv_sec * 1000000000ull + (uint64_t)now.tv_nsec;
    h->total_size = size;
    if ((rc = psd_mutex_init(&h->admission)) != 0) {
        psd_arena_close(m);
        shm_unlink(shm_name);
        return rc;
    }
    psd_cond_init(&h->state_cond);
    psd_cond_init(&h->doorbell);
    psd_cond_init(&h->sync_cond);
    for (uint32_t i = 0; i < n_slots; i++)
        atomic_init(&psd_slot_at(m, i)->rank, -1); /* fresh pages are zero: every slot FREE */
    h->cfg.push_every = 1;
    h->cfg.max_staleness = UINT64_MAX;
    atomic_init(&h->state, PSD_ARENA_WAITING_SPEC);
    /* Publish: pairs with the load-acquire of magic in psd_arena_open_as. */
    PSD_STORE_REL(&h->magic, PSD_MAGIC);
    return 0;
}

int psd_arena_open_as(struct psd_map *m, const char *shm_name, uint32_t role) {
    if (role > PSD_ROLE_READER)
        return EINVAL;
    map_init(m);
    int fd = shm_open(shm_name, (role == PSD_ROLE_READER ? O_RDONLY : O_RDWR) | O_CLOEXEC, 0);
    if (fd < 0)
        return errno;
    struct stat st;
    if (fstat(fd, &st) != 0) {
        int rc = errno;
        close(fd);
        return rc;
    }
    if ((uint64_t)st.st_size < PSD_HEADER_SIZE) {
        close(fd);
        return PSD_EINIT; /* created, not yet sized */
    }
    m->fd = fd;
    m->role = role;
    int rc = map_role(m, (size_t)st.st_size);
    if (rc) {
        psd_arena_close(m);
        return rc;
    }
    struct psd_header *h = psd_hdr(m);
    /* Pairs with the store-release of magic in psd_arena_create. */
    uint64_t magic = PSD_LOAD_ACQ(&h->magic);
    if (magic != PSD_MAGIC)
        return magic == 0 ? PSD_EINIT : PSD_EBADMAGIC; /* mapping stays open: the caller closes it */
    if (h->layout_version != PSD_LAYOUT_VERSION || h->fingerprint != psd_fingerprint())
        return PSD_EVERSION; /* mapping stays open so the caller can name the version */
    return psd_arena_adopt(m); /* mapping stays open on an error: the caller closes it */
}

/* Map the whole file, at the size fstat gives now. */
static int map_file_size(struct psd_map *m) {
    struct stat st;
    if (fstat(m->fd, &st) != 0)
        return errno;
    if ((size_t)st.st_size == m->size)
        return 0;
    if (m->role == PSD_ROLE_FULL) {
        void *base = mremap(m->base, m->size, (size_t)st.st_size, MREMAP_MAYMOVE);
        if (base == MAP_FAILED)
            return errno;
        if (base != m->base)
            psd_sigbus_forget(m->base, m->size);
        m->base = base;
        m->size = (size_t)st.st_size;
        return 0;
    }
    /* A mapping of several protections is several mappings, which mremap does not move as
     * one: map afresh (psd_arena_remap opens the windows again). The lease thread reads
     * through the base. */
    psd_lease_stop(m);
    munmap(m->base, m->size);
    psd_sigbus_forget(m->base, m->size);
    m->base = NULL;
    m->size = 0;
    return map_role(m, (size_t)st.st_size);
}

int psd_arena_remap(struct psd_map *m) {
    if (psd_sigbus_lost(m->base, m->size))
        return PSD_ELOST; /* zero pages now, not the file's: moving them would hide the loss */
    size_t was = m->size;
    int rc = map_file_size(m);
    if (rc)
        return rc;
    /* A mapping that holds its model keeps its geometry (a stray write into the header cannot
     * move it), unless the file changed size under it: then it was regrown, or truncated. */
    if (!(psd_has_model(m) && m->size == was))
        rc = psd_arena_adopt(m);
    if (rc == 0 && m->size != was)
        rc = psd_arena_protect(m); /* a learner's windows, over its new mapping */
    if (rc == 0 && m->held)
        rc = psd_lease_start(m); /* it held slots: renew them again */
    return rc;
}

void psd_arena_close(struct psd_map *m) {
    psd_lease_stop(m); /* before the unmap: it renews through the mapping */
    free((void *)m->held);
    m->held = NULL;
    m->n_held = 0;
    if (m->base) {
        munmap(m->base, m->size);
        psd_sigbus_forget(m->base, m->size);
    }
    if (m->fd >= 0)
        close(m->fd);
    m->base = NULL;
    m->size = 0;
    m->fd = -1;
}

void psd_arena_set_state(struct psd_map *m, uint32_t state) {
    struct psd_header *h = psd_hdr(m);
    /* Pairs with the load-acquire of state in psd_arena_wait_state and
     * everywhere the geometry or spec is read after checking the state. */
    PSD_STORE_REL(&h->state, state);
    psd_cond_broadcast(&h->state_cond);
}

static int offer(struct psd_map *m, const void *spec, uint64_t len, uint64_t hash, const struct psd_model *model,
                 pid_t pid, uint64_t start_time);

int psd_arena_set_spec(struct psd_map *m, const void *spec, uint64_t len, uint64_t hash,
                       const struct psd_model *model, pid_t pid, uint64_t start_time) {
    struct psd_geom g;
    if (len > m->g.spec_cap || psd_geometry(m->g.n_slots, m->g.ring_k, m->g.spec_cap, model, 0, &g) != 0)
        return PSD_ESPEC;
    /* A learner's offer window: the header's server page and the spec, only for this call. */
    bool window = m->role == PSD_ROLE_LEARNER && !m->offering;
    int rc = window ? psd_arena_offer_window(m, true) : 0;
    if (rc == 0)
        rc = offer(m, spec, len, hash, model, pid, start_time);
    if (window) {
        int closed = psd_arena_offer_window(m, false);
        rc = rc ? rc : closed;
    }
    return rc;
}

static int offer(struct psd_map *m, const void *spec, uint64_t len, uint64_t hash, const struct psd_model *model,
                 pid_t pid, uint64_t start_time) {
    struct psd_header *h = psd_hdr(m);
    int rc = psd_mutex_lock(h, &h->admission);
    if (!psd_locked(rc))
        return rc;
    if (PSD_LOAD_ACQ(&h->state) != PSD_ARENA_WAITING_SPEC) {
        psd_mutex_unlock(&h->admission);
        return PSD_ESTATE; /* somebody else offered first */
    }
    memcpy(m->base + m->g.spec_off, spec, len);
    h->spec_len = len;
    h->spec_hash = hash;
    h->n_params = model->n_params;
    h->n_train = model->n_train;
    h->n_buffers = model->n_buffers;
    h->n_pieces = model->n_pieces;
    h->offer_pid = pid;
    h->offer_start_time = start_time;
    h->offer_pid_ns = psd_pid_ns(); /* the offerer is always the calling process */
    h->fail_msg[0] = '\0';
    psd_arena_set_state(m, PSD_ARENA_SPEC_OFFERED);
    psd_mutex_unlock(&h->admission);
    return 0;
}

int psd_arena_grow(struct psd_map *m) {
    struct psd_header *h = psd_hdr(m);
    struct psd_geom g;
    /* The model's sizes, as the offerer wrote them, read once: everything below uses g. */
    const struct psd_model model = {h->n_params, h->n_train, h->n_buffers, h->n_pieces};
    uint32_t vectors = psd_state_vectors(h->cfg.optimizer, h->cfg.sync_mode);
    int rc = psd_geometry(m->g.n_slots, m->g.ring_k, m->g.spec_cap, &model, vectors, &g);
    if (rc)
        return rc;
    if ((rc = reserve(m->fd, g.total_size, h)) != 0) {
        /* Give back whatever was reserved: the arena stays header-sized. */
        if (ftruncate(m->fd, (off_t)m->size) != 0) {
            /* nothing more to do: the size check before the next grow repeats */
        }
        return rc;
    }
    if ((rc = map_file_size(m)) != 0)
        return rc;
    if (g.total_size > m->size)
        return PSD_EGEOMETRY; /* shrunk under us since it was reserved */
    h = psd_hdr(m);
    if (h->weights_off != 0) /* a regrow after a reset starts clean; fresh pages are zero */
        for (uint64_t off = g.weights_off; off < g.total_size; off += GROW_CHUNK) {
            uint64_t len = g.total_size - off < GROW_CHUNK ? g.total_size - off : GROW_CHUNK;
            memset(m->base + off, 0, (size_t)len);
            beat(h);
        }
    m->g = g;
    h->n_params = g.n_params;
    h->n_train = g.n_train;
    h->n_buffers = g.n_buffers;
    h->n_pieces = g.n_pieces;
    h->weights_off = g.weights_off;
    h->weights_bytes = g.weights_bytes;
    h->optstate_off = g.optstate_off;
    h->optstate_bytes = g.optstate_bytes;
    h->buffers_off = g.buffers_off;
    h->pieces_off = g.pieces_off;
    h->rowlog_off = g.rowlog_off;
    atomic_store_explicit(&h->rowlog_head, 0, memory_order_relaxed); /* the log was zeroed above */
    atomic_fetch_add_explicit(&h->weights_epoch, 1, memory_order_release); /* new weights: pull them all */
    h->slots_off = g.slots_off;
    h->slot_stride = g.slot_stride;
    h->entry_stride = g.entry_stride;
    h->total_size = g.total_size;
    /* Every slot FREE with an empty ring, also after a reset: a new model, new learners. */
    memset(psd_slot_at(m, 0), 0, (size_t)g.n_slots * sizeof(struct psd_slot));
    for (uint32_t i = 0; i < g.n_slots; i++)
        atomic_init(&psd_slot_at(m, i)->rank, -1);
    return 0;
}

int psd_arena_wait_state(struct psd_map *m, uint32_t not_state, uint64_t timeout_ns) {
    struct psd_header *h = psd_hdr(m);
    uint64_t deadline = psd_now_ns() + timeout_ns;
    /* A reader's mapping is read-only everywhere: it waits without announcing itself (the waiters count is a
     * write, which faulted), as psd_arena_set_state broadcasts at every change whoever waits. The seq_cst load
     * of seq comes before the state's load, as in psd_cond_prepare. */
    bool announce = m->role != PSD_ROLE_READER;
    for (;;) {
        uint32_t seen = announce ? psd_cond_prepare(&h->state_cond) : atomic_load(&h->state_cond.seq);
        /* Pairs with the store-release in psd_arena_set_state. */
        if (PSD_LOAD_ACQ(&h->state) != not_state) {
            if (announce)
                psd_cond_done(&h->state_cond);
            return 0;
        }
        uint64_t now = psd_now_ns();
        if (now >= deadline) {
            if (announce)
                psd_cond_done(&h->state_cond);
            return PSD_ETIMEOUT;
        }
        uint64_t left = deadline - now;
        int rc = psd_cond_wait(&h->state_cond, seen, left < PSD_WAIT_SLICE_NS ? left : PSD_WAIT_SLICE_NS);
        if (announce)
            psd_cond_done(&h->state_cond);
        if (rc == EINTR)
            return EINTR;
    }
}
