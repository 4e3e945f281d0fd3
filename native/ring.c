/*
 * ring.c -- learner slots and the producer side of each SPSC ring.
 *
 * A learner is the only producer of its ring: it writes an entry, then
 * store-releases the tail past it. The update loop (update.c) is the only
 * consumer. So a gradient is either wholly pushed (tail moved past it) and will
 * be applied exactly once, or it was never pushed; a learner that dies halfway
 * through writing leaves the tail where it was.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "psd.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#define PSD_HAVE_STREAM 1
#endif

static int lock_slot(struct psd_map *m, struct psd_slot *s) {
    int rc = psd_mutex_lock(psd_hdr(m), &s->mutex);
    return psd_locked(rc) ? 0 : rc; /* a dead previous holder is counted, nothing to repair */
}

/* The claim token m holds for `slot`, 0 if none. */
static uint64_t held_token(const struct psd_map *m, uint32_t slot) {
    return slot < m->n_held ? PSD_LOAD_RLX(&m->held[slot]) : 0;
}

/* m's table of held slots, made once (under the admission mutex: claims of one mapping from
 * several threads are serialised by it). */
static int held_table(struct psd_map *m, uint32_t n_slots) {
    if (m->held)
        return 0;
    if (n_slots == 0 || n_slots > PSD_MAX_SLOTS)
        return EINVAL;
    m->held = calloc(n_slots, sizeof *m->held);
    if (!m->held)
        return ENOMEM;
    m->n_held = n_slots;
    return 0;
}

int psd_slot_claim(struct psd_map *m, pid_t pid, uint64_t start_time, int32_t rank, uint32_t *slot,
                   uint64_t *claim) {
    struct psd_header *h = psd_hdr(m);
    /* Pairs with the store-release of READY in psd_arena_set_state. */
    if (PSD_LOAD_ACQ(&h->state) != PSD_ARENA_READY)
        return PSD_ESTATE;
    if (!psd_has_model(m))
        return PSD_ESTATE; /* not mapped at the grown size yet */
    uint64_t pid_ns = psd_pid_ns();
    int rc = psd_mutex_lock(h, &h->admission);
    if (!psd_locked(rc))
        return rc;
    if ((rc = held_table(m, m->g.n_slots)) != 0) {
        psd_mutex_unlock(&h->admission);
        return rc;
    }
    /* Slots this mapping lost (taken back, handed on) are not its to write any more. */
    for (uint32_t i = 0; i < m->n_held; i++) {
        uint64_t token = PSD_LOAD_RLX(&m->held[i]);
        if (token && PSD_LOAD_RLX(&psd_slot_at(m, i)->claims) != token)
            PSD_STORE_RLX(&m->held[i], 0);
    }
    rc = PSD_ENOSLOT;
    for (uint32_t i = 0; i < m->g.n_slots; i++) {
        struct psd_slot *s = psd_slot_at(m, i);
        if (PSD_LOAD_ACQ(&s->state) != PSD_SLOT_FREE)
            continue;
        /* Writable before its mutex is taken: the lock itself writes the slot. */
        PSD_STORE_RLX(&m->held[i], UINT64_MAX); /* a placeholder until the claim's token */
        if ((rc = psd_arena_protect(m)) != 0 || (rc = lock_slot(m, s)) != 0) {
            PSD_STORE_RLX(&m->held[i], 0);
            break;
        }
        PSD_STORE_RLX(&s->pid, pid);
        PSD_STORE_RLX(&s->start_time, start_time);
        PSD_STORE_RLX(&s->pid_ns, pid_ns);
        PSD_ADD_RLX(&s->claims, 1);
        PSD_STORE_RLX(&s->rank, rank >= 0 && (uint32_t)rank < m->g.n_slots ? rank : -1);
        PSD_STORE_RLX(&s->learner_clock, 0);
        PSD_STORE_RLX(&s->pulls, 0);
        PSD_STORE_RLX(&s->pulls_skipped, 0);
        PSD_STORE_RLX(&s->full_waits, 0);
        PSD_STORE_RLX(&s->applied, 0);
        PSD_STORE_RLX(&s->rejected, 0);
        PSD_STORE_RLX(&s->staleness_sum, 0);
        PSD_STORE_RLX(&s->staleness_max, 0);
        PSD_STORE_RLX(&s->dropped, 0);
        PSD_STORE_RLX(&s->round_joined, 0);
        PSD_STORE_RLX(&s->tail, 0); /* a free slot's ring is empty (free_slot, evict): so it stays, */
        PSD_STORE_RLX(&s->head, 0); /* whatever a stray write left in it (the loop's head is 0 too) */
        uint64_t mine, slowest;
        PSD_STORE_RLX(&s->ssp_base, 0);
        psd_ssp_clocks(m, i, true, &mine, &slowest); /* ssp: join at the slowest learner's clock */
        PSD_STORE_RLX(&s->ssp_base, slowest == UINT64_MAX ? 0 : slowest - PSD_LOAD_RLX(&s->tail));
        /* Pairs with the load-acquire of state in the update loop and reaper. */
        PSD_STORE_REL(&s->state, PSD_SLOT_ACTIVE);
        *slot = i;
        *claim = PSD_LOAD_RLX(&s->claims);
        PSD_STORE_RLX(&m->held[i], *claim); /* read by this process's pushes and lease thread */
        psd_mutex_unlock(&s->mutex);
        break;
    }
    int prot = psd_arena_protect(m); /* lost slots read-only again */
    psd_mutex_unlock(&h->admission);
    if (rc == 0 && prot == 0)
        prot = psd_lease_start(m);
    return rc ? rc : prot;
}

static bool still_mine(struct psd_slot *s, uint64_t claim) {
    return PSD_LOAD_RLX(&s->claims) == claim && PSD_LOAD_ACQ(&s->state) == PSD_SLOT_ACTIVE;
}

int psd_slot_release(struct psd_map *m, uint32_t slot, uint64_t claim) {
    struct psd_slot *s = psd_slot_at(m, slot);
    int rc = lock_slot(m, s);
    if (rc)
        return rc;
    if (still_mine(s, claim)) {
        /* The update loop drains what is left, then frees the slot. */
        PSD_STORE_REL(&s->state, PSD_SLOT_DRAINING);
        rc = 0;
    } else {
        rc = PSD_ESLOT;
    }
    psd_mutex_unlock(&s->mutex);
    if (rc == 0) {
        struct psd_header *h = psd_hdr(m);
        if (atomic_load(&h->sleeping))
            psd_cond_broadcast(&h->doorbell);
        psd_cond_broadcast_if_waiters(&h->sync_cond); /* ssp: the slowest may have left */
    }
    return rc;
}

#define PSD_EXP_MASK 0x7f800000u /* a float's exponent bits: all ones is inf or nan */

static inline uint32_t nonfinite(uint32_t bits) { return (bits & PSD_EXP_MASK) == PSD_EXP_MASK; }

/* Scale the gradient in place (unless scale is 1); whether it is all finite. */
static bool scale_and_check(float *g, uint64_t n, float scale) {
    uint32_t bad = 0;
    if (scale != 1.0f)
        for (uint64_t i = 0; i < n; i++)
            g[i] *= scale;
    const uint32_t *bits = (const uint32_t *)g;
    for (uint64_t i = 0; i < n; i++)
        bad |= nonfinite(bits[i]);
    return !bad;
}

/* IEEE half to single, exact (subnormals, infinities and NaNs included). */
static inline float f16_to_f32(uint16_t v) {
    const uint32_t shifted_exp = UINT32_C(0x7c00) << 13;
    uint32_t o = ((uint32_t)v & 0x7fffu) << 13, exp = shifted_exp & o;
    float f;
    o += (uint32_t)(127 - 15) << 23;
    if (exp == shifted_exp) {
        o += (uint32_t)(128 - 16) << 23; /* inf or nan */
    } else if (exp == 0) {               /* zero or subnormal: renormalise */
        o += UINT32_C(1) << 23;
        memcpy(&f, &o, sizeof f);
        f -= 6.103515625e-05f; /* 2^-14 */
        memcpy(&o, &f, sizeof o);
    }
    o |= ((uint32_t)v & 0x8000u) << 16;
    memcpy(&f, &o, sizeof f);
    return f;
}

static inline size_t dtype_size(uint32_t dtype) { return dtype == PSD_DTYPE_F32 ? 4 : 2; }

/* For each of the n source values of `dtype` (float32 from `f`, bfloat16 or float16 from `half`):
 * v, the value times scale, and b, its bits; then STORE, a statement on i, v and b. */
#define PSD_CONVERT_EACH(STORE)                                                                                   \
    do {                                                                                                          \
        if (dtype == PSD_DTYPE_F32)                                                                               \
            PSD_CONVERT_LOOP(f[i], STORE)                                                                         \
        else if (dtype == PSD_DTYPE_BF16)                                                                         \
            PSD_CONVERT_LOOP(psd_bf16_to_f32(half[i]), STORE)                                                     \
        else                                                                                                      \
            PSD_CONVERT_LOOP(f16_to_f32(half[i]), STORE)                                                          \
    } while (0)
#define PSD_CONVERT_LOOP(expr, STORE)                                                                             \
    for (uint64_t i = 0; i < n; i++) {                                                                            \
        float v = (expr) * scale;                                                                                 \
        uint32_t b;                                                                                               \
        memcpy(&b, &v, sizeof b);                                                                                 \
        STORE                                                                                                     \
    }

/* dst = src * scale, src of `dtype` (NULL: zeros), checking finiteness in the
 * same pass; returns nonzero if any value is inf or nan. */
static uint32_t copy_check(float *restrict dst, const void *restrict src, uint64_t n, float scale, uint32_t dtype) {
    uint32_t bad = 0;
    if (!src) {
        memset(dst, 0, n * sizeof(float));
        return 0;
    }
    const float *f = src;
    const uint16_t *half = src;
    PSD_CONVERT_EACH({
        bad |= nonfinite(b);
        dst[i] = v;
    });
    return bad;
}

/* bfloat16 bits of a float, rounded to nearest even (as torch rounds); a NaN's bits may come out
 * as anything: the caller flags it non-finite from the float's own bits. */
static inline uint16_t f32_to_bf16(uint32_t bits) { return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16); }

/* As copy_check, storing bfloat16 (--grad-dtype bf16): a value that rounds to an infinity is
 * non-finite too. */
static uint32_t copy_check_bf16(uint16_t *restrict dst, const void *restrict src, uint64_t n, float scale,
                                uint32_t dtype) {
    uint32_t bad = 0;
    const float *f = src;
    const uint16_t *half = src;
    PSD_CONVERT_EACH({
        uint16_t r = f32_to_bf16(b);
        bad |= nonfinite(b) | nonfinite((uint32_t)r << 16);
        dst[i] = r;
    });
    return bad;
}
#undef PSD_CONVERT_EACH
#undef PSD_CONVERT_LOOP

#ifdef PSD_HAVE_STREAM
/* As copy_check for float32, with non-temporal stores: the entry goes to
 * memory without first being read into this core's cache (the update loop, on
 * another core, reads it from memory anyway once it is larger than the caches). */
static uint32_t copy_check_stream(float *restrict dst, const float *restrict src, uint64_t n, float scale) {
    uint64_t i = 0;
    uint32_t bad = 0;
    for (; i < n && ((uintptr_t)(dst + i) & 15); i++) /* up to a 16-byte boundary */
        bad |= copy_check(dst + i, src + i, 1, scale, PSD_DTYPE_F32);
    const __m128 k = _mm_set1_ps(scale);
    const __m128i exp = _mm_set1_epi32((int)PSD_EXP_MASK);
    __m128i acc = _mm_setzero_si128();
    for (; i + 8 <= n; i += 8) {
        __m128 a = _mm_mul_ps(_mm_loadu_ps(src + i), k), b = _mm_mul_ps(_mm_loadu_ps(src + i + 4), k);
        __m128i ea = _mm_and_si128(_mm_castps_si128(a), exp), eb = _mm_and_si128(_mm_castps_si128(b), exp);
        acc = _mm_or_si128(acc, _mm_or_si128(_mm_cmpeq_epi32(ea, exp), _mm_cmpeq_epi32(eb, exp)));
        _mm_stream_ps(dst + i, a);
        _mm_stream_ps(dst + i + 4, b);
    }
    bad |= (uint32_t)_mm_movemask_epi8(acc) != 0;
    return bad | copy_check(dst + i, src + i, n - i, scale, PSD_DTYPE_F32);
}

/* As copy_check_bf16 for float32, eight values at a time: the rounding add is done on the 32-bit
 * lanes and an arithmetic shift leaves each lane's top half sign-extended, which _mm_packs_epi32
 * packs unchanged (SSE2 has no unsigned 32-to-16 pack); the exponent of both the value and the
 * rounded sum is checked. `stream`: non-temporal stores (the entry goes to memory without being
 * read into this core's cache first), once dst is 16-byte aligned. */
static uint32_t copy_check_bf16_sse2(uint16_t *restrict dst, const float *restrict src, uint64_t n, float scale,
                                     bool stream) {
    uint64_t i = 0;
    uint32_t bad = 0;
    for (; i < n && ((uintptr_t)(dst + i) & 15); i++) /* up to a 16-byte boundary */
        bad |= copy_check_bf16(dst + i, src + i, 1, scale, PSD_DTYPE_F32);
    const __m128 k = _mm_set1_ps(scale);
    const __m128i exp = _mm_set1_epi32((int)PSD_EXP_MASK), one = _mm_set1_epi32(1), half = _mm_set1_epi32(0x7fff);
    __m128i acc = _mm_setzero_si128();
    for (; i + 8 <= n; i += 8) {
        __m128i a = _mm_castps_si128(_mm_mul_ps(_mm_loadu_ps(src + i), k));
        __m128i b = _mm_castps_si128(_mm_mul_ps(_mm_loadu_ps(src + i + 4), k));
        __m128i ra = _mm_add_epi32(_mm_add_epi32(a, half), _mm_and_si128(_mm_srli_epi32(a, 16), one));
        __m128i rb = _mm_add_epi32(_mm_add_epi32(b, half), _mm_and_si128(_mm_srli_epi32(b, 16), one));
        __m128i bad_a = _mm_or_si128(_mm_cmpeq_epi32(_mm_and_si128(a, exp), exp),
                                     _mm_cmpeq_epi32(_mm_and_si128(ra, exp), exp));
        __m128i bad_b = _mm_or_si128(_mm_cmpeq_epi32(_mm_and_si128(b, exp), exp),
                                     _mm_cmpeq_epi32(_mm_and_si128(rb, exp), exp));
        acc = _mm_or_si128(acc, _mm_or_si128(bad_a, bad_b));
        __m128i packed = _mm_packs_epi32(_mm_srai_epi32(ra, 16), _mm_srai_epi32(rb, 16));
        if (stream)
            _mm_stream_si128((__m128i *)(dst + i), packed);
        else
            _mm_store_si128((__m128i *)(dst + i), packed);
    }
    bad |= (uint32_t)_mm_movemask_epi8(acc) != 0;
    return bad | copy_check_bf16(dst + i, src + i, n - i, scale, PSD_DTYPE_F32);
}
#endif

/* dst = src (n doubles), checking finiteness; nonzero if any is inf or nan. */
static uint32_t copy_check_f64(double *restrict dst, const double *restrict src, uint64_t n) {
    uint32_t bad = 0;
    for (uint64_t i = 0; i < n; i++) {
        uint64_t b;
        memcpy(&b, &src[i], sizeof b);
        bad |= (b & UINT64_C(0x7ff0000000000000)) == UINT64_C(0x7ff0000000000000);
        dst[i] = src[i];
    }
    return bad;
}

/* The entry at the tail, if the slot is this learner's and the ring has room. */
static int tail_entry(struct psd_map *m, uint32_t slot, struct psd_entry **e, uint64_t *tail) {
    struct psd_slot *s = psd_slot_at(m, slot);
    uint64_t token = held_token(m, slot);
    /* Not this mapping's claim, or taken back and handed on: never write into another's ring.
     * (A push racing the hand-over carries the old token; the update loop ignores it.) */
    if (!token || PSD_LOAD_RLX(&s->claims) != token || PSD_LOAD_RLX(&s->state) != PSD_SLOT_ACTIVE)
        return PSD_ESLOT;
    *tail = PSD_LOAD_RLX(&s->tail); /* only this process writes it */
    /* Pairs with the store-release of head in the update loop: the entry at
     * `tail` is no longer being read. */
    if (*tail - PSD_LOAD_ACQ(&s->head) >= m->g.ring_k)
        return PSD_ESTATE; /* caller must psd_wait_space() first */
    *e = psd_entry_at(m, slot, *tail);
    return 0;
}

/* Fill in the entry's metadata and move the tail past it. */
static void publish(struct psd_map *m, uint32_t slot, struct psd_entry *e, uint64_t tail, uint64_t clock,
                    uint32_t batch, double loss, uint32_t flags) {
    struct psd_header *h = psd_hdr(m);
    struct psd_slot *s = psd_slot_at(m, slot);
    e->seq = tail;
    e->clock = clock;
    e->batch_size = batch;
    e->flags = flags;
    e->loss = loss;
    e->claim = held_token(m, slot);
    e->applied_clock = 0;
    e->outcome = PSD_OUTCOME_PENDING;
    /* seq_cst store (a release, pairs with the load-acquire of tail in the
     * update loop) so that the load of `sleeping` below cannot move before it:
     * with the loop's store of `sleeping` and load of tails, a Dekker pair. */
    atomic_store(&s->tail, tail + 1);
    PSD_ADD_RLX(&s->lease_beat, 1); /* a push renews the lease (psd_reap reads it relaxed) */
    if (atomic_load(&h->sleeping))
        psd_cond_broadcast(&h->doorbell);
    if (h->sync_mode == PSD_SYNC_SSP)
        psd_cond_broadcast_if_waiters(&h->sync_cond); /* a learner waiting for us may go on */
}

/* Copy the buffer deltas (if any) into the entry; the entry flags they add. */
static uint32_t put_buffers(const struct psd_map *m, struct psd_entry *e, const double *bufdelta) {
    if (!bufdelta || !m->g.n_buffers)
        return 0;
    return PSD_ENTRY_BUFFERS | (copy_check_f64(psd_entry_bufdelta(m, e), bufdelta, m->g.n_buffers) ? PSD_ENTRY_NONFINITE : 0);
}

int psd_push(struct psd_map *m, uint32_t slot, uint64_t clock, uint32_t batch, double loss, float scale,
             const double *bufdelta) {
    struct psd_entry *e;
    uint64_t tail;
    int rc = tail_entry(m, slot, &e, &tail);
    if (rc)
        return rc;
    bool finite = scale_and_check(psd_entry_grad(e), m->g.n_train, scale);
    memset(psd_entry_pieces(m, e), PSD_PIECE_DENSE, m->g.n_pieces);
    uint32_t flags = put_buffers(m, e, bufdelta) | (finite ? 0 : PSD_ENTRY_NONFINITE);
    publish(m, slot, e, tail, clock, batch, loss, flags);
    return 0;
}

/* A sparse gradient's rows must name rows of its tensor. */
static bool sparse_src_ok(const struct psd_src *p) {
    if (p->row_len == 0 || p->len % p->row_len || p->nnz > p->len / p->row_len || !p->rows)
        return false;
    uint64_t rows = p->len / p->row_len;
    for (uint64_t k = 0; k < p->nnz; k++)
        if (p->rows[k] < 0 || (uint64_t)p->rows[k] >= rows)
            return false;
    return true;
}

/* Store a sparse gradient in its tensor's span: as rows (count, indices,
 * values) when they take less room, else scattered densely. Returns the
 * piece kind, and ORs a non-finite value into *bad. */
static uint8_t put_sparse(float *span, const struct psd_src *p, float scale, uint32_t dtype, uint32_t *bad) {
    uint64_t nnz = p->nnz, rl = p->row_len;
    const uint8_t *vals = p->data;
    if (8 + 8 * nnz + 4 * nnz * rl <= 4 * p->len) {
        uint8_t *b = (uint8_t *)span;
        memcpy(b, &nnz, sizeof nnz);
        memcpy(b + 8, p->rows, 8 * nnz);
        *bad |= copy_check((float *)(b + 8 + 8 * nnz), vals, nnz * rl, scale, dtype);
        return PSD_PIECE_SPARSE;
    }
    memset(span, 0, p->len * sizeof(float));
    float row[256];
    for (uint64_t k = 0; k < nnz; k++) {
        float *dst = span + (uint64_t)p->rows[k] * rl;
        for (uint64_t j = 0; j < rl; j += 256) {
            uint64_t n = rl - j < 256 ? rl - j : 256;
            *bad |= copy_check(row, vals + (k * rl + j) * dtype_size(dtype), n, scale, dtype);
            for (uint64_t i = 0; i < n; i++)
                dst[j + i] += row[i]; /* rows may repeat: they add up */
        }
    }
    return PSD_PIECE_DENSE;
}

int psd_push_from(struct psd_map *m, uint32_t slot, uint64_t clock, uint32_t batch, double loss, float scale,
                  const struct psd_src *src, uint32_t count, uint32_t dtype, uint32_t store, const double *bufdelta) {
    if (count != m->g.n_pieces || dtype > PSD_DTYPE_F16 || (store != PSD_DTYPE_F32 && store != PSD_DTYPE_BF16))
        return EINVAL;
    uint64_t total = 0;
    for (uint32_t k = 0; k < count; k++) {
        if (src[k].len > m->g.n_train - total)
            return EINVAL; /* more than the model (checked piece by piece: a sum could wrap) */
        if (src[k].data && src[k].rows && !sparse_src_ok(&src[k]))
            return EINVAL;
        total += src[k].len;
    }
    if (total != m->g.n_train)
        return EINVAL;
    struct psd_entry *e;
    uint64_t tail;
    int rc = tail_entry(m, slot, &e, &tail);
    if (rc)
        return rc;
    float *dst = psd_entry_grad(e);
    uint8_t *map = psd_entry_pieces(m, e);
    uint32_t bad = 0;
#ifdef PSD_HAVE_STREAM
    bool stream = dtype == PSD_DTYPE_F32 && store == PSD_DTYPE_F32 && total * sizeof(float) >= PSD_STREAM_BYTES;
    bool stream_bf16 = dtype == PSD_DTYPE_F32 && store == PSD_DTYPE_BF16 && total * 2 >= PSD_STREAM_BYTES;
#endif
    for (uint32_t k = 0; k < count; dst += src[k].len, k++) {
        if (!src[k].data) {
            map[k] = PSD_PIECE_ABSENT;
        } else if (src[k].rows) {
            map[k] = put_sparse(dst, &src[k], scale, dtype, &bad);
        } else if (store == PSD_DTYPE_BF16) {
            map[k] = PSD_PIECE_DENSE_BF16;
#ifdef PSD_HAVE_STREAM
            if (dtype == PSD_DTYPE_F32) {
                bad |= copy_check_bf16_sse2((uint16_t *)dst, src[k].data, src[k].len, scale, stream_bf16);
                continue;
            }
#endif
            bad |= copy_check_bf16((uint16_t *)dst, src[k].data, src[k].len, scale, dtype);
        } else {
            map[k] = PSD_PIECE_DENSE;
#ifdef PSD_HAVE_STREAM
            if (stream) {
                bad |= copy_check_stream(dst, src[k].data, src[k].len, scale);
                continue;
            }
#endif
            bad |= copy_check(dst, src[k].data, src[k].len, scale, dtype);
        }
    }
#ifdef PSD_HAVE_STREAM
    if (stream || stream_bf16)
        _mm_sfence(); /* streaming stores are weakly ordered: complete them before the tail moves */
#endif
    uint32_t flags = put_buffers(m, e, bufdelta) | (bad ? PSD_ENTRY_NONFINITE : 0);
    publish(m, slot, e, tail, clock, batch, loss, flags);
    return 0;
}

static int server_check(struct psd_map *m) {
    /* A dead server is noticed within one wait slice, not at the deadline. */
    return psd_server_alive(m, 0) ? 0 : PSD_ESERVER;
}

/* Wait until `ready(m, slot, arg)` holds, sleeping on `c` in slices of at most
 * `slice_ns`, rechecking between them that the server lives and the slot is
 * still this claim's. */
typedef bool (*ready_fn)(struct psd_map *, uint32_t, uint64_t);

static int wait_until(struct psd_map *m, uint32_t slot, uint64_t claim, struct psd_cond *c, uint64_t slice_ns,
                      uint64_t timeout_ns, ready_fn ready, uint64_t arg) {
    struct psd_slot *s = psd_slot_at(m, slot);
    uint64_t deadline = psd_now_ns() + timeout_ns;
    for (;;) {
        uint32_t seen = psd_cond_prepare(c);
        if (ready(m, slot, arg)) {
            psd_cond_done(c);
            return 0;
        }
        int rc = PSD_LOAD_RLX(&s->claims) == claim ? server_check(m) : PSD_ESLOT;
        uint64_t now = psd_now_ns();
        if (rc == 0 && now >= deadline)
            rc = PSD_ETIMEOUT;
        if (rc) {
            psd_cond_done(c);
            return rc;
        }
        uint64_t left = deadline - now;
        rc = psd_cond_wait(c, seen, left < slice_ns ? left : slice_ns);
        psd_cond_done(c);
        if (rc == EINTR)
            return EINTR;
    }
}

static bool has_space(struct psd_map *m, uint32_t slot, uint64_t claim) {
    (void)claim;
    struct psd_slot *s = psd_slot_at(m, slot);
    /* Pairs with the store-release of head in the update loop. */
    return PSD_LOAD_RLX(&s->tail) - PSD_LOAD_ACQ(&s->head) < m->g.ring_k;
}

static bool is_drained(struct psd_map *m, uint32_t slot, uint64_t claim) {
    (void)claim;
    struct psd_slot *s = psd_slot_at(m, slot);
    return PSD_LOAD_RLX(&s->tail) == PSD_LOAD_ACQ(&s->head);
}

static bool is_freed(struct psd_map *m, uint32_t slot, uint64_t claim) {
    struct psd_slot *s = psd_slot_at(m, slot);
    /* Pairs with the store-release of FREE in free_slot (update.c). */
    return PSD_LOAD_ACQ(&s->state) == PSD_SLOT_FREE || PSD_LOAD_RLX(&s->claims) != claim;
}

static int wait_slot(struct psd_map *m, uint32_t slot, uint64_t claim, uint64_t timeout_ns, ready_fn ready) {
    return wait_until(m, slot, claim, &psd_slot_at(m, slot)->not_full, PSD_WAIT_SLICE_NS, timeout_ns, ready,
                      claim);
}

int psd_wait_space(struct psd_map *m, uint32_t slot, uint64_t claim, uint64_t timeout_ns) {
    struct psd_slot *s = psd_slot_at(m, slot);
    if (!has_space(m, slot, claim))
        PSD_ADD_RLX(&s->full_waits, 1);
    return wait_slot(m, slot, claim, timeout_ns, has_space);
}

int psd_wait_drained(struct psd_map *m, uint32_t slot, uint64_t claim, uint64_t timeout_ns) {
    return wait_slot(m, slot, claim, timeout_ns, is_drained);
}

int psd_wait_freed(struct psd_map *m, uint32_t slot, uint64_t claim, uint64_t timeout_ns) {
    return wait_slot(m, slot, claim, timeout_ns, is_freed);
}

void psd_ssp_clocks(struct psd_map *m, uint32_t slot, bool strict, uint64_t *mine, uint64_t *slowest) {
    struct psd_header *h = psd_hdr(m);
    struct psd_slot *me = psd_slot_at(m, slot);
    *mine = PSD_LOAD_RLX(&me->ssp_base) + PSD_LOAD_RLX(&me->tail);
    *slowest = UINT64_MAX;
    for (uint32_t i = 0; i < m->g.n_slots; i++) {
        if (i == slot)
            continue;
        struct psd_slot *s = psd_slot_at(m, i);
        /* Pairs with the store-release of state in claim: base is set. */
        if (PSD_LOAD_ACQ(&s->state) != PSD_SLOT_ACTIVE)
            continue;
        uint64_t c = PSD_LOAD_RLX(&s->ssp_base) + PSD_LOAD_ACQ(&s->tail);
        /* A dead learner leaves the minimum at once, without waiting for the reaper.
         * Unless strict, only one that holds us back costs the liveness check (a /proc read). */
        if (c < *slowest && ((!strict && c + h->sync_param >= *mine) || psd_slot_owner_alive(h, s)))
            *slowest = c;
    }
}

/* The learner that pushed `mine` gradients may compute its next one once the
 * slowest live learner pushed at least mine - S: so while computing it is at
 * most S pushes ahead, and at most S + 1 right after its push. */
static bool ssp_may_go_on(struct psd_map *m, uint32_t slot) {
    uint64_t mine, slowest;
    psd_ssp_clocks(m, slot, false, &mine, &slowest);
    return slowest == UINT64_MAX || mine <= slowest + psd_hdr(m)->sync_param;
}

/* Sync waits sleep on the header's sync_cond in short slices: a peer that dies
 * signals nothing, so liveness is rechecked often. */
static int wait_sync(struct psd_map *m, uint32_t slot, uint64_t claim, uint64_t timeout_ns, ready_fn ready,
                     uint64_t arg) {
    return wait_until(m, slot, claim, &psd_hdr(m)->sync_cond, PSD_WAIT_SLICE_NS / 5, timeout_ns, ready, arg);
}

static bool ssp_ready(struct psd_map *m, uint32_t slot, uint64_t arg) {
    (void)arg;
    return ssp_may_go_on(m, slot);
}

static bool round_done(struct psd_map *m, uint32_t slot, uint64_t rounds) {
    (void)slot;
    /* Pairs with the store of rounds in finish_round (update.c). */
    return PSD_LOAD_ACQ(&psd_hdr(m)->rounds) > rounds;
}

int psd_wait_ssp(struct psd_map *m, uint32_t slot, uint64_t claim, uint64_t timeout_ns) {
    if (ssp_may_go_on(m, slot))
        return 0;
    return wait_sync(m, slot, claim, timeout_ns, ssp_ready, 0);
}

int psd_wait_round(struct psd_map *m, uint32_t slot, uint64_t claim, uint64_t rounds, uint64_t timeout_ns) {
    return wait_sync(m, slot, claim, timeout_ns, round_done, rounds);
}

/* Why an ACTIVE slot's owner is gone (enum psd_reap_reason), or PSD_REAP_NONE. /proc first
 * where it can tell; else the lease: the beat must have moved within lease_ns of this
 * (the reaper's) clock. The reaper's view of the lease is kept in the slot, so a server
 * that takes over goes on from it. */
static uint32_t owner_gone(const struct psd_header *h, struct psd_slot *s, uint64_t now, uint64_t lease_ns) {
    uint64_t claim = PSD_LOAD_RLX(&s->claims), beat = PSD_LOAD_RLX(&s->lease_beat);
    if (PSD_LOAD_RLX(&s->lease_claim) != claim || PSD_LOAD_RLX(&s->lease_seen) != beat ||
        PSD_LOAD_RLX(&s->lease_seen_ns) == 0) {
        PSD_STORE_RLX(&s->lease_claim, claim);
        PSD_STORE_RLX(&s->lease_seen, beat);
        PSD_STORE_RLX(&s->lease_seen_ns, now);
    }
    enum psd_live live = psd_slot_liveness(h, s);
    PSD_STORE_RLX(&s->liveness, live == PSD_LIVE_UNKNOWN ? PSD_LIVE_BY_LEASE : PSD_LIVE_BY_PROC);
    if (live == PSD_LIVE_NO)
        return PSD_REAP_EXITED;
    if (live == PSD_LIVE_YES)
        return PSD_REAP_NONE;
    uint64_t seen = PSD_LOAD_RLX(&s->lease_seen_ns);
    return now > seen && now - seen >= lease_ns ? PSD_REAP_LEASE : PSD_REAP_NONE;
}

int psd_reap(struct psd_map *m, int32_t *pids, uint32_t max, uint32_t *n) {
    struct psd_header *h = psd_hdr(m);
    *n = 0;
    if (PSD_LOAD_ACQ(&h->state) != PSD_ARENA_READY)
        return 0;
    uint64_t now = psd_now_ns(), lease_ns = psd_lease_ns(h);
    for (uint32_t i = 0; i < m->g.n_slots; i++) {
        struct psd_slot *s = psd_slot_at(m, i);
        if (PSD_LOAD_ACQ(&s->state) != PSD_SLOT_ACTIVE || owner_gone(h, s, now, lease_ns) == PSD_REAP_NONE)
            continue;
        int rc = lock_slot(m, s);
        if (rc)
            return rc;
        uint32_t why;
        if (PSD_LOAD_ACQ(&s->state) == PSD_SLOT_ACTIVE && (why = owner_gone(h, s, now, lease_ns)) != PSD_REAP_NONE) {
            /* Everything it fully pushed is still applied; then the loop frees it. */
            PSD_STORE_RLX(&s->reap_reason, why);
            PSD_STORE_REL(&s->state, PSD_SLOT_DRAINING);
            if (*n < max)
                pids[(*n)++] = PSD_LOAD_RLX(&s->pid);
        }
        psd_mutex_unlock(&s->mutex);
    }
    if (*n) {
        if (atomic_load(&h->sleeping))
            psd_cond_broadcast(&h->doorbell);
        psd_cond_broadcast_if_waiters(&h->sync_cond);
    }
    return 0;
}

bool psd_server_alive(struct psd_map *m, uint64_t stale_ns) {
    struct psd_header *h = psd_hdr(m);
    if (PSD_LOAD_ACQ(&h->state) == PSD_ARENA_STOPPED)
        return false;
    enum psd_live live = psd_liveness(h, atomic_load(&h->server_pid), h->server_start_time, h->server_pid_ns);
    if (live == PSD_LIVE_NO)
        return false;
    /* Where /proc cannot tell (another PID namespace), the heartbeat is all there is: a
     * running server beats at least every 100 ms, also while it sleeps or pauses. */
    if (live == PSD_LIVE_UNKNOWN && stale_ns == 0)
        stale_ns = psd_lease_ns(h);
    uint64_t hb = atomic_load(&h->heartbeat_ns), now = psd_now_ns();
    return stale_ns == 0 || hb == 0 || now <= hb || now - hb < stale_ns;
}
