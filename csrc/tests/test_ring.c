/* test_ring.c - C-level unit tests of the shared-memory ring (ts_ring.c, ts_export.c).
 *
 * Build (from the repository root):
 *   cc -std=c11 -Wall -Wextra -Werror -O1 -g -pthread -Icsrc csrc/tests/test_ring.c \
 *      $(ls csrc/ts_*.c | grep -v 'ts_module.c\|ts_py_') -o test_ring -lrt
 * Run:  ./test_ring [NAME]   runs the tests whose name contains NAME (all without it).
 * The last line is "N passed, M failed"; the exit status is non-zero if any failed. */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include "base/ts_clock.h"
#include "base/ts_copy.h"
#include "base/ts_error.h"
#include "ring/ts_export.h"
#include "base/ts_proc.h"
#include "ring/ts_ring.h"

#include "ts_check.h"

/* ---- fixtures and helpers ------------------------------------------------------ */

typedef struct fixture {
    ts_ring *prod;
    char name[64];
} fixture;

typedef struct consumer {
    ts_ring *ring; /* its own handle, bound to its table entry */
    uint32_t index;
    uint64_t token, start_seq;
} consumer;

static int g_segments;

/* ts_export_leaf of a host view or copy, with the options spelled out. */
static void *export_leaf(ts_lease *lease, uint32_t i, int versioned, uint32_t minor, int copy,
                         ts_err *err)
{
    ts_export_opts o = {.versioned = versioned, .minor = minor, .copy = copy, .stream = -1};
    return ts_export_leaf(lease, i, &o, err);
}

/* Create a ring with a fresh unique name; 0 on success. */
static int fx_create(fixture *fx, uint32_t slots, uint32_t max_leaves, uint64_t slot_bytes)
{
    ts_err err = {0};
    ts_geometry g = {slots, max_leaves, slot_bytes, 0};
    snprintf(fx->name, sizeof fx->name, "/tensorsocket-ctest-%d-%d", (int)getpid(), g_segments++);
    ts_ring_unlink_name(fx->name, NULL);
    return CHECK_ST(ts_ring_create(fx->name, &g, &fx->prod, &err), TS_OK) ? 0 : -1;
}

/* Drop the producer handle and remove the segment name. */
static void fx_destroy(fixture *fx)
{
    if (fx->prod != NULL) ts_ring_unref(fx->prod);
    fx->prod = NULL;
    if (fx->name[0] != '\0') ts_ring_unlink_name(fx->name, NULL);
}

/* Reserve (and activate, if asked: 1, or 2 for an aligned join) a consumer of this process
 * with its own bound handle. */
static int consumer_add(fixture *fx, consumer *c, int activate)
{
    ts_err err = {0};
    pid_t pid = getpid();
    memset(c, 0, sizeof *c);
    int ok = CHECK_ST(ts_ring_reserve(fx->prod, pid, ts_proc_start_time(pid), 0, &c->index,
                                      &c->token, &err), TS_OK) &&
             (!activate || CHECK_ST(ts_ring_activate(fx->prod, c->index, activate == 2,
                                                     &c->start_seq, &err), TS_OK)) &&
             CHECK_ST(ts_ring_open(fx->name, &c->ring, &err), TS_OK) &&
             CHECK_ST(ts_ring_bind_consumer(c->ring, c->index, c->token, &err), TS_OK);
    return ok ? 0 : -1;
}

/* Drop the consumer's own ring handle (if it has one). */
static void consumer_drop(consumer *c)
{
    if (c->ring != NULL) ts_ring_unref(c->ring);
    c->ring = NULL;
}

/* The seq of the entry slot k of r holds. */
static uint64_t seq_of(const ts_ring *r, uint32_t k) { return ts_ring_slot(r, k)->seq; }
/* The state of consumer table entry i of r. */
static uint32_t state_of(const ts_ring *r, uint32_t i) { return r->hdr->consumers[i].state; }
/* How many entries the producer of fx has published. */
static uint64_t published(const fixture *fx) { return fx->prod->hdr->published; }
/* Why consumer i of r stopped receiving (TS_REASON_*). */
static uint32_t reason_of(const ts_ring *r, uint32_t i) { return r->hdr->consumers[i].reason; }
/* The cursor of consumer i of r (the next seq it reads, | TS_CURSOR_DETACHED). */
static uint64_t cursor_of(const ts_ring *r, uint32_t i) { return r->hdr->consumers[i].cursor; }

/* Publish an END_EPOCH marker (no leaves, no meta). */
static ts_status publish_end(ts_ring *prod, uint64_t epoch, uint64_t index, ts_err *err)
{
    return ts_ring_publish(prod, TS_ENTRY_END_EPOCH, epoch, index, NULL, 0, NULL, 0,
                           deadline_ms(1000), err);
}

/* Write "meta-<tag>" into buf (cap bytes); its length. */
static size_t meta_for(uint64_t tag, char *buf, size_t cap)
{
    return (size_t)snprintf(buf, cap, "meta-%llu", (unsigned long long)tag);
}

static const int64_t shape8[1] = {8}, stride4[1] = {4}, shape3[1] = {3}, stride1[1] = {1};

/* Publish the standard entry for tag: int32[8] = tag*100+j, uint8[3] = tag+j, "meta-<tag>". */
static ts_status publish_tagged(ts_ring *prod, uint64_t tag, uint64_t deadline, ts_err *err)
{
    int32_t a[8];
    uint8_t b[3];
    char meta[32];
    for (int j = 0; j < 8; j++) a[j] = (int32_t)(tag * 100 + (uint64_t)j);
    for (int j = 0; j < 3; j++) b[j] = (uint8_t)(tag + (uint64_t)j);
    ts_src_leaf leaves[2] = {{a, 1, shape8, stride4, 4, {kDLInt, 32, 1}},
                             {b, 1, shape3, stride1, 1, {kDLUInt, 8, 1}}};
    size_t m = meta_for(tag, meta, sizeof meta);
    return ts_ring_publish(prod, TS_ENTRY_BATCH, tag / 5, tag % 5, leaves, 2, meta, m, deadline,
                           err);
}
#define PUBLISH(tag) REQUIRE_OK(publish_tagged(fx.prod, (tag), deadline_ms(1000), &err))

/* 1 if slot k (read through handle r) holds the standard entry for tag; its seq is not
 * looked at (a hole published since in a kept slot changes only that). */
static int content_ok(const ts_ring *r, uint32_t k, uint64_t tag)
{
#define EXPECT(c)                                                                            \
    do {                                                                                     \
        if (!(c)) return printf("  entry %llu: %s is false\n", (unsigned long long)tag, #c), 0;\
    } while (0)
    const ts_slot *s = ts_ring_slot(r, k);
    const uint8_t *d = ts_ring_slot_data(r, k);
    const ts_leaf *l0 = &s->leaves[0], *l1 = &s->leaves[1];
    char meta[32];
    int32_t v[8];
    size_t m = meta_for(tag, meta, sizeof meta);
    EXPECT(d != NULL && s->kind == TS_ENTRY_BATCH && s->n_leaves == 2);
    EXPECT(s->epoch == tag / 5 && s->index == tag % 5);
    EXPECT(l0->offset == 0 && l0->nbytes == 32 && l0->ndim == 1 && l0->shape[0] == 8);
    EXPECT(l0->dtype.code == kDLInt && l0->dtype.bits == 32 && l0->dtype.lanes == 1);
    EXPECT(l1->offset == TS_DATA_ALIGN && l1->nbytes == 3 && l1->ndim == 1 && l1->shape[0] == 3);
    EXPECT(l1->dtype.code == kDLUInt && l1->dtype.bits == 8);
    EXPECT(s->meta_offset == 72 && s->meta_bytes == m && s->used_bytes == 72 + m);
    memcpy(v, d + l0->offset, sizeof v);
    for (int j = 0; j < 8; j++) EXPECT(v[j] == (int32_t)(tag * 100 + (uint64_t)j));
    for (int j = 0; j < 3; j++) EXPECT(d[l1->offset + (uint64_t)j] == (uint8_t)(tag + (unsigned)j));
    EXPECT(memcmp(d + s->meta_offset, meta, m) == 0);
    return 1;
#undef EXPECT
}

/* 1 if the acquired entry (read through handle r) is the standard entry for tag. */
static int entry_ok(const ts_ring *r, const ts_acquired *a, uint64_t tag)
{
    if (ts_ring_slot(r, a->slot)->seq != a->seq)
        return printf("  entry %llu: its slot's seq is not %llu\n", (unsigned long long)tag,
                      (unsigned long long)a->seq), 0;
    return content_ok(r, a->slot, tag);
}

/* Acquire c's next entry, expect seq `want` with the standard content for tag; release it
 * if asked. */
static int take_(consumer *c, uint64_t want, uint64_t tag, int release, ts_acquired *out,
                 int line)
{
    ts_err err = {0};
    ts_acquired a = {0};
    int ok = CHECK_ST(ts_ring_acquire(c->ring, deadline_ms(1000), &a, &err), TS_OK) &&
             CHECK_EQ(a.seq, want) && CHECK(entry_ok(c->ring, &a, tag));
    if (!ok) printf("    (in TAKE at line %d)\n", line);
    if (ok && release) ts_ring_release(c->ring, a.slot, c->index, c->ring->incarnation);
    *out = a;
    return ok;
}
/* Needs `ts_acquired a` in scope; goes to out on failure. */
#define TAKE(c, want, release) REQUIRE(take_(&(c), (want), (want), (release), &a, __LINE__))
/* TAKE of an entry published with another tag than its seq (holes came before it). */
#define TAKE_TAG(c, want, tag, release)                                                      \
    REQUIRE(take_(&(c), (want), (tag), (release), &a, __LINE__))

/* Work for a helper thread; each runner reads the fields it needs. */
typedef struct job {
    fixture *fx;
    consumer *c;
    uint64_t n, done, t_end;
    ts_status st;
    ts_err err;
} job;

/* Publish the standard entry for tag n, waiting up to 5 s. */
static void *pub_run(void *p)
{
    job *j = p;
    j->st = publish_tagged(j->fx->prod, j->n, deadline_ms(5000), &j->err);
    j->t_end = ts_now_ns();
    return NULL;
}

/* Wait for n active consumers. */
static void *wait_consumers_run(void *p)
{
    job *j = p;
    j->st = ts_ring_wait_consumers(j->fx->prod, (uint32_t)j->n, deadline_ms(5000), &j->err);
    j->t_end = ts_now_ns();
    return NULL;
}

/* Acquire and release until acquire fails; count entries in done. */
static void *drain_run(void *p)
{
    job *j = p;
    ts_acquired a;
    while ((j->st = ts_ring_acquire(j->c->ring, deadline_ms(5000), &a, &j->err)) == TS_OK) {
        j->done++;
        ts_ring_release(j->c->ring, a.slot, j->c->index, (j->c->ring)->incarnation);
    }
    j->t_end = ts_now_ns();
    return NULL;
}

/* ---- tests ------------------------------------------------------------------------- */

/* 20 entries through 4 slots: seq, slot = seq % 4, header fields, data and meta all right. */
static void test_wrap_around(void)
{
    fixture fx = {0};
    consumer c = {0};
    ts_err err = {0};
    ts_acquired a;
    REQUIRE(fx_create(&fx, 4, 4, 4096) == 0);
    REQUIRE(consumer_add(&fx, &c, 1) == 0);
    CHECK_EQ(c.start_seq, 0);
    for (uint64_t base = 0; base < 20; base += 3) { /* batches of 3: wraps at odd places */
        uint64_t n = base + 3 <= 20 ? 3 : 20 - base;
        for (uint64_t k = 0; k < n; k++) PUBLISH(base + k);
        for (uint64_t seq = base; seq < base + n; seq++) {
            TAKE(c, seq, 0);
            CHECK_EQ(a.slot, seq % 4);
            CHECK_EQ(a.kind, TS_ENTRY_BATCH);
            CHECK_EQ(a.epoch, seq / 5);
            CHECK_EQ(a.index, seq % 5);
            CHECK_EQ(readers_of(fx.prod, a.slot), 1ULL << c.index);
            ts_ring_release(c.ring, a.slot, c.index, c.ring->incarnation);
            CHECK_EQ(readers_of(fx.prod, a.slot), 0);
        }
    }
    CHECK_EQ(published(&fx), 20);
    for (uint32_t k = 0; k < 4; k++) CHECK_EQ(seq_of(fx.prod, k), 16 + k);
    CHECK_EQ(fx.prod->hdr->consumers[c.index].cursor, 20);
    CHECK_EQ(fx.prod->hdr->consumers[c.index].delivered, 20);
out:
    consumer_drop(&c);
    fx_destroy(&fx);
}

/* A slot is refilled only after every reader released it; a timed-out publish leaves it intact. */
static void test_slot_reuse(void)
{
    fixture fx = {0};
    consumer A = {0}, B = {0};
    ts_err err = {0};
    ts_acquired a;
    job pj = {.fx = &fx, .n = 4};
    pthread_t th;
    REQUIRE(fx_create(&fx, 4, 2, 4096) == 0);
    REQUIRE(consumer_add(&fx, &A, 1) == 0 && consumer_add(&fx, &B, 1) == 0);
    for (uint64_t t = 0; t < 4; t++) PUBLISH(t);
    for (uint64_t i = 0; i < 4; i++) TAKE(A, i, 1);
    for (uint64_t i = 0; i < 4; i++) TAKE(B, i, i != 0); /* B keeps slot 0 */
    CHECK_EQ(readers_of(fx.prod, 0), 1ULL << B.index);
    uint64_t dl = deadline_ms(50);
    CHECK_ST(publish_tagged(fx.prod, 4, dl, &err), TS_E_TIMEOUT);
    CHECK(ts_now_ns() >= dl);
    CHECK_ST(publish_tagged(fx.prod, 4, 0, &err), TS_E_TIMEOUT); /* past deadline: at once */
    CHECK_EQ(published(&fx), 4);
    CHECK_EQ(seq_of(fx.prod, 0), 0);
    a.slot = 0, a.seq = 0;
    CHECK(entry_ok(B.ring, &a, 0)); /* slot 0 still holds entry 0, untouched */

    /* A publisher blocked on slot 0 proceeds once B lets go. */
    REQUIRE(pthread_create(&th, NULL, pub_run, &pj) == 0);
    sleep_ms(30);
    CHECK_EQ(published(&fx), 4);
    ts_ring_release(B.ring, 0, B.index, B.ring->incarnation);
    pthread_join(th, NULL);
    CHECK_EQ(pj.st, TS_OK);
    CHECK_EQ(published(&fx), 5);
    CHECK_EQ(seq_of(fx.prod, 0), 4);
    CHECK_EQ(readers_of(fx.prod, 0), (1ULL << A.index) | (1ULL << B.index));
    TAKE(A, 4, 1);
    CHECK_EQ(a.slot, 0);
    TAKE(B, 4, 1);
    CHECK_EQ(readers_of(fx.prod, 0), 0);
out:
    consumer_drop(&A);
    consumer_drop(&B);
    fx_destroy(&fx);
}

/* readers bitmaps follow the active mask; late joiners, retire and evict update them correctly. */
static void test_bitmaps(void)
{
    fixture fx = {0};
    consumer A = {0}, B = {0}, C = {0}, D = {0}, E = {0};
    ts_err err = {0};
    ts_acquired a;
    REQUIRE(fx_create(&fx, 4, 2, 4096) == 0);
    ts_header *h = fx.prod->hdr;
    REQUIRE(consumer_add(&fx, &A, 1) == 0 && consumer_add(&fx, &B, 1) == 0);
    CHECK(A.index == 0 && B.index == 1);
    CHECK_EQ(h->active_mask, 0x3);
    PUBLISH(0);
    CHECK_EQ(readers_of(fx.prod, 0), 0x3);

    /* C joins after entry 0: not in slot 0's bitmap, starts at seq 1. */
    REQUIRE(consumer_add(&fx, &C, 1) == 0);
    CHECK_EQ(C.index, 2);
    CHECK_EQ(C.start_seq, 1);
    CHECK_EQ(h->active_mask, 0x7);
    CHECK_EQ(readers_of(fx.prod, 0), 0x3);
    PUBLISH(1);
    CHECK_EQ(readers_of(fx.prod, 1), 0x7);
    TAKE(C, 1, 1);
    CHECK_EQ(readers_of(fx.prod, 1), 0x3);
    TAKE(A, 0, 1);
    TAKE(A, 1, 1);
    TAKE(B, 0, 0); /* B holds entry 0 */
    PUBLISH(2);
    CHECK_EQ(readers_of(fx.prod, 2), 0x7);

    /* Retire B: unread entries 1 and 2 lose its bit, the held entry 0 keeps it. */
    ts_ring_retire(fx.prod, B.index);
    CHECK_EQ(h->active_mask, 0x5);
    CHECK_EQ(readers_of(fx.prod, 0), 0x2);
    CHECK_EQ(readers_of(fx.prod, 1), 0x0);
    CHECK_EQ(readers_of(fx.prod, 2), 0x5);
    CHECK_EQ(state_of(fx.prod, B.index), TS_CONSUMER_LEAVING);
    CHECK_ST(ts_ring_acquire(B.ring, deadline_ms(1000), &a, &err), TS_E_DETACHED);
    REQUIRE(consumer_add(&fx, &D, 0) == 0); /* index 1 still carries bits: not handed out */
    CHECK_EQ(D.index, 3);
    CHECK_EQ(state_of(fx.prod, D.index), TS_CONSUMER_PENDING);
    ts_ring_release(B.ring, 0, B.index, B.ring->incarnation);
    CHECK_EQ(readers_of(fx.prod, 0), 0);
    /* The entry is free now (lazily: its state may read LEAVING until reserve reuses it). */
    CHECK(state_of(fx.prod, 1) == TS_CONSUMER_LEAVING || state_of(fx.prod, 1) == TS_CONSUMER_FREE);
    ts_ring_retire(fx.prod, D.index); /* a pending consumer retires straight to FREE */
    CHECK_EQ(state_of(fx.prod, D.index), TS_CONSUMER_FREE);
    REQUIRE(consumer_add(&fx, &E, 0) == 0);
    CHECK_EQ(E.index, 1); /* B's entry is reused */
    CHECK(E.token != B.token);
    CHECK_EQ(state_of(fx.prod, 1), TS_CONSUMER_PENDING);
    CHECK_ST(ts_ring_acquire(B.ring, deadline_ms(1000), &a, &err), TS_E_DETACHED);
    CHECK_EQ(h->active_mask, 0x5);

    /* A holds entry 2; C read and released it, so retiring C frees its entry at once. */
    TAKE(A, 2, 0);
    TAKE(C, 2, 1);
    ts_ring_retire(fx.prod, C.index);
    CHECK_EQ(state_of(fx.prod, C.index), TS_CONSUMER_FREE);
    CHECK_EQ(readers_of(fx.prod, 2), 0x1);
    /* Evict A: every bit goes, held or not. */
    PUBLISH(3);
    CHECK_EQ(readers_of(fx.prod, 3), 0x1);
    ts_ring_evict(fx.prod, A.index);
    for (uint32_t k = 0; k < 4; k++) CHECK_EQ(readers_of(fx.prod, k), 0);
    CHECK_EQ(h->active_mask, 0);
    CHECK_EQ(state_of(fx.prod, A.index), TS_CONSUMER_FREE);
    CHECK_ST(ts_ring_acquire(A.ring, deadline_ms(1000), &a, &err), TS_E_DETACHED);
out:
    consumer_drop(&A), consumer_drop(&B), consumer_drop(&C), consumer_drop(&D), consumer_drop(&E);
    fx_destroy(&fx);
}

/* Leases and DLPack views hold the slot until the last deleter runs; copies do not hold it. */
static void test_leases_dlpack(void)
{
    fixture fx = {0};
    consumer c = {0};
    ts_err err = {0};
    ts_acquired a;
    REQUIRE(fx_create(&fx, 2, 2, 4096) == 0);
    REQUIRE(consumer_add(&fx, &c, 1) == 0);
    uint64_t bit = 1ULL << c.index;
    PUBLISH(0);
    PUBLISH(1);

    /* Entry 0: copies (legacy and versioned). */
    TAKE(c, 0, 0);
    ts_lease *lease = ts_lease_new(c.ring, a.slot, a.seq);
    REQUIRE(lease != NULL);
    CHECK_EQ(c.ring->refs, 2);
    CHECK(ts_lease_leaf(lease, 1) != NULL && ts_lease_leaf(lease, 2) == NULL);
    CHECK(export_leaf(lease, 2, 1, 1, 0, &err) == NULL);
    CHECK_EQ(err.code, TS_E_INVALID);
    DLManagedTensorVersioned *vc = export_leaf(lease, 0, 1, 1, 1, &err);
    DLManagedTensor *lc = export_leaf(lease, 0, 0, 0, 1, &err);
    REQUIRE(vc != NULL && lc != NULL);
    CHECK_EQ(vc->flags, TS_DLPACK_FLAG_IS_COPIED);
    CHECK(vc->dl_tensor.data != ts_ring_slot_data(c.ring, a.slot));
    ts_lease_unref(lease, TS_USE_WHOLE); /* copies hold nothing: the slot is free at once */
    CHECK_EQ(readers_of(fx.prod, a.slot), 0);
    CHECK_EQ(c.ring->refs, 1);
    CHECK_EQ(((int32_t *)vc->dl_tensor.data)[3], 3);
    CHECK_EQ(((int32_t *)lc->dl_tensor.data)[7], 7);
    vc->deleter(vc);
    lc->deleter(lc);

    /* Entry 1: views, which keep the slot and the mapping alive. */
    TAKE(c, 1, 0);
    lease = ts_lease_new(c.ring, a.slot, a.seq);
    REQUIRE(lease != NULL);
    const ts_slot *s = ts_ring_slot(c.ring, a.slot);
    DLManagedTensor *lv = export_leaf(lease, 0, 0, 0, 0, &err);
    DLManagedTensorVersioned *vv = export_leaf(lease, 1, 1, 1, 0, &err);
    REQUIRE(lv != NULL && vv != NULL);
    DLTensor *t = &lv->dl_tensor;
    CHECK(t->data == ts_ring_slot_data(c.ring, a.slot) + s->leaves[0].offset);
    CHECK(t->device.device_type == kDLCPU && t->ndim == 1 && t->byte_offset == 0);
    CHECK(t->shape[0] == 8 && t->strides[0] == 1);
    CHECK(t->dtype.code == kDLInt && t->dtype.bits == 32 && t->dtype.lanes == 1);
    CHECK_EQ(((int32_t *)t->data)[5], 105);
    CHECK(vv->version.major == TS_DLPACK_MAJOR && vv->version.minor == 1);
    CHECK_EQ(vv->flags, 0); /* writable: a write makes the slot private (copy_on_write) */
    CHECK_EQ(vv->dl_tensor.shape[0], 3);
    CHECK_EQ(((uint8_t *)vv->dl_tensor.data)[2], 3);
    ts_lease_unref(lease, TS_USE_WHOLE); /* the view object goes; the exports still hold the slot */
    CHECK_EQ(readers_of(fx.prod, a.slot), bit);
    lv->deleter(lv);
    CHECK_EQ(readers_of(fx.prod, a.slot), bit);
    ts_ring_unref(c.ring); /* the owner goes too: the export keeps the mapping */
    c.ring = NULL;
    CHECK_EQ(((uint8_t *)vv->dl_tensor.data)[0], 1);
    vv->deleter(vv); /* last reference: slot released, handle freed */
    CHECK_EQ(readers_of(fx.prod, a.slot), 0);

    /* A producer-side export is writable (no READ_ONLY flag) and releases nothing. */
    lease = ts_lease_new(fx.prod, a.slot, a.seq);
    REQUIRE(lease != NULL);
    vv = export_leaf(lease, 0, 1, 0, 0, &err);
    if (CHECK(vv != NULL)) {
        CHECK_EQ(vv->flags, 0);
        ts_export_delete(vv, 1);
    }
    ts_lease_unref(lease, TS_USE_WHOLE);
    CHECK_EQ(fx.prod->refs, 1);
out:
    consumer_drop(&c);
    fx_destroy(&fx);
}

/* Blocking calls honour their deadlines; wait_consumers wakes when a consumer arrives. */
static void test_deadlines(void)
{
    fixture fx = {0};
    consumer A = {0}, B = {0};
    ts_err err = {0};
    ts_acquired a;
    job wj = {.fx = &fx, .n = 2};
    pthread_t th;
    REQUIRE(fx_create(&fx, 2, 2, 4096) == 0);
    REQUIRE(consumer_add(&fx, &A, 1) == 0);
    uint64_t dl = deadline_ms(150); /* longer than one 100 ms sleep slice */
    CHECK_ST(ts_ring_acquire(A.ring, dl, &a, &err), TS_E_TIMEOUT);
    uint64_t t = ts_now_ns();
    CHECK(t >= dl && t < dl + 200 * MS);
    dl = deadline_ms(100);
    CHECK_ST(ts_ring_wait_consumers(fx.prod, 2, dl, &err), TS_E_TIMEOUT);
    t = ts_now_ns();
    CHECK(t >= dl && t < dl + 200 * MS);
    CHECK_ST(ts_ring_wait_consumers(fx.prod, 1, deadline_ms(100), &err), TS_OK);
    CHECK_ST(ts_ring_wait_consumers(fx.prod, 0, 0, &err), TS_OK);
    CHECK(ts_now_ns() < dl + 200 * MS);

    REQUIRE(pthread_create(&th, NULL, wait_consumers_run, &wj) == 0);
    sleep_ms(30);
    uint64_t t_add = ts_now_ns();
    int added = consumer_add(&fx, &B, 1);
    pthread_join(th, NULL);
    CHECK_EQ(added, 0);
    CHECK_EQ(wj.st, TS_OK);
    CHECK(wj.t_end - t_add < 1000 * MS);
out:
    consumer_drop(&A);
    consumer_drop(&B);
    fx_destroy(&fx);
}

/* Strided sources (transposed, padded rows, negative stride, empty) land C-contiguous. */
static void test_strided_source(void)
{
    fixture fx = {0};
    consumer c = {0};
    ts_err err = {0};
    ts_acquired a;
    int32_t base[4][3], wide[2][5], rev[5], got[12];
    for (int i = 0; i < 12; i++) base[i / 3][i % 3] = i / 3 * 10 + i % 3;
    for (int i = 0; i < 10; i++) wide[i / 5][i % 5] = 100 + i / 5 * 10 + i % 5;
    for (int i = 0; i < 5; i++) rev[i] = 200 + i;
    static const int64_t sh_t[2] = {3, 4}, st_t[2] = {4, 12}; /* base transposed */
    static const int64_t sh_w[2] = {2, 3}, st_w[2] = {20, 4}; /* wide[:, :3] */
    static const int64_t sh_r[1] = {5}, st_r[1] = {-4};       /* rev[::-1] */
    static const int64_t sh_e[2] = {0, 5}, st_e[2] = {20, 4}; /* empty */
    DLDataType i32 = {kDLInt, 32, 1};
    ts_src_leaf leaves[4] = {{base, 2, sh_t, st_t, 4, i32}, {wide, 2, sh_w, st_w, 4, i32},
                             {&rev[4], 1, sh_r, st_r, 4, i32}, {rev, 2, sh_e, st_e, 4, i32}};
    REQUIRE(fx_create(&fx, 2, 4, 4096) == 0);
    REQUIRE(consumer_add(&fx, &c, 1) == 0);
    REQUIRE_OK(ts_ring_publish(fx.prod, TS_ENTRY_BATCH, 0, 0, leaves, 4, NULL, 0,
                               deadline_ms(1000), &err));
    REQUIRE_OK(ts_ring_acquire(c.ring, deadline_ms(1000), &a, &err));
    const ts_slot *s = ts_ring_slot(c.ring, a.slot);
    const uint8_t *d = ts_ring_slot_data(c.ring, a.slot);
    REQUIRE(s->n_leaves == 4 && s->meta_bytes == 0);
    const ts_leaf *l = &s->leaves[0];
    CHECK(l->ndim == 2 && l->shape[0] == 3 && l->shape[1] == 4 && l->nbytes == 48);
    memcpy(got, d + l->offset, 48);
    for (int i = 0; i < 12; i++) CHECK_EQ(got[i], base[i % 4][i / 4]);
    l = &s->leaves[1];
    CHECK(l->ndim == 2 && l->shape[0] == 2 && l->shape[1] == 3 && l->nbytes == 24);
    CHECK_EQ(l->offset % TS_DATA_ALIGN, 0);
    memcpy(got, d + l->offset, 24);
    for (int i = 0; i < 6; i++) CHECK_EQ(got[i], wide[i / 3][i % 3]);
    l = &s->leaves[2];
    CHECK(l->ndim == 1 && l->shape[0] == 5 && l->nbytes == 20);
    memcpy(got, d + l->offset, 20);
    for (int i = 0; i < 5; i++) CHECK_EQ(got[i], 204 - i);
    l = &s->leaves[3];
    CHECK(l->ndim == 2 && l->shape[0] == 0 && l->shape[1] == 5 && l->nbytes == 0);
    ts_ring_release(c.ring, a.slot, c.index, c.ring->incarnation);
out:
    consumer_drop(&c);
    fx_destroy(&fx);
}

/* Oversized batches fail with TS_E_TOO_BIG (bad ndim with INVALID) and publish nothing. */
static void test_too_big(void)
{
    fixture fx = {0};
    ts_err err = {0};
    static uint8_t buf[5000];
    static const int64_t sh5000[1] = {5000}, sh4096[1] = {4096}, sh4000[1] = {4000};
    static const int64_t zeros17[17] = {0};
    DLDataType u8 = {kDLUInt, 8, 1};
    ts_src_leaf big = {buf, 1, sh5000, stride1, 1, u8}, full = {buf, 1, sh4096, stride1, 1, u8};
    ts_src_leaf fits = {buf, 1, sh4000, stride1, 1, u8}, three[3] = {fits, fits, fits};
    ts_src_leaf deep = {buf, 17, zeros17, zeros17, 1, u8};
    char meta[96] = "m";
    REQUIRE(fx_create(&fx, 2, 2, 4096) == 0);
    CHECK_EQ(fx.prod->hdr->slot_bytes, 4096);
    CHECK_EQ(ts_ring_batch_bytes(&big, 1, 0), 5000);
    CHECK_EQ(ts_ring_batch_bytes(&fits, 1, 96), 4096);
#define PUB(leaves, n, meta, meta_bytes)                                                     \
    ts_ring_publish(fx.prod, TS_ENTRY_BATCH, 0, 0, leaves, n, meta, meta_bytes, 0, &err)
    CHECK_ST(PUB(&big, 1, NULL, 0), TS_E_TOO_BIG);
    CHECK_ST(PUB(&full, 1, meta, 1), TS_E_TOO_BIG);
    CHECK_ST(PUB(three, 3, NULL, 0), TS_E_TOO_BIG); /* more leaves than max_leaves */
    CHECK_ST(PUB(&deep, 1, NULL, 0), TS_E_INVALID);
    CHECK_EQ(published(&fx), 0);
    CHECK_EQ(seq_of(fx.prod, 0), TS_SEQ_NONE);
    CHECK_ST(PUB(&fits, 1, meta, 96), TS_OK); /* exactly slot_bytes */
#undef PUB
    CHECK_EQ(published(&fx), 1);
    CHECK_EQ(ts_ring_slot(fx.prod, 0)->used_bytes, 4096);
out:
    fx_destroy(&fx);
}

/* finish: published entries are still delivered, then acquire returns FINISHED, to sleepers too. */
static void test_finish(void)
{
    fixture fx = {0};
    consumer A = {0}, B = {0};
    ts_err err = {0};
    ts_acquired a;
    job dj = {.c = &B};
    pthread_t th;
    REQUIRE(fx_create(&fx, 4, 2, 4096) == 0);
    REQUIRE(consumer_add(&fx, &A, 1) == 0 && consumer_add(&fx, &B, 1) == 0);
    PUBLISH(0);
    PUBLISH(1);
    REQUIRE(pthread_create(&th, NULL, drain_run, &dj) == 0);
    sleep_ms(50); /* B reads both and sleeps in acquire */
    CHECK_ST(ts_ring_wait_drained(fx.prod, deadline_ms(30), &err), TS_E_TIMEOUT); /* A lags */
    uint64_t t = ts_now_ns();
    ts_ring_finish(fx.prod);
    pthread_join(th, NULL);
    CHECK_EQ(dj.done, 2);
    CHECK_EQ(dj.st, TS_E_FINISHED);
    CHECK(dj.t_end - t < 1000 * MS);
    CHECK_EQ(fx.prod->hdr->state, TS_RING_FINISHED);
    TAKE(A, 0, 1);
    TAKE(A, 1, 1);
    t = ts_now_ns();
    CHECK_ST(ts_ring_acquire(A.ring, deadline_ms(5000), &a, &err), TS_E_FINISHED);
    CHECK(ts_now_ns() - t < 1000 * MS);
    CHECK_ST(ts_ring_wait_drained(fx.prod, deadline_ms(1000), &err), TS_OK);
    char why[TS_FAILURE_BYTES];
    CHECK(ts_ring_failure(A.ring, why) == 0); /* a normal end carries no failure */
out:
    consumer_drop(&A);
    consumer_drop(&B);
    fx_destroy(&fx);
}

/* fail: like finish, and the consumers read why; a text too long is cut, terminated. */
static void test_fail(void)
{
    fixture fx = {0};
    consumer A = {0};
    ts_err err = {0};
    ts_acquired a;
    char why[TS_FAILURE_BYTES], longer[TS_FAILURE_BYTES + 100];
    REQUIRE(fx_create(&fx, 4, 2, 4096) == 0);
    REQUIRE(consumer_add(&fx, &A, 1) == 0);
    PUBLISH(0);
    CHECK(ts_ring_failure(A.ring, why) == 0); /* still running */
    ts_ring_fail(fx.prod, "ValueError: bad sample 3");
    TAKE(A, 0, 1); /* what was published is still delivered */
    CHECK_ST(ts_ring_acquire(A.ring, deadline_ms(1000), &a, &err), TS_E_FINISHED);
    CHECK(ts_ring_failure(A.ring, why) == 1 && strcmp(why, "ValueError: bad sample 3") == 0);
    memset(longer, 'x', sizeof longer - 1);
    longer[sizeof longer - 1] = '\0';
    ts_ring_fail(fx.prod, longer);
    CHECK(ts_ring_failure(A.ring, why) == 1 && strlen(why) == TS_FAILURE_BYTES - 1);
out:
    consumer_drop(&A);
    fx_destroy(&fx);
}

#define XT_COUNT 10000
#define XT_BUDGET_MS 10000

/* Publish XT_COUNT entries, then finish. */
static void *xt_producer(void *p)
{
    job *j = p;
    /* Normally ~20 ms; lost wake-ups would leave each side to its 100 ms sleep slices. */
    uint64_t too_slow = deadline_ms(XT_BUDGET_MS);
    for (j->done = 0; j->done < XT_COUNT; j->done++) {
        j->st = publish_tagged(j->fx->prod, j->done, deadline_ms(5000), &j->err);
        if (j->st != TS_OK) break;
        if (ts_now_ns() > too_slow) {
            j->st = ts_err_set(&j->err, TS_E_TIMEOUT, 0, "only %llu entries in %d ms: lost "
                               "wake-ups?", (unsigned long long)j->done + 1, XT_BUDGET_MS);
            break;
        }
    }
    ts_ring_finish(j->fx->prod); /* also lets the consumer stop early after a failure */
    return NULL;
}

/* Acquire, check and release XT_COUNT entries, then expect FINISHED. */
static void *xt_consumer(void *p)
{
    job *j = p;
    ts_acquired a;
    for (j->done = 0; j->done < XT_COUNT; j->done++) {
        j->st = ts_ring_acquire(j->c->ring, deadline_ms(5000), &a, &j->err);
        if (j->st != TS_OK) return NULL;
        if (a.seq != j->done || a.slot != j->done % 4 || !entry_ok(j->c->ring, &a, j->done)) {
            j->st = ts_err_set(&j->err, TS_E_INVALID, 0, "bad entry at %llu (seq %llu)",
                               (unsigned long long)j->done, (unsigned long long)a.seq);
            return NULL;
        }
        ts_ring_release(j->c->ring, a.slot, j->c->index, (j->c->ring)->incarnation);
    }
    j->st = ts_ring_acquire(j->c->ring, deadline_ms(5000), &a, &j->err);
    return NULL;
}

/* A producer thread and a consumer thread (separate handles) pass 10000 entries through 4 slots. */
static void test_cross_thread(void)
{
    fixture fx = {0};
    consumer c = {0};
    job pj = {.fx = &fx, .c = &c}, cj = {.fx = &fx, .c = &c};
    pthread_t tp, tc;
    REQUIRE(fx_create(&fx, 4, 2, 4096) == 0);
    REQUIRE(consumer_add(&fx, &c, 1) == 0);
    REQUIRE(pthread_create(&tc, NULL, xt_consumer, &cj) == 0);
    if (!CHECK(pthread_create(&tp, NULL, xt_producer, &pj) == 0)) {
        ts_ring_finish(fx.prod);
        pthread_join(tc, NULL);
        goto out;
    }
    pthread_join(tp, NULL);
    pthread_join(tc, NULL);
    if (!CHECK_EQ(pj.st, TS_OK)) printf("  producer: %s\n", pj.err.msg);
    if (!CHECK_EQ(cj.st, TS_E_FINISHED)) printf("  consumer: %s\n", cj.err.msg);
    CHECK_EQ(pj.done, XT_COUNT);
    CHECK_EQ(cj.done, XT_COUNT);
    CHECK_EQ(published(&fx), XT_COUNT);
    for (uint32_t k = 0; k < 4; k++) CHECK_EQ(readers_of(fx.prod, k), 0);
out:
    consumer_drop(&c);
    fx_destroy(&fx);
}

/* ts_proc_alive: this process is alive, a wrong start time or an exited child is not. */
static void test_proc_alive(void)
{
    pid_t me = getpid();
    uint64_t start = ts_proc_start_time(me);
    int fds[2], status = 0;
    char ch;
    CHECK(start != 0);
    CHECK_EQ(ts_proc_alive(me, start), 1);
    CHECK_EQ(ts_proc_alive(me, start + 1), 0);
    CHECK_EQ(ts_proc_alive(0, start), 0);
    REQUIRE(pipe(fds) == 0);
    fflush(stdout);
    pid_t child = fork();
    REQUIRE(child >= 0);
    if (child == 0) { /* wait for the parent to close the pipe, then exit */
        close(fds[1]);
        while (read(fds[0], &ch, 1) > 0) {}
        _exit(0);
    }
    close(fds[0]);
    uint64_t cstart = ts_proc_start_time(child);
    CHECK(cstart != 0);
    CHECK_EQ(ts_proc_alive(child, cstart), 1);
    close(fds[1]);
    /* Exited but not yet reaped: a zombie counts as gone. */
    for (uint64_t until = deadline_ms(2000); ts_proc_alive(child, cstart) && ts_now_ns() < until;)
        sleep_ms(1);
    CHECK_EQ(ts_proc_alive(child, cstart), 0);
    CHECK(waitpid(child, &status, 0) == child && WIFEXITED(status) && WEXITSTATUS(status) == 0);
    CHECK_EQ(ts_proc_alive(child, cstart), 0);
out:;
}

/* Out of fds (EMFILE), /proc cannot be read: a live process is "unknown", never dead,
 * and a gone one is still found gone (kill(pid, 0) needs no fd). */
static void test_proc_alive_without_fds(void)
{
    pid_t me = getpid();
    uint64_t start = ts_proc_start_time(me);
    struct rlimit old, low;
    int held[64], n = 0;
    REQUIRE(getrlimit(RLIMIT_NOFILE, &old) == 0);
    low = old;
    low.rlim_cur = 64;
    REQUIRE(setrlimit(RLIMIT_NOFILE, &low) == 0);
    while (n < 64) {
        int fd = dup(0);
        if (fd < 0) break;
        held[n++] = fd;
    }
    CHECK_EQ(errno, EMFILE);
    CHECK_EQ(ts_proc_check(me, start), TS_PROC_UNKNOWN);
    CHECK_EQ(ts_proc_alive(me, start), 1);
    CHECK_EQ(ts_proc_check(2000000000, 1), TS_PROC_DEAD); /* above any pid_max */
    for (int i = 0; i < n; i++) close(held[i]);
    REQUIRE(setrlimit(RLIMIT_NOFILE, &old) == 0);
    CHECK_EQ(ts_proc_check(me, start), TS_PROC_ALIVE);
out:;
}

/* Handshake and argument errors: names, tokens, unbound handles, a full consumer table. */
static void test_handshake_errors(void)
{
    fixture fx = {0};
    consumer A = {0};
    ts_err err = {0};
    ts_ring *r = NULL;
    ts_acquired a;
    ts_geometry one = {1, 1, 4096, 0}, g = {2, 1, 4096, 0};
    char missing[80];
    uint32_t idx;
    uint64_t tok, start;
    REQUIRE(fx_create(&fx, 2, 1, 4096) == 0);
    CHECK_ST(ts_ring_create(fx.name, &g, &r, &err), TS_E_EXISTS);
    CHECK_ST(ts_ring_create("/tensorsocket-ctest-bad", &one, &r, &err), TS_E_INVALID);
    snprintf(missing, sizeof missing, "%s-missing", fx.name);
    CHECK_ST(ts_ring_open(missing, &r, &err), TS_E_NOT_FOUND);
    REQUIRE(consumer_add(&fx, &A, 0) == 0);
    CHECK_ST(ts_ring_acquire(fx.prod, deadline_ms(10), &a, &err), TS_E_INVALID);
    REQUIRE_OK(ts_ring_open(fx.name, &r, &err));
    CHECK_ST(ts_ring_acquire(r, deadline_ms(10), &a, &err), TS_E_INVALID); /* unbound */
    CHECK_ST(ts_ring_bind_consumer(r, A.index, A.token + 1, &err), TS_E_INVALID);
    CHECK_ST(ts_ring_bind_consumer(r, TS_MAX_CONSUMERS, A.token, &err), TS_E_INVALID);
    REQUIRE_OK(ts_ring_reserve(fx.prod, getppid(), 1, 0, &idx, &tok, &err));
    CHECK_ST(ts_ring_bind_consumer(r, idx, tok, &err), TS_E_INVALID); /* another pid's entry */
    CHECK_ST(ts_ring_activate(fx.prod, 40, 0, &start, &err), TS_E_INVALID); /* not pending */
    CHECK_ST(ts_ring_acquire(A.ring, deadline_ms(10), &a, &err), TS_E_DETACHED); /* pending */
    for (uint32_t i = 2; i < TS_MAX_CONSUMERS; i++)
        REQUIRE_OK(ts_ring_reserve(fx.prod, getpid(), 1, 0, &idx, &tok, &err));
    CHECK_ST(ts_ring_reserve(fx.prod, getpid(), 1, 0, &idx, &tok, &err), TS_E_FULL);
out:
    if (r != NULL) ts_ring_unref(r);
    consumer_drop(&A);
    fx_destroy(&fx);
}

/* set_policy: window < slot_count, max_lag 0 or window < max_lag <= slot_count -
 * TS_RESERVE_SLOTS; else INVALID. */
static void test_policy(void)
{
    fixture fx = {0};
    ts_err err = {0};
    static const struct {
        uint64_t window, max_lag;
        ts_status want;
    } cases[] = {
        {0, 0, TS_OK},           {5, 0, TS_OK},           {6, 0, TS_E_INVALID},
        {UINT64_MAX, 0, TS_E_INVALID}, {0, 1, TS_OK},     {0, 4, TS_OK},
        {0, 5, TS_E_INVALID},    {3, 4, TS_OK},           {3, 5, TS_E_INVALID},
        {3, 3, TS_E_INVALID},    {3, 2, TS_E_INVALID},    {3, 6, TS_E_INVALID},
        {4, 5, TS_E_INVALID},    {5, 5, TS_E_INVALID},    {5, 6, TS_E_INVALID},
        {6, 7, TS_E_INVALID},    {0, UINT64_MAX, TS_E_INVALID},
    };
    REQUIRE(fx_create(&fx, 6, 2, 4096) == 0);
    ts_header *h = fx.prod->hdr;
    CHECK_EQ(h->window, 0); /* a new ring is lossless and has no window */
    CHECK_EQ(h->max_lag, 0);
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        REQUIRE_OK(ts_ring_set_policy(fx.prod, 2, 4, &err));
        memset(&err, 0, sizeof err);
        ts_status st = ts_ring_set_policy(fx.prod, cases[i].window, cases[i].max_lag, &err);
        if (!CHECK_EQ(st, cases[i].want))
            printf("    (window %llu, max_lag %llu: %s)\n", (unsigned long long)cases[i].window,
                   (unsigned long long)cases[i].max_lag, err.msg);
        if (st == TS_OK) {
            CHECK_EQ(h->window, cases[i].window);
            CHECK_EQ(h->max_lag, cases[i].max_lag);
        } else { /* a rejected policy changes nothing and says why */
            CHECK_EQ(err.code, TS_E_INVALID);
            CHECK(err.msg[0] != '\0');
            CHECK_EQ(h->window, 2);
            CHECK_EQ(h->max_lag, 4);
        }
    }
out:
    fx_destroy(&fx);
}

/* A late joiner starts `window` entries back, reads them in order, then new ones; A unaffected. */
static void test_late_joiner(void)
{
    fixture fx = {0};
    consumer A = {0}, B = {0};
    ts_err err = {0};
    ts_acquired a;
    uint64_t bytes = 0;
    REQUIRE(fx_create(&fx, 6, 2, 4096) == 0);
    ts_header *h = fx.prod->hdr;
    REQUIRE_OK(ts_ring_set_policy(fx.prod, 3, 0, &err));
    REQUIRE(consumer_add(&fx, &A, 1) == 0);
    CHECK_EQ(A.start_seq, 0); /* nothing published yet: the window is empty */
    for (uint64_t t = 0; t < 5; t++) {
        PUBLISH(t);
        TAKE(A, t, 1);
    }
    uint64_t bitA = 1ULL << A.index;

    /* B joins after 5 entries: it starts at 5 - 3 = 2, its bit is on entries 2..4 only. */
    REQUIRE(consumer_add(&fx, &B, 1) == 0);
    uint64_t bitB = 1ULL << B.index;
    ts_consumer *cb = &h->consumers[B.index];
    CHECK_EQ(B.start_seq, 2);
    CHECK_EQ(cb->first_seq, 2);
    CHECK_EQ(cb->cursor, 2);
    CHECK_EQ(cb->delivered, 0);
    CHECK_EQ(cb->delivered_bytes, 0);
    CHECK_EQ(h->active_mask, bitA | bitB);
    for (uint32_t k = 0; k < 6; k++) CHECK_EQ(readers_of(fx.prod, k), k >= 2 && k < 5 ? bitB : 0);

    PUBLISH(5);
    PUBLISH(6); /* slot 0 */
    CHECK_EQ(readers_of(fx.prod, 5), bitA | bitB);
    CHECK_EQ(readers_of(fx.prod, 0), bitA | bitB);
    TAKE(A, 5, 1);
    TAKE(A, 6, 1);
    CHECK_ST(ts_ring_acquire(A.ring, deadline_ms(20), &a, &err), TS_E_TIMEOUT); /* nothing twice */
    for (uint64_t seq = 2; seq < 7; seq++) {
        TAKE(B, seq, 0);
        CHECK(readers_of(fx.prod, a.slot) & bitB);
        bytes += ts_ring_slot(fx.prod, a.slot)->used_bytes;
        ts_ring_release(B.ring, a.slot, B.index, B.ring->incarnation);
    }
    CHECK_ST(ts_ring_acquire(B.ring, deadline_ms(20), &a, &err), TS_E_TIMEOUT);
    for (uint32_t k = 0; k < 6; k++) CHECK_EQ(readers_of(fx.prod, k), 0);
    CHECK_EQ(cb->delivered, 5);
    CHECK_EQ(cb->delivered_bytes, bytes);
    CHECK(bytes > 5 * 72);
    CHECK_EQ(cb->first_seq, 2);
    CHECK_EQ(cb->cursor, 7);
    CHECK_EQ(h->consumers[A.index].delivered, 7);
    CHECK_EQ(h->consumers[A.index].first_seq, 0);
    CHECK_EQ(h->consumers[A.index].cursor, 7);
out:
    consumer_drop(&A);
    consumer_drop(&B);
    fx_destroy(&fx);
}

/* The producer never overwrites a retained entry a late joiner has not read, or still holds. */
static void test_window_holds_slot(void)
{
    fixture fx = {0};
    consumer A = {0}, B = {0};
    ts_err err = {0};
    ts_acquired a;
    job pj = {.fx = &fx, .n = 9};
    pthread_t th;
    REQUIRE(fx_create(&fx, 6, 2, 4096) == 0);
    REQUIRE_OK(ts_ring_set_policy(fx.prod, 3, 0, &err));
    REQUIRE(consumer_add(&fx, &A, 1) == 0);
    for (uint64_t t = 0; t < 6; t++) {
        PUBLISH(t);
        TAKE(A, t, 1);
    }
    REQUIRE(consumer_add(&fx, &B, 1) == 0);
    CHECK_EQ(B.start_seq, 3);
    uint64_t bitA = 1ULL << A.index, bitB = 1ULL << B.index;
    for (uint64_t t = 6; t < 9; t++) { /* slots 0..2 were free */
        PUBLISH(t);
        TAKE(A, t, 1);
    }
    /* Entry 9 goes to slot 3, which still carries B's bit for unread entry 3. */
    CHECK_EQ(readers_of(fx.prod, 3), bitB);
    uint64_t dl = deadline_ms(50);
    CHECK_ST(publish_tagged(fx.prod, 9, dl, &err), TS_E_TIMEOUT);
    CHECK(ts_now_ns() >= dl);
    CHECK_EQ(published(&fx), 9);
    CHECK_EQ(seq_of(fx.prod, 3), 3);
    a.slot = 3, a.seq = 3;
    CHECK(entry_ok(B.ring, &a, 3)); /* untouched */
    TAKE(B, 3, 0); /* read but held: still not writable */
    CHECK_ST(publish_tagged(fx.prod, 9, deadline_ms(20), &err), TS_E_TIMEOUT);
    CHECK_EQ(published(&fx), 9);

    /* A publisher blocked on slot 3 proceeds once B lets go. */
    REQUIRE(pthread_create(&th, NULL, pub_run, &pj) == 0);
    sleep_ms(30);
    CHECK_EQ(published(&fx), 9);
    ts_ring_release(B.ring, 3, B.index, B.ring->incarnation);
    pthread_join(th, NULL);
    CHECK_EQ(pj.st, TS_OK);
    CHECK_EQ(published(&fx), 10);
    CHECK_EQ(seq_of(fx.prod, 3), 9);
    CHECK_EQ(readers_of(fx.prod, 3), bitA | bitB);
    for (uint64_t seq = 4; seq < 10; seq++) TAKE(B, seq, 1);
    TAKE(A, 9, 1);
    for (uint32_t k = 0; k < 6; k++) CHECK_EQ(readers_of(fx.prod, k), 0);
out:
    consumer_drop(&A);
    consumer_drop(&B);
    fx_destroy(&fx);
}

/* An aligned join starts at the current epoch's first entry while it is still in the
 * ring (whatever the window), else as far back as the ring still holds; never across an
 * END_EPOCH marker. A plain join keeps to the window. */
static void test_join_aligned(void)
{
    fixture fx = {0};
    consumer A = {0}, B = {0}, C = {0}, D = {0}, E = {0};
    ts_err err = {0};
    ts_acquired a;
    REQUIRE(fx_create(&fx, 6, 2, 4096) == 0);
    REQUIRE_OK(ts_ring_set_policy(fx.prod, 1, 0, &err));
    REQUIRE(consumer_add(&fx, &A, 1) == 0);
    PUBLISH(0);
    PUBLISH(1);
    PUBLISH(2);
    REQUIRE(consumer_add(&fx, &B, 2) == 0);
    CHECK_EQ(B.start_seq, 0); /* the epoch start, three entries back */
    REQUIRE(consumer_add(&fx, &C, 1) == 0);
    CHECK_EQ(C.start_seq, 2); /* the window: one entry back */
    for (uint64_t seq = 0; seq < 3; seq++) {
        TAKE(A, seq, 1);
        TAKE(B, seq, 1);
    }
    TAKE(C, 2, 1);
    PUBLISH(3);
    PUBLISH(4);
    PUBLISH(5);
    /* Six published in a ring of six: seq 0 is still there, the next publish takes it. */
    REQUIRE(consumer_add(&fx, &D, 2) == 0);
    CHECK_EQ(D.start_seq, 1); /* the oldest entry the ring can still hand out */
    for (uint64_t seq = 3; seq < 6; seq++) {
        TAKE(A, seq, 1);
        TAKE(B, seq, 1);
        TAKE(C, seq, 1);
    }
    for (uint64_t seq = 1; seq < 6; seq++) TAKE(D, seq, 1);
    REQUIRE_OK(publish_end(fx.prod, 0, 6, &err)); /* seq 6: the epoch ends */
    REQUIRE(consumer_add(&fx, &E, 2) == 0);
    CHECK_EQ(E.start_seq, 7); /* never back across the marker */
out:
    consumer_drop(&A);
    consumer_drop(&B);
    consumer_drop(&C);
    consumer_drop(&D);
    consumer_drop(&E);
    fx_destroy(&fx);
}

/* Joining never reaches back across an END_EPOCH marker; with window 0 it starts at published. */
static void test_join_epoch(void)
{
    fixture fx = {0};
    consumer A = {0}, B = {0}, C = {0}, D = {0}, E = {0};
    ts_err err = {0};
    ts_acquired a;
    REQUIRE(fx_create(&fx, 6, 2, 4096) == 0);
    ts_header *h = fx.prod->hdr;
    REQUIRE_OK(ts_ring_set_policy(fx.prod, 3, 0, &err));
    REQUIRE(consumer_add(&fx, &A, 1) == 0);
    PUBLISH(0);
    PUBLISH(1);
    REQUIRE_OK(publish_end(fx.prod, 0, 2, &err)); /* seq 2 */
    CHECK_EQ(h->epoch_first_seq, 3);
    uint64_t bitA = 1ULL << A.index;

    /* Right after the marker: B starts at the next entry, no retained entry gets its bit. */
    REQUIRE(consumer_add(&fx, &B, 1) == 0);
    uint64_t bitB = 1ULL << B.index;
    CHECK_EQ(B.start_seq, 3);
    CHECK_EQ(h->consumers[B.index].first_seq, 3);
    for (uint32_t k = 0; k < 3; k++) CHECK_EQ(readers_of(fx.prod, k), bitA);

    /* One entry into the epoch: the window (4 - 3 = 1) is cut at the epoch start, 3. */
    PUBLISH(3);
    REQUIRE(consumer_add(&fx, &C, 1) == 0);
    uint64_t bitC = 1ULL << C.index;
    CHECK_EQ(C.start_seq, 3);
    for (uint32_t k = 0; k < 3; k++) CHECK_EQ(readers_of(fx.prod, k), bitA);
    CHECK_EQ(readers_of(fx.prod, 3), bitA | bitB | bitC);

    /* Three entries in: the window reaches exactly the epoch start. */
    PUBLISH(4);
    PUBLISH(5);
    REQUIRE(consumer_add(&fx, &D, 1) == 0);
    uint64_t bitD = 1ULL << D.index;
    CHECK_EQ(D.start_seq, 3);
    for (uint32_t k = 3; k < 6; k++) CHECK_EQ(readers_of(fx.prod, k), bitA | bitB | bitC | bitD);

    TAKE(A, 0, 1);
    TAKE(A, 1, 1);
    REQUIRE_OK(ts_ring_acquire(A.ring, deadline_ms(1000), &a, &err));
    CHECK_EQ(a.seq, 2);
    CHECK_EQ(a.kind, TS_ENTRY_END_EPOCH);
    CHECK_EQ(a.epoch, 0);
    CHECK_EQ(a.index, 2);
    CHECK_EQ(ts_ring_slot(A.ring, a.slot)->n_leaves, 0);
    ts_ring_release(A.ring, a.slot, A.index, A.ring->incarnation);
    for (uint64_t seq = 3; seq < 6; seq++) {
        TAKE(A, seq, 1);
        TAKE(B, seq, 1);
        TAKE(C, seq, 1);
        TAKE(D, seq, 1);
    }

    /* Window 0: a joiner starts at published, no entry gets its bit. */
    REQUIRE_OK(ts_ring_set_policy(fx.prod, 0, 0, &err));
    REQUIRE(consumer_add(&fx, &E, 1) == 0);
    CHECK_EQ(E.start_seq, 6);
    CHECK_EQ(E.start_seq, published(&fx));
    CHECK(!bit_in_use(fx.prod, 1ULL << E.index));
    PUBLISH(6);
    TAKE(E, 6, 1);
    TAKE(A, 6, 1);
    CHECK_ST(ts_ring_acquire(E.ring, deadline_ms(20), &a, &err), TS_E_TIMEOUT);
out:
    consumer_drop(&A), consumer_drop(&B), consumer_drop(&C), consumer_drop(&D), consumer_drop(&E);
    fx_destroy(&fx);
}

/* max_lag: a consumer more than max_lag entries behind the FASTEST consumer is detached when
 * the producer publishes; alone, equally behind, or a late joiner, it is not. */
static void test_laggard(void)
{
    fixture fx = {0};
    consumer A = {0}, B = {0}, C = {0}, D = {0};
    ts_err err = {0};
    ts_acquired a;
    REQUIRE(fx_create(&fx, 6, 2, 4096) == 0);
    ts_header *h = fx.prod->hdr;
    REQUIRE_OK(ts_ring_set_policy(fx.prod, 2, 3, &err));

    /* A consumer alone is never a laggard, however far behind the producer: 6 entries
     * unread, the producer just blocks (its waits re-check the lag every 100 ms slice). */
    REQUIRE(consumer_add(&fx, &A, 1) == 0);
    uint64_t bitA = 1ULL << A.index;
    for (uint64_t t = 0; t < 6; t++) PUBLISH(t);
    uint64_t dl = deadline_ms(120);
    CHECK_ST(publish_tagged(fx.prod, 6, dl, &err), TS_E_TIMEOUT);
    CHECK(ts_now_ns() >= dl);
    CHECK_EQ(published(&fx), 6);
    CHECK_EQ(state_of(fx.prod, A.index), TS_CONSUMER_ACTIVE);
    CHECK_EQ(cursor_of(fx.prod, A.index), 0);
    CHECK_EQ(h->active_mask, bitA);
    CHECK_EQ(h->lag_detached, 0);
    for (uint64_t seq = 0; seq < 6; seq++) TAKE(A, seq, 1);

    /* A late joiner starts window (2) back from the fastest: within max_lag, kept. */
    REQUIRE(consumer_add(&fx, &B, 1) == 0);
    uint64_t bitB = 1ULL << B.index;
    CHECK_EQ(B.start_seq, 4);
    for (uint32_t k = 0; k < 6; k++) CHECK_EQ(readers_of(fx.prod, k), k >= 4 ? bitB : 0);
    PUBLISH(6); /* A 6, B 4 */
    CHECK_EQ(state_of(fx.prod, B.index), TS_CONSUMER_ACTIVE);
    TAKE(A, 6, 1);
    PUBLISH(7); /* A 7, B 4: exactly max_lag behind is still fine */
    CHECK_EQ(state_of(fx.prod, B.index), TS_CONSUMER_ACTIVE);
    TAKE(B, 4, 0); /* B holds entry 4 and reads no further */
    TAKE(A, 7, 1);
    PUBLISH(8); /* A 8, B 5 */
    TAKE(A, 8, 1);
    /* A 9, B 5: too far behind, but only a publish (or a producer wait) looks. */
    CHECK_EQ(state_of(fx.prod, B.index), TS_CONSUMER_ACTIVE);
    CHECK_EQ(h->active_mask, bitA | bitB);
    CHECK_EQ(h->lag_detached, 0);
    PUBLISH(9); /* slot 3 */
    CHECK_EQ(state_of(fx.prod, B.index), TS_CONSUMER_DETACHED);
    CHECK_EQ(reason_of(fx.prod, B.index), TS_REASON_LAGGED);
    CHECK_EQ(state_of(fx.prod, A.index), TS_CONSUMER_ACTIVE);
    CHECK_EQ(h->lag_detached, 1);
    CHECK_EQ(h->active_mask, bitA);
    CHECK_EQ(cursor_of(fx.prod, B.index), 5 | TS_CURSOR_DETACHED);
    CHECK_EQ(readers_of(fx.prod, 4), bitB); /* held: kept until released */
    for (uint32_t k = 0; k < 6; k++) /* unread 5..9, even entry 9 just published to it */
        if (k != 4) CHECK_EQ(readers_of(fx.prod, k) & bitB, 0);
    CHECK_EQ(readers_of(fx.prod, 3), bitA);
    CHECK_ST(ts_ring_acquire(B.ring, deadline_ms(1000), &a, &err), TS_E_DETACHED);
    CHECK(strstr(err.msg, "max_lag=3") != NULL);
    CHECK_ST(ts_ring_acquire(B.ring, deadline_ms(1000), &a, &err), TS_E_DETACHED);
    a.slot = 4, a.seq = 4;
    CHECK(entry_ok(B.ring, &a, 4)); /* the held entry is intact */

    /* A DETACHED entry is not handed out again, even once its bits are gone. */
    REQUIRE(consumer_add(&fx, &D, 0) == 0);
    CHECK(D.index != B.index);
    CHECK_EQ(state_of(fx.prod, B.index), TS_CONSUMER_DETACHED);
    ts_ring_retire(fx.prod, D.index);
    consumer_drop(&D);
    /* Retiring it while it still holds entry 4: LEAVING, the reason stays LAGGED. */
    ts_ring_retire(fx.prod, B.index);
    CHECK_EQ(state_of(fx.prod, B.index), TS_CONSUMER_LEAVING);
    CHECK_EQ(reason_of(fx.prod, B.index), TS_REASON_LAGGED);
    CHECK_EQ(readers_of(fx.prod, 4), bitB);
    CHECK_ST(ts_ring_acquire(B.ring, deadline_ms(1000), &a, &err), TS_E_DETACHED);
    ts_ring_release(B.ring, 4, B.index, B.ring->incarnation);
    CHECK_EQ(readers_of(fx.prod, 4), 0);

    /* Two consumers equally behind hold nobody back: 6 entries unread by both, the producer
     * blocks, neither is detached. */
    TAKE(A, 9, 1);
    REQUIRE(consumer_add(&fx, &C, 1) == 0);
    uint64_t bitC = 1ULL << C.index;
    CHECK_EQ(C.index, B.index); /* LEAVING without bits: reusable */
    CHECK(C.token != B.token);
    CHECK_EQ(C.start_seq, 8);
    TAKE(C, 8, 1);
    TAKE(C, 9, 1);
    for (uint64_t t = 10; t < 16; t++) PUBLISH(t);
    CHECK_ST(publish_tagged(fx.prod, 16, deadline_ms(20), &err), TS_E_TIMEOUT);
    CHECK_EQ(published(&fx), 16);
    CHECK_EQ(state_of(fx.prod, A.index), TS_CONSUMER_ACTIVE);
    CHECK_EQ(state_of(fx.prod, C.index), TS_CONSUMER_ACTIVE);
    CHECK_EQ(h->active_mask, bitA | bitC);
    CHECK_EQ(h->lag_detached, 1);

    /* A and C go on losslessly; the slots B dropped were free for the producer. */
    for (uint64_t seq = 10; seq < 16; seq++) {
        TAKE(A, seq, 1);
        TAKE(C, seq, 1);
    }
    for (uint32_t k = 0; k < 6; k++) CHECK_EQ(readers_of(fx.prod, k), 0);
    CHECK_EQ(h->consumers[A.index].delivered, 16);
    CHECK_EQ(h->consumers[C.index].delivered, 8);

    /* C stops reading (holds nothing) while A goes on: detached at the first publish that
     * finds A more than max_lag ahead of it (A 20, C 16), with no bit left; retiring it frees
     * its entry at once. */
    for (uint64_t t = 16; t < 21; t++) {
        PUBLISH(t);
        CHECK_EQ(state_of(fx.prod, C.index), t < 20 ? TS_CONSUMER_ACTIVE : TS_CONSUMER_DETACHED);
        TAKE(A, t, 1);
    }
    CHECK_EQ(h->lag_detached, 2);
    CHECK_EQ(reason_of(fx.prod, C.index), TS_REASON_LAGGED);
    CHECK_EQ(cursor_of(fx.prod, C.index), 16 | TS_CURSOR_DETACHED);
    CHECK(!bit_in_use(fx.prod, bitC));
    CHECK_ST(ts_ring_acquire(C.ring, deadline_ms(1000), &a, &err), TS_E_DETACHED);
    CHECK(strstr(err.msg, "max_lag=3") != NULL);
    ts_ring_retire(fx.prod, C.index);
    CHECK_EQ(state_of(fx.prod, C.index), TS_CONSUMER_FREE);
    CHECK_EQ(h->active_mask, bitA);
    CHECK_EQ(h->consumers[A.index].delivered, 21);
out:
    consumer_drop(&A), consumer_drop(&B), consumer_drop(&C), consumer_drop(&D);
    fx_destroy(&fx);
}

/* A producer blocked on a slow consumer's slot detaches it once the fastest consumer is more
 * than max_lag ahead of it (within about one 100 ms wait slice), then publishes; a slot the
 * laggard still holds stays held until released (the producer puts a hole there). */
static void test_laggard_blocked(void)
{
    fixture fx = {0};
    consumer A = {0}, B = {0}, C = {0};
    ts_err err = {0};
    ts_acquired a;
    job pj = {.fx = &fx, .n = 6};
    pthread_t th;
    int running = 0;
    REQUIRE(fx_create(&fx, 6, 2, 4096) == 0);
    ts_header *h = fx.prod->hdr;
    REQUIRE_OK(ts_ring_set_policy(fx.prod, 2, 3, &err));
    REQUIRE(consumer_add(&fx, &A, 1) == 0 && consumer_add(&fx, &B, 1) == 0);
    uint64_t bitA = 1ULL << A.index, bitB = 1ULL << B.index;
    for (uint64_t t = 0; t < 6; t++) PUBLISH(t);
    for (uint64_t seq = 0; seq < 3; seq++) TAKE(A, seq, 1);
    /* A 3, B 0: exactly max_lag behind; the producer waits for slot 0 without detaching. */
    CHECK_ST(publish_tagged(fx.prod, 6, deadline_ms(20), &err), TS_E_TIMEOUT);
    CHECK_EQ(state_of(fx.prod, B.index), TS_CONSUMER_ACTIVE);

    /* A publisher blocked on slot 0 for more than one slice: B still kept. */
    REQUIRE(pthread_create(&th, NULL, pub_run, &pj) == 0);
    running = 1;
    sleep_ms(120);
    CHECK_EQ(published(&fx), 6);
    CHECK_EQ(state_of(fx.prod, B.index), TS_CONSUMER_ACTIVE);
    CHECK_EQ(h->lag_detached, 0);
    /* A reads on (4 ahead): the waiting publisher detaches B at its next slice and goes on. */
    TAKE(A, 3, 1);
    uint64_t t = ts_now_ns();
    pthread_join(th, NULL);
    running = 0;
    if (!CHECK_EQ(pj.st, TS_OK)) printf("  publisher: %s\n", pj.err.msg);
    CHECK(pj.t_end - t < 250 * MS); /* one 100 ms slice, plus slack for a busy machine */
    CHECK_EQ(published(&fx), 7);
    CHECK_EQ(state_of(fx.prod, B.index), TS_CONSUMER_DETACHED);
    CHECK_EQ(reason_of(fx.prod, B.index), TS_REASON_LAGGED);
    CHECK_EQ(h->lag_detached, 1);
    CHECK_EQ(h->active_mask, bitA);
    CHECK_EQ(cursor_of(fx.prod, B.index), 0 | TS_CURSOR_DETACHED);
    CHECK_EQ(seq_of(fx.prod, 0), 6);
    CHECK_EQ(readers_of(fx.prod, 0), bitA);
    for (uint32_t k = 1; k < 6; k++) CHECK_EQ(readers_of(fx.prod, k), k >= 4 ? bitA : 0);
    CHECK(!bit_in_use(fx.prod, bitB));
    CHECK_ST(ts_ring_acquire(B.ring, deadline_ms(1000), &a, &err), TS_E_DETACHED);
    CHECK(strstr(err.msg, "max_lag=3") != NULL);
    ts_ring_retire(fx.prod, B.index); /* no bit left: FREE at once */
    CHECK_EQ(state_of(fx.prod, B.index), TS_CONSUMER_FREE);
    for (uint64_t seq = 4; seq < 7; seq++) TAKE(A, seq, 1);

    /* A late joiner (window 2 behind A) is kept; once it holds the slot the producer needs
     * and A is 5 ahead, the waiting producer detaches it, but the held slot stays held: the
     * producer publishes a hole there (seq 11) and the entry in the next slot (seq 12). */
    REQUIRE(consumer_add(&fx, &C, 1) == 0);
    uint64_t bitC = 1ULL << C.index;
    CHECK_EQ(C.start_seq, 5);
    PUBLISH(7);
    CHECK_EQ(state_of(fx.prod, C.index), TS_CONSUMER_ACTIVE);
    TAKE(C, 5, 0); /* holds entry 5 (slot 5) */
    for (uint64_t tag = 8; tag < 11; tag++) PUBLISH(tag);
    CHECK_EQ(state_of(fx.prod, C.index), TS_CONSUMER_ACTIVE);
    for (uint64_t seq = 7; seq < 11; seq++) TAKE(A, seq, 1);
    PUBLISH(11);
    CHECK_EQ(published(&fx), 13);
    CHECK_EQ(state_of(fx.prod, C.index), TS_CONSUMER_DETACHED);
    CHECK_EQ(reason_of(fx.prod, C.index), TS_REASON_LAGGED);
    CHECK_EQ(h->lag_detached, 2);
    CHECK_EQ(h->active_mask, bitA);
    CHECK_EQ(cursor_of(fx.prod, C.index), 6 | TS_CURSOR_DETACHED);
    CHECK_EQ(h->holes, 1);
    CHECK_EQ(seq_of(fx.prod, 5), 11);
    CHECK(ts_ring_slot(fx.prod, 5)->hole);
    for (uint32_t k = 0; k < 6; k++)
        CHECK_EQ(readers_of(fx.prod, k), k == 5 ? bitC | bitA : k == 0 ? bitA : 0);
    CHECK_ST(ts_ring_acquire(C.ring, deadline_ms(1000), &a, &err), TS_E_DETACHED);
    CHECK(content_ok(C.ring, 5, 5)); /* the held entry is intact */
    TAKE_TAG(A, 12, 11, 1);          /* A passes the hole */
    CHECK_EQ(readers_of(fx.prod, 5), bitC);
    /* Retired while it holds: its hold stays, though the hole's seq is past its cursor. */
    ts_ring_retire(fx.prod, C.index);
    CHECK_EQ(state_of(fx.prod, C.index), TS_CONSUMER_LEAVING);
    CHECK_EQ(readers_of(fx.prod, 5), bitC);
    CHECK(content_ok(C.ring, 5, 5));
    ts_ring_release(C.ring, 5, C.index, C.ring->incarnation);
    CHECK_EQ(readers_of(fx.prod, 5), 0);
    CHECK_EQ(h->consumers[A.index].delivered, 12);
out:
    if (running) {
        ts_ring_detach(fx.prod, B.index, TS_REASON_DIED); /* frees slot 0 for the publisher */
        pthread_join(th, NULL);
    }
    consumer_drop(&A), consumer_drop(&B), consumer_drop(&C);
    fx_destroy(&fx);
}

/* ts_ring_detach: unread entries dropped, held ones kept, a sleeping acquire woken. */
static void test_detach_api(void)
{
    fixture fx = {0};
    consumer A = {0}, B = {0}, P = {0};
    ts_err err = {0};
    ts_acquired a;
    job dj = {.c = &A};
    pthread_t th;
    REQUIRE(fx_create(&fx, 4, 2, 4096) == 0);
    ts_header *h = fx.prod->hdr;
    REQUIRE(consumer_add(&fx, &A, 1) == 0 && consumer_add(&fx, &B, 1) == 0);
    REQUIRE(consumer_add(&fx, &P, 0) == 0);
    uint64_t bitA = 1ULL << A.index, bitB = 1ULL << B.index;
    PUBLISH(0);
    PUBLISH(1);
    PUBLISH(2);
    TAKE(B, 0, 0); /* holds 0 */
    TAKE(B, 1, 1); /* read 1 */
    ts_ring_detach(fx.prod, B.index, TS_REASON_DIED);
    CHECK_EQ(state_of(fx.prod, B.index), TS_CONSUMER_DETACHED);
    CHECK_EQ(reason_of(fx.prod, B.index), TS_REASON_DIED);
    CHECK_EQ(cursor_of(fx.prod, B.index), 2 | TS_CURSOR_DETACHED);
    CHECK_EQ(h->active_mask, bitA);
    CHECK_EQ(readers_of(fx.prod, 0), bitA | bitB);
    CHECK_EQ(readers_of(fx.prod, 1), bitA);
    CHECK_EQ(readers_of(fx.prod, 2), bitA);
    CHECK_EQ(h->lag_detached, 0);
    CHECK_EQ(h->consumers[B.index].delivered, 2);
    CHECK_ST(ts_ring_acquire(B.ring, deadline_ms(1000), &a, &err), TS_E_DETACHED);
    PUBLISH(3);
    CHECK_EQ(readers_of(fx.prod, 3), bitA);

    /* Detaching again, a pending or an unknown consumer changes nothing. */
    ts_ring_detach(fx.prod, B.index, TS_REASON_LAGGED);
    CHECK_EQ(reason_of(fx.prod, B.index), TS_REASON_DIED);
    ts_ring_detach(fx.prod, P.index, TS_REASON_LAGGED);
    CHECK_EQ(state_of(fx.prod, P.index), TS_CONSUMER_PENDING);
    ts_ring_detach(fx.prod, TS_MAX_CONSUMERS, TS_REASON_LAGGED);
    CHECK_EQ(h->active_mask, bitA);

    /* Not reused while DETACHED; retire: LEAVING while entry 0 is held, reusable after. */
    uint32_t idx;
    uint64_t tok;
    REQUIRE_OK(ts_ring_reserve(fx.prod, getpid(), 1, 0, &idx, &tok, &err));
    CHECK(idx != B.index);
    ts_ring_retire(fx.prod, idx);
    ts_ring_retire(fx.prod, B.index);
    CHECK_EQ(state_of(fx.prod, B.index), TS_CONSUMER_LEAVING);
    ts_ring_release(B.ring, 0, B.index, B.ring->incarnation);
    CHECK(!bit_in_use(fx.prod, bitB));
    REQUIRE_OK(ts_ring_reserve(fx.prod, getpid(), 1, 0, &idx, &tok, &err));
    CHECK_EQ(idx, B.index);

    /* A consumer asleep in acquire is woken by detach. */
    for (uint64_t seq = 0; seq < 4; seq++) TAKE(A, seq, 1);
    REQUIRE(pthread_create(&th, NULL, drain_run, &dj) == 0);
    sleep_ms(30);
    uint64_t t = ts_now_ns();
    ts_ring_detach(fx.prod, A.index, TS_REASON_LAGGED);
    pthread_join(th, NULL);
    CHECK_EQ(dj.st, TS_E_DETACHED);
    CHECK(dj.t_end - t < 80 * MS); /* woken, not the 100 ms re-check */
    CHECK_EQ(state_of(fx.prod, A.index), TS_CONSUMER_DETACHED);
    CHECK(!bit_in_use(fx.prod, bitA));
    ts_ring_retire(fx.prod, A.index); /* DETACHED with no bits: FREE at once */
    CHECK_EQ(state_of(fx.prod, A.index), TS_CONSUMER_FREE);
    CHECK_EQ(reason_of(fx.prod, A.index), TS_REASON_LAGGED);
    CHECK_EQ(h->active_mask, 0);
out:
    consumer_drop(&A), consumer_drop(&B), consumer_drop(&P);
    fx_destroy(&fx);
}

/* A consumer evicted for silence loses its holds like a dead one, and its next acquire
 * says why (the producer's heartbeat_timeout), not that it was merely detached. */
static void test_evict_silent(void)
{
    fixture fx = {0};
    consumer A = {0}, B = {0};
    ts_err err = {0};
    ts_acquired a;
    REQUIRE(fx_create(&fx, 2, 2, 4096) == 0);
    REQUIRE(consumer_add(&fx, &A, 1) == 0 && consumer_add(&fx, &B, 1) == 0);
    uint64_t bitB = 1ULL << B.index;
    PUBLISH(0);
    PUBLISH(1);
    TAKE(A, 0, 0); /* A holds entry 0 and falls silent; 1 stays unread */
    TAKE(B, 0, 1);
    ts_ring_evict_for(fx.prod, A.index, TS_REASON_SILENT);
    CHECK_EQ(state_of(fx.prod, A.index), TS_CONSUMER_FREE);
    CHECK_EQ(reason_of(fx.prod, A.index), TS_REASON_SILENT);
    CHECK_EQ(readers_of(fx.prod, 0), 0);
    CHECK_EQ(readers_of(fx.prod, 1), bitB);
    CHECK_EQ(fx.prod->hdr->active_mask, bitB);
    CHECK_ST(ts_ring_acquire(A.ring, deadline_ms(1000), &a, &err), TS_E_DETACHED);
    CHECK(strstr(err.msg, "heartbeat_timeout") != NULL);
    PUBLISH(2); /* slot 0 is free for the producer at once */
    TAKE(B, 1, 1);
    TAKE(B, 2, 1);
    ts_ring_evict(fx.prod, B.index); /* the plain eviction: a dead consumer */
    CHECK_EQ(reason_of(fx.prod, B.index), TS_REASON_DIED);
out:
    consumer_drop(&A), consumer_drop(&B);
    fx_destroy(&fx);
}

/* A consumer retired as silent while it holds entry 0 (its process lives: it may read that
 * batch again) stops receiving, but its held slot is never written: the producer puts holes
 * there, which the others pass, and goes on in the other slots; its next acquire says why,
 * with the figures; its entry is not handed out again while it holds. Released, the slot
 * takes entries again; evicted as dead, its holds go at once. */
static void test_silent_keeps_held(void)
{
    fixture fx = {0};
    consumer A = {0}, B = {0}, D = {0};
    ts_err err = {0};
    ts_acquired a;
    REQUIRE(fx_create(&fx, 4, 2, 4096) == 0);
    ts_header *h = fx.prod->hdr;
    REQUIRE(consumer_add(&fx, &A, 1) == 0 && consumer_add(&fx, &B, 1) == 0);
    uint64_t bitA = 1ULL << A.index, bitB = 1ULL << B.index;
    for (uint64_t t = 0; t < 4; t++) PUBLISH(t);
    for (uint64_t seq = 0; seq < 4; seq++) TAKE(A, seq, 1);
    TAKE(B, 0, 0); /* B holds entry 0 and falls silent; 1..3 stay unread */
    CHECK_ST(publish_tagged(fx.prod, 4, deadline_ms(20), &err), TS_E_TIMEOUT); /* waits for B */
    ts_ring_retire_silent(fx.prod, B.index, 41200, 30000);
    CHECK_EQ(state_of(fx.prod, B.index), TS_CONSUMER_LEAVING);
    CHECK_EQ(reason_of(fx.prod, B.index), TS_REASON_SILENT);
    CHECK_EQ(h->active_mask, bitA);
    for (uint32_t k = 0; k < 4; k++) CHECK_EQ(readers_of(fx.prod, k), k == 0 ? bitB : 0);
    CHECK_ST(ts_ring_acquire(B.ring, deadline_ms(1000), &a, &err), TS_E_DETACHED);
    CHECK(strstr(err.msg, "no heartbeat for 41.2 s") != NULL);
    CHECK(strstr(err.msg, "heartbeat_timeout=30 s") != NULL);
    CHECK(strstr(err.msg, "kept intact") != NULL);
    /* Seq 4 is a hole in slot 0; tags 4..6 go to slots 1..3 as seqs 5..7. */
    for (uint64_t t = 4; t < 7; t++) PUBLISH(t);
    CHECK_EQ(published(&fx), 8);
    CHECK_EQ(h->holes, 1);
    CHECK_EQ(seq_of(fx.prod, 0), 4);
    CHECK_EQ(readers_of(fx.prod, 0), bitB | bitA);
    CHECK(content_ok(B.ring, 0, 0));
    for (uint64_t t = 4; t < 7; t++) TAKE_TAG(A, t + 1, t, 1); /* passing the hole first */
    CHECK_EQ(readers_of(fx.prod, 0), bitB);
    PUBLISH(7); /* another round: hole 8 in slot 0, tag 7 as seq 9 */
    CHECK_EQ(published(&fx), 10);
    CHECK_EQ(h->holes, 2);
    CHECK(content_ok(B.ring, 0, 0));
    /* The entry holds: a new consumer gets another one. */
    REQUIRE(consumer_add(&fx, &D, 0) == 0);
    CHECK(D.index != B.index);
    ts_ring_retire(fx.prod, D.index);
    TAKE_TAG(A, 9, 7, 1);
    /* B gives the batch back: slot 0 takes entries again. */
    ts_ring_release(B.ring, 0, B.index, B.ring->incarnation);
    CHECK_EQ(readers_of(fx.prod, 0), 0);
    for (uint64_t t = 8; t < 11; t++) PUBLISH(t); /* seqs 10, 11, 12 (slot 0) */
    CHECK_EQ(h->holes, 2);
    CHECK_EQ(seq_of(fx.prod, 0), 12);
    CHECK(!ts_ring_slot(fx.prod, 0)->hole);
    for (uint64_t t = 8; t < 11; t++) TAKE_TAG(A, t + 2, t, 1);

    /* Again, evicted as dead while it holds: its hold goes, the slot is written at once. */
    consumer_drop(&B);
    REQUIRE(consumer_add(&fx, &B, 1) == 0);
    bitB = 1ULL << B.index;
    PUBLISH(11);
    TAKE_TAG(B, 13, 11, 0);
    TAKE_TAG(A, 13, 11, 1);
    ts_ring_retire_silent(fx.prod, B.index, 5000, 3000);
    CHECK_EQ(readers_of(fx.prod, 1), bitB);
    ts_ring_evict(fx.prod, B.index);
    CHECK_EQ(state_of(fx.prod, B.index), TS_CONSUMER_FREE);
    CHECK_EQ(readers_of(fx.prod, 1), 0);
    for (uint64_t t = 12; t < 16; t++) {
        PUBLISH(t);
        TAKE_TAG(A, t + 2, t, 1);
    }
    CHECK_EQ(h->holes, 2);
out:
    consumer_drop(&A), consumer_drop(&B), consumer_drop(&D);
    fx_destroy(&fx);
}

/* Holes never run round the ring: when every slot is kept by consumers that receive no more,
 * the producer waits (no entry, no hole) until one is given back. */
static void test_holes_all_kept(void)
{
    fixture fx = {0};
    consumer A = {0}, B = {0};
    ts_err err = {0};
    ts_acquired a;
    REQUIRE(fx_create(&fx, 2, 2, 4096) == 0);
    ts_header *h = fx.prod->hdr;
    REQUIRE(consumer_add(&fx, &A, 1) == 0 && consumer_add(&fx, &B, 1) == 0);
    PUBLISH(0);
    PUBLISH(1);
    TAKE(B, 0, 0);
    TAKE(B, 1, 0); /* B holds both slots */
    TAKE(A, 0, 1);
    TAKE(A, 1, 1);
    ts_ring_retire_silent(fx.prod, B.index, 5000, 3000);
    CHECK_ST(publish_tagged(fx.prod, 2, deadline_ms(150), &err), TS_E_TIMEOUT);
    CHECK_EQ(published(&fx), 2);
    CHECK_EQ(h->holes, 0);
    CHECK(content_ok(B.ring, 0, 0) && content_ok(B.ring, 1, 1));
    ts_ring_release(B.ring, 0, B.index, B.ring->incarnation);
    PUBLISH(2); /* seq 2 in slot 0 */
    /* Slot 1 (seq 3) is kept, slot 0 will be free: a hole, then a wait for A in slot 0. */
    CHECK_ST(publish_tagged(fx.prod, 3, deadline_ms(20), &err), TS_E_TIMEOUT);
    CHECK_EQ(published(&fx), 4);
    CHECK_EQ(h->holes, 1);
    TAKE(A, 2, 1);
    PUBLISH(3);
    TAKE_TAG(A, 4, 3, 1);
    CHECK(content_ok(B.ring, 1, 1));
    ts_ring_release(B.ring, 1, B.index, B.ring->incarnation);
    CHECK_EQ(readers_of(fx.prod, 1), 0);
    CHECK_EQ(h->batches_delivered, 6); /* B 2, A 4: the hole A passed is not a batch */
out:
    consumer_drop(&A), consumer_drop(&B);
    fx_destroy(&fx);
}

#define DR_BUDGET_MS 700
#define DR_MAX_ROUNDS 2000
#define DR_MAX_LAG 4

/* One consumer of the detach race: acquires until detached, checking what it got. */
typedef struct racer {
    consumer *c;
    unsigned seed;
    unsigned period;   /* 1 in `period` entries is held slowly, 1 in `period` followed by a pause */
    unsigned spin_us;  /* and every entry is followed by a busy pause of 0..spin_us µs */
    uint64_t next;     /* seq it expects next, or a later one (holes before it) */
    uint64_t tag;      /* tag it expects next (UINT64_MAX: any, before its first entry) */
    uint64_t got, bytes;
    _Atomic int go;   /* 1: activated, start; -1: give up */
    _Atomic int done;
    ts_status st;
    ts_err err;
} racer;

/* The producer side of the detach race: publish tags 0, 1, 2, ... until told to stop (their
 * seqs too, unless a consumer detached while holding a slot made the producer skip it). */
typedef struct race_producer {
    fixture *fx;
    _Atomic int stop;
    uint64_t n;
    ts_status st;
    ts_err err;
} race_producer;

/* Publish in bursts of 1..7 entries with short pauses (a held slot only delays it) until stop. */
static void *dr_producer(void *p)
{
    race_producer *j = p;
    unsigned seed = 7;
    j->st = TS_OK;
    while (!atomic_load(&j->stop)) {
        for (unsigned burst = (unsigned)rand_r(&seed) % 7 + 1; burst > 0; burst--) {
            ts_status st = publish_tagged(j->fx->prod, j->n, deadline_ms(5), &j->err);
            if (st == TS_OK) j->n++;
            else if (st != TS_E_TIMEOUT) {
                j->st = st;
                return NULL;
            }
        }
        /* Spin a few µs: the consumers catch up and race the next burst. */
        for (uint64_t t = ts_now_ns() + (uint64_t)(rand_r(&seed) % 30) * 1000; ts_now_ns() < t;) {}
    }
    return NULL;
}

/* Acquire and release, sometimes slowly, until acquire fails; every entry must be ours. */
static void *dr_consumer(void *p)
{
    racer *r = p;
    consumer *c = r->c;
    uint64_t bit = 1ULL << c->index;
    ts_acquired a;
    while (atomic_load(&r->go) == 0) sched_yield(); /* running when it is activated */
    r->next = c->start_seq;
    r->tag = UINT64_MAX;
    for (r->st = TS_E_INVALID; atomic_load(&r->go) > 0;) {
        r->st = ts_ring_acquire(c->ring, deadline_ms(2000), &a, &r->err);
        if (r->st != TS_OK) break;
        /* Ours until released: our bit, consecutive tags (never one twice, none skipped; the
         * seqs skip holes), intact content (detached as soon as it was taken, its slot may
         * have got a hole already: a new seq, nothing else). */
        uint64_t tag = a.epoch * 5 + a.index;
        if (!CHECK(readers_of(c->ring, a.slot) & bit) || !CHECK(a.seq >= r->next) ||
            !CHECK(r->tag == UINT64_MAX || tag == r->tag) ||
            !CHECK(content_ok(c->ring, a.slot, tag)))
            break;
        r->next = a.seq + 1;
        r->tag = tag + 1;
        r->got++;
        r->bytes += ts_ring_slot(c->ring, a.slot)->used_bytes;
        unsigned dice = (unsigned)rand_r(&r->seed) % r->period;
        if (dice == 0) sleep_us(500); /* slow while holding: detach must leave this entry */
        if (!CHECK(readers_of(c->ring, a.slot) & bit) || !CHECK(content_ok(c->ring, a.slot, tag)))
            break;
        ts_ring_release(c->ring, a.slot, c->index, c->ring->incarnation);
        if (dice == 1) sleep_us(500); /* slow between entries: falls behind */
        /* A little slow: falls behind while acquiring, so lag detaches race acquire too. */
        if (r->spin_us > 0)
            for (uint64_t t = ts_now_ns() + (uint64_t)(rand_r(&r->seed) % r->spin_us) * 1000;
                 ts_now_ns() < t;) {}
    }
    /* A detach sets the cursor flag before it takes any entry back. */
    if (r->st == TS_E_DETACHED)
        CHECK(atomic_load(&c->ring->hdr->consumers[c->index].cursor) & TS_CURSOR_DETACHED);
    atomic_store(&r->done, 1);
    return NULL;
}

/* Check a racer after its thread ended and it was detached; 1 if it was detached for lag. */
static int dr_check(const fixture *fx, racer *r)
{
    ts_err err = {0};
    ts_acquired a;
    consumer *c = r->c;
    const ts_consumer *ce = &fx->prod->hdr->consumers[c->index];
    uint32_t reason = reason_of(fx->prod, c->index);
    if (!CHECK_EQ(r->st, TS_E_DETACHED)) printf("  consumer: %s\n", r->err.msg);
    CHECK_EQ(state_of(fx->prod, c->index), TS_CONSUMER_DETACHED);
    CHECK(reason == TS_REASON_LAGGED || reason == TS_REASON_DIED);
    CHECK(ce->cursor & TS_CURSOR_DETACHED); /* past its last entry, and any holes after it */
    CHECK((ce->cursor & ~TS_CURSOR_DETACHED) >= r->next);
    CHECK_EQ(ce->first_seq, c->start_seq);
    CHECK_EQ(ce->delivered, r->got);
    CHECK_EQ(ce->delivered_bytes, r->bytes);
    CHECK(!bit_in_use(fx->prod, 1ULL << c->index)); /* all released, the rest dropped */
    CHECK_ST(ts_ring_acquire(c->ring, deadline_ms(1000), &a, &err), TS_E_DETACHED);
    if (reason == TS_REASON_LAGGED) CHECK(strstr(err.msg, "max_lag=4") != NULL);
    return reason == TS_REASON_LAGGED;
}


/* batches_delivered counts batches handed out, once per consumer, not end markers (nor holes,
 * holes_all_kept), and outlives a consumer's leaving; publish_cpu_ns sums what the producer
 * notes. The counter has a cache line of its own. */
static void test_batches_delivered(void)
{
    fixture fx = {0};
    consumer A = {0}, B = {0};
    ts_err err = {0};
    ts_acquired a;
    ts_ring_info info;
    CHECK_EQ(offsetof(ts_header, batches_delivered) % 64, 0);
    CHECK_EQ(offsetof(ts_header, consumers) - offsetof(ts_header, batches_delivered), 64);
    REQUIRE(fx_create(&fx, 4, 2, 4096) == 0);
    REQUIRE(consumer_add(&fx, &A, 1) == 0 && consumer_add(&fx, &B, 1) == 0);
    PUBLISH(0);
    PUBLISH(1);
    REQUIRE_OK(publish_end(fx.prod, 0, 2, &err));
    TAKE(A, 0, 1);
    TAKE(A, 1, 1);
    CHECK_ST(ts_ring_acquire(A.ring, deadline_ms(1000), &a, &err), TS_OK);
    CHECK_EQ(a.kind, TS_ENTRY_END_EPOCH);
    ts_ring_release(A.ring, a.slot, A.index, A.ring->incarnation);
    TAKE(B, 0, 1);
    ts_ring_retire(fx.prod, B.index);
    ts_ring_snapshot(fx.prod, &info);
    CHECK_EQ(info.batches_delivered, 3);
    CHECK_EQ(fx.prod->hdr->consumers[A.index].delivered, 3); /* the marker counts there */
    CHECK_EQ(info.publish_cpu_ns, 0);
    ts_ring_note_publish_cpu(fx.prod, 5);
    ts_ring_note_publish_cpu(fx.prod, 7);
    ts_ring_snapshot(A.ring, &info);
    CHECK_EQ(info.publish_cpu_ns, 12);
    CHECK_EQ(info.batches_delivered, 3);
out:
    consumer_drop(&A);
    consumer_drop(&B);
    fx_destroy(&fx);
}

/* Detach (for lag by the producer, or by ts_ring_detach from a third thread) races acquire.
 * A third of the rounds run one slow consumer, which, alone, must never be detached for lag;
 * the others run a fast and a slow one, of which at most one, and only one more than max_lag
 * behind the other, is detached for lag. */
static void test_detach_race(void)
{
    fixture fx = {0};
    consumer cs[2] = {{0}};
    ts_err err = {0};
    race_producer pj = {.fx = &fx};
    pthread_t tp, tc[2];
    int rounds = 0, lagged = 0, singles = 0, started = 0;
    uint64_t entries = 0;
    unsigned seed = 20240611;
    ts_header *h = NULL;
    REQUIRE(fx_create(&fx, 8, 2, 4096) == 0);
    h = fx.prod->hdr;
    REQUIRE_OK(ts_ring_set_policy(fx.prod, 2, DR_MAX_LAG, &err));
    REQUIRE(pthread_create(&tp, NULL, dr_producer, &pj) == 0);
    started = 1;
    for (uint64_t until = deadline_ms(DR_BUDGET_MS);
         ts_now_ns() < until && rounds < DR_MAX_ROUNDS && atomic_load(&g_failed_checks) == 0;
         rounds++) {
        int kind = rounds % 3, n = kind == 0 ? 1 : 2, made = 0, ok = 1, lag_round = 0;
        racer rs[2];
        for (int i = 0; i < n; i++) /* the first of two is fast, the other one slow */
            rs[i] = (racer){.c = &cs[i], .seed = seed + 2 * (unsigned)rounds + (unsigned)i,
                            .period = n == 2 && i == 0 ? 64 : 16,
                            .spin_us = n == 2 && i == 0 ? 0 : 20};
        for (int i = 0; i < n && ok; i++) ok = consumer_add(&fx, &cs[i], 0) == 0;
        for (int i = 0; i < n && ok; i++)
            if ((ok = CHECK(pthread_create(&tc[i], NULL, dr_consumer, &rs[i]) == 0))) made++;
        for (int i = 0; i < made; i++) {
            ts_status st = ok ? ts_ring_activate(fx.prod, cs[i].index, 0, &cs[i].start_seq, &err)
                              : TS_E_INVALID;
            if (ok) ok = CHECK_ST(st, TS_OK);
            atomic_store(&rs[i].go, st == TS_OK ? 1 : -1);
        }
        /* Kind 0: one consumer, given 10 ms. Kind 1: detach them ourselves after a random
         * short while. Kind 2: until one is detached for lag, but never more than 100 ms. */
        uint64_t give_up = ts_now_ns() + (kind == 0   ? 10 * MS
                                          : kind == 1 ? (uint64_t)(rand_r(&seed) % 300) * 1000
                                                      : 100 * MS);
        for (int done = 0; ok && ts_now_ns() < give_up && done < (kind == 2 ? 1 : n);) {
            sleep_us(20);
            done = 0;
            for (int i = 0; i < n; i++) done += atomic_load(&rs[i].done);
        }
        for (int i = 0; i < n; i++)
            if (cs[i].ring != NULL) ts_ring_detach(fx.prod, cs[i].index, TS_REASON_DIED);
        for (int i = 0; i < made; i++) pthread_join(tc[i], NULL);
        if (ok) {
            for (int i = 0; i < n; i++) {
                if (!dr_check(&fx, &rs[i])) continue;
                /* The fastest consumer was more than max_lag ahead of its cursor when the
                 * producer looked; cursors only grow, and its cursor then was at least
                 * where it started. */
                lag_round++;
                if (n == 2) {
                    uint64_t other = cursor_of(fx.prod, cs[1 - i].index) & ~TS_CURSOR_DETACHED;
                    if (!CHECK(other > cs[i].start_seq + DR_MAX_LAG))
                        printf("    lagged from %llu, the other one at %llu\n",
                               (unsigned long long)cs[i].start_seq, (unsigned long long)other);
                }
            }
            if (n == 1) CHECK_EQ(lag_round, 0); /* alone, never a laggard */
            CHECK(lag_round <= 1);              /* the fastest is never behind */
            for (int i = 0; i < n; i++) entries += rs[i].got;
            lagged += lag_round;
            singles += n == 1;
        }
        for (int i = 0; i < n; i++) {
            if (cs[i].ring == NULL) continue;
            ts_ring_retire(fx.prod, cs[i].index);
            if (ok) CHECK_EQ(state_of(fx.prod, cs[i].index), TS_CONSUMER_FREE);
            consumer_drop(&cs[i]);
        }
        if (!ok) break;
    }
out:
    if (started) {
        atomic_store(&pj.stop, 1);
        pthread_join(tp, NULL);
        if (!CHECK_EQ(pj.st, TS_OK)) printf("  producer: %s\n", pj.err.msg);
        CHECK_EQ(h->lag_detached, lagged);
        CHECK(rounds >= 10);
        CHECK(singles > 0);
        CHECK(lagged > 0);
        CHECK(entries > 0);
        if (atomic_load(&g_failed_checks) != 0)
            printf("  %d rounds, %d lagged, %llu entries, %llu published\n", rounds, lagged,
                   (unsigned long long)entries, (unsigned long long)pj.n);
    }
    consumer_drop(&cs[0]);
    consumer_drop(&cs[1]);
    fx_destroy(&fx);
}

/* Streaming copies are exact at every size and (mis)alignment, and touch nothing beyond n;
 * a ring bigger than the cache streams its long runs, a small one never does. */
static void test_stream_copy(void)
{
    fixture fx = {0}, small = {0};
    consumer c = {0};
    ts_err err = {0};
    ts_acquired a;
    enum { BIG = (1 << 20) + 4133, PAD = 64 };
    uint8_t *src = malloc(BIG + PAD), *dst = malloc(BIG + 2 * PAD), *big = NULL;
    REQUIRE(src != NULL && dst != NULL);
    for (size_t i = 0; i < BIG + PAD; i++) src[i] = (uint8_t)(i * 131 + 7);
    static const size_t sizes[] = {0, 1, 15, 16, 17, 63, 64, 65, 127, 1000, 4096, BIG};
    for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++)
        for (size_t doff = 0; doff < 18; doff++)
            for (size_t soff = 0; soff < 4; soff += 3) {
                size_t n = sizes[k];
                memset(dst, 0xAB, BIG + 2 * PAD);
                ts_copy_stream(dst + PAD + doff, src + soff, n);
                int ok = memcmp(dst + PAD + doff, src + soff, n) == 0;
                for (size_t i = 0; i < PAD + doff; i++) ok &= dst[i] == 0xAB;
                for (size_t i = PAD + doff + n; i < BIG + 2 * PAD; i++) ok &= dst[i] == 0xAB;
                if (!CHECK(ok)) {
                    printf("  n=%zu dst+%zu src+%zu\n", n, doff, soff);
                    goto out;
                }
            }

    /* A small ring copies with memcpy; one bigger than the cache streams runs >= 1 MiB. */
    REQUIRE(fx_create(&small, 2, 1, 4096) == 0);
    CHECK(small.prod->stream_min == UINT64_MAX);
    uint64_t slot = ts_copy_cache_bytes() / 2 + (4u << 20);
    REQUIRE(fx_create(&fx, 2, 2, slot) == 0);
    CHECK_EQ(fx.prod->stream_min, ts_copy_can_stream() ? TS_STREAM_MIN_RUN : UINT64_MAX);
    REQUIRE(consumer_add(&fx, &c, 1) == 0);
    /* Leaf 0: 3 MiB + 5 bytes, contiguous; leaf 1: rows of 1 MiB + 3 from a wider array
     * (strided, so copied run by run, each run streamed). */
    const int64_t rows = 3, run = (1 << 20) + 3, pitch = run + 29;
    big = malloc((size_t)(3 << 20) + 5 + (size_t)(rows * pitch));
    REQUIRE(big != NULL);
    size_t n0 = (size_t)(3 << 20) + 5;
    for (size_t i = 0; i < n0 + (size_t)(rows * pitch); i++) big[i] = (uint8_t)(i * 7 + 1);
    const int64_t sh0[1] = {(int64_t)n0}, st0[1] = {1};
    const int64_t sh1[2] = {rows, run}, st1[2] = {pitch, 1};
    DLDataType u8 = {kDLUInt, 8, 1};
    ts_src_leaf leaves[2] = {{big, 1, sh0, st0, 1, u8}, {big + n0 + 1, 2, sh1, st1, 1, u8}};
    REQUIRE_OK(ts_ring_publish(fx.prod, TS_ENTRY_BATCH, 0, 0, leaves, 2, NULL, 0,
                               deadline_ms(5000), &err));
    REQUIRE_OK(ts_ring_acquire(c.ring, deadline_ms(5000), &a, &err));
    const ts_slot *s = ts_ring_slot(c.ring, a.slot);
    const uint8_t *d = ts_ring_slot_data(c.ring, a.slot);
    CHECK(memcmp(d + s->leaves[0].offset, big, n0) == 0);
    for (int64_t r = 0; r < rows; r++)
        CHECK(memcmp(d + s->leaves[1].offset + r * run, big + n0 + 1 + r * pitch,
                     (size_t)run) == 0);
    ts_ring_release(c.ring, a.slot, c.index, c.ring->incarnation);
out:
    consumer_drop(&c);
    fx_destroy(&fx);
    fx_destroy(&small);
    free(big);
    free(src);
    free(dst);
}

/* The int32 leaf of the entry a consumer acquired, through its handle (volatile: every
 * access below is a real load or store into the mapping). */
static volatile int32_t *leaf0_of(const ts_ring *r, uint32_t slot)
{
    uint8_t *data = ts_ring_slot_data(r, slot);
    return (volatile int32_t *)(data + ts_ring_slot(r, slot)->leaves[0].offset);
}

/* In a child: store v at p. What ended the child, and its stderr (into msg, cap bytes):
 * 1 if it was stopped by a fault (SIGSEGV; under a sanitizer, its report's abort or exit). */
static int child_write_faults(volatile int32_t *p, int32_t v, char *msg, size_t cap)
{
    int fds[2], status = 0;
    msg[0] = '\0';
    if (pipe(fds) != 0) return 0;
    fflush(stdout);
    fflush(stderr);
    pid_t child = fork();
    if (child < 0) return 0;
    if (child == 0) {
        dup2(fds[1], STDERR_FILENO);
        close(fds[0]);
        *p = v;
        _exit(0); /* the write went through */
    }
    close(fds[1]);
    size_t n = 0;
    ssize_t got;
    while (n + 1 < cap && (got = read(fds[0], msg + n, cap - 1 - n)) > 0) n += (size_t)got;
    msg[n] = '\0';
    close(fds[0]);
    if (waitpid(child, &status, 0) != child) return 0;
#if defined(__SANITIZE_ADDRESS__)
    return !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
#else
    return WIFSIGNALED(status) && WTERMSIG(status) == SIGSEGV;
#endif
}

/* A consumer's write into a batch it holds lands on a private copy: the producer and a second
 * consumer still read the published bytes, and only the written page is copied. When the
 * consumer gives the slot back its shared view is back, so the next batch in that slot reads
 * as published. A write into a slot it does not hold (published, not yet acquired; or given
 * back) still faults, naming the cause; so does one into a forbidden (CUDA-registered)
 * mapping. The last of two holds restores; a restore that fails breaks the ring handle. */
static void test_copy_on_write(void)
{
    fixture fx = {0};
    consumer c = {0}, d = {0};
    ts_err err = {0};
    ts_acquired a, b;
    char msg[2048];
    REQUIRE(fx_create(&fx, 2, 2, 3 * 4096) == 0); /* a slot is 3 pages */
    REQUIRE(consumer_add(&fx, &c, 1) == 0);
    REQUIRE(consumer_add(&fx, &d, 1) == 0);
    CHECK(c.ring->fd >= 0);      /* a consumer keeps the segment fd to remap slots */
    CHECK_EQ(fx.prod->fd, -1);   /* the producer does not need it */
    CHECK(ts_ring_host_writable(c.ring) && ts_ring_host_writable(fx.prod));
    PUBLISH(0);
    PUBLISH(1);

    /* c writes into entry 0 (slot 0): private to c. */
    TAKE(c, 0, 0);
    uint32_t k = a.slot;
    volatile int32_t *x = leaf0_of(c.ring, k);
    volatile uint8_t *page2 = ts_ring_slot_data(c.ring, k) + 2 * 4096;
    CHECK_EQ(ts_fault_private_slots(&c.ring->cow), 0);
    x[3] = -7;
    x[4] += 1000;
    CHECK_EQ(x[3], -7);
    CHECK_EQ(x[4], 1004);
    CHECK_EQ(ts_fault_private_slots(&c.ring->cow), 1);
    CHECK_EQ(page2[0], 0); /* unwritten pages still read the shared file */
    CHECK_EQ(leaf0_of(fx.prod, k)[3], 3); /* the producer's view is untouched */
    TAKE(d, 0, 0); /* entry_ok: d reads every published byte of entry 0 */
    CHECK_EQ(leaf0_of(d.ring, k)[3], 3);
    CHECK_EQ(ts_fault_private_slots(&d.ring->cow), 0);
    b = a;
    /* The producer writes into the slot's untouched page (it never does while the slot is
     * held; here it shows that page is still shared) and c sees it; c's written page not. */
    ((uint8_t *)ts_ring_slot_data(fx.prod, k))[2 * 4096] = 0x5a;
    CHECK_EQ(page2[0], 0x5a);
    ((uint8_t *)ts_ring_slot_data(fx.prod, k))[2 * 4096] = 0;

    /* Entry 1 is published but c has not acquired it: a write there faults. */
    CHECK(child_write_faults(leaf0_of(c.ring, 1 - k), 1, msg, sizeof msg));
    CHECK(strstr(msg, "tensorsocket: this process wrote into a batch tensor") != NULL);
    CHECK(strstr(msg, "no longer holds") != NULL);
    CHECK_EQ(leaf0_of(fx.prod, 1 - k)[0], 100);

    /* Released: the shared view is back, before the producer may refill the slot. */
    ts_ring_release(c.ring, k, c.index, c.ring->incarnation);
    CHECK_EQ(ts_fault_private_slots(&c.ring->cow), 0);
    CHECK_EQ(x[3], 3);
    CHECK_EQ(x[4], 4);
    CHECK(child_write_faults(x, 1, msg, sizeof msg)); /* no longer held */
    ts_ring_release(d.ring, b.slot, d.index, d.ring->incarnation);
    PUBLISH(2); /* into slot 0 */
    TAKE(c, 1, 1);
    TAKE(c, 2, 0); /* entry_ok: c reads entry 2 as published, in the slot it wrote into */
    CHECK_EQ(a.slot, k);
    TAKE(d, 1, 1);
    TAKE(d, 2, 0);

    /* Two holds of one slot (a handle bound again while its old batches live): the last one
     * restores. */
    x[0] = -1;
    CHECK_EQ(ts_fault_private_slots(&c.ring->cow), 1);
    ts_fault_take(&c.ring->cow, k);
    CHECK_EQ(ts_fault_give_begin(&c.ring->cow, k), 0); /* not the last hold */
    CHECK_EQ(x[0], -1);
    CHECK_EQ(ts_fault_private_slots(&c.ring->cow), 1);

    /* No page-locking while a slot is private; once forbidden, writes fault as before. */
    CHECK_EQ(ts_fault_forbid(&c.ring->cow), EBUSY);
    CHECK(ts_ring_host_writable(c.ring));
    ts_ring_release(c.ring, k, c.index, c.ring->incarnation);
    CHECK_EQ(x[0], 200);
    CHECK_EQ(ts_fault_forbid(&c.ring->cow), 0);
    CHECK(!ts_ring_host_writable(c.ring));
    PUBLISH(3); /* slot 1 */
    TAKE(c, 3, 0);
    CHECK(child_write_faults(leaf0_of(c.ring, a.slot), 1, msg, sizeof msg));
    CHECK(strstr(msg, "page-locked for CUDA") != NULL);
    ts_fault_allow(&c.ring->cow);
    CHECK(ts_ring_host_writable(c.ring));

    /* A restore that fails (here: a bad fd) leaves nothing stale readable, and the handle
     * hands out no further batch; the slot goes back to the producer all the same. */
    leaf0_of(c.ring, a.slot)[0] = 7;
    CHECK_EQ(leaf0_of(c.ring, a.slot)[0], 7);
    int fd = c.ring->cow.fd;
    c.ring->cow.fd = -1;
    ts_ring_release(c.ring, a.slot, c.index, c.ring->incarnation);
    c.ring->cow.fd = fd;
    CHECK_EQ(readers_of(fx.prod, a.slot) & (1ULL << c.index), 0);
    CHECK_EQ(c.ring->cow.broken, EBADF);
    CHECK_ST(ts_ring_acquire(c.ring, deadline_ms(100), &b, &err), TS_E_SYS);
    CHECK(strstr(err.msg, "could not be mapped back") != NULL);
    CHECK(child_write_faults(leaf0_of(c.ring, a.slot), 1, msg, sizeof msg));
    TAKE(d, 3, 1); /* the others are unaffected */
out:
    consumer_drop(&c);
    consumer_drop(&d);
    fx_destroy(&fx);
}

/* 1 if the page holding p is mapped in this process (msync fails with ENOMEM if not). */
static int page_mapped(const volatile void *p)
{
    uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    return msync((void *)((uintptr_t)p / page * page), page, MS_ASYNC) == 0;
}

/* ts_ring_held_blocking: a consumer's holds block only once one is the slot the producer
 * must reuse next (the ring wrapped onto it); a release ends that. */
static void test_held_blocking(void)
{
    fixture fx = {0};
    consumer c = {0};
    ts_err err = {0};
    ts_acquired a;
    REQUIRE(fx_create(&fx, 2, 2, 3 * 4096) == 0);
    REQUIRE(consumer_add(&fx, &c, 1) == 0);
    PUBLISH(0);
    TAKE(c, 0, 0);
    CHECK_EQ(ts_ring_held_slots(c.ring), 1);
    CHECK_EQ(ts_ring_held_blocking(c.ring), 0); /* the producer has a free slot */
    PUBLISH(1);
    CHECK_EQ(ts_ring_held_blocking(c.ring), 1); /* entry 2 goes where entry 0 is held */
    ts_ring_release(c.ring, a.slot, c.index, c.ring->incarnation);
    CHECK_EQ(ts_ring_held_slots(c.ring), 0);
    CHECK_EQ(ts_ring_held_blocking(c.ring), 0);
out:
    consumer_drop(&c);
    fx_destroy(&fx);
}

/* Setting a handle aside: the slots it holds become private copies and go back to the
 * producer at once, so the producer refills them while the views still read what they
 * read (and stay writable); their releases then drop no bit (by then the slot is another
 * entry's, read by this consumer too) and unmap the copies; the handle reads no more, and
 * the rest of its mapping is unmapped at once. And a fork: the child gets
 * private copies of the slots the parent held (ts_fault_fork_*), so the parent's release
 * and the producer's refill do not change what the child reads. */
static void test_set_aside(void)
{
    fixture fx = {0};
    consumer c = {0};
    ts_err err = {0};
    ts_acquired a, b;
    REQUIRE(fx_create(&fx, 2, 2, 3 * 4096) == 0);
    REQUIRE(consumer_add(&fx, &c, 1) == 0);
    PUBLISH(0);
    PUBLISH(1);
    TAKE(c, 0, 0);
    uint32_t k = a.slot;
    volatile int32_t *x = leaf0_of(c.ring, k);
    uint64_t bit = 1ULL << c.index;
    CHECK_EQ(ts_ring_held_slots(c.ring), 1);
    CHECK_EQ(readers_of(fx.prod, k), bit);
    CHECK_ST(ts_ring_set_aside(c.ring, &err), TS_OK);
    CHECK_EQ(readers_of(fx.prod, k), 0); /* handed back */
    CHECK_EQ(ts_ring_held_slots(c.ring), 0);
    CHECK_EQ(ts_fault_private_slots(&c.ring->cow), 1);
    PUBLISH(2); /* refills slot k at once */
    CHECK_EQ(leaf0_of(fx.prod, k)[3], 203);
    CHECK_EQ(x[3], 3); /* the view still reads entry 0, every page of it */
    x[3] = -5;
    CHECK_EQ(x[3], -5);
    CHECK_ST(ts_ring_acquire(c.ring, deadline_ms(100), &b, &err), TS_E_INVALID);
    CHECK(strstr(err.msg, "set aside") != NULL);
    CHECK_EQ(readers_of(fx.prod, k), bit); /* entry 2 waits for c */
    CHECK(!page_mapped(leaf0_of(c.ring, 1 - k))); /* the rest of the mapping is gone */
    ts_ring_release(c.ring, k, c.index, c.ring->incarnation);
    CHECK_EQ(readers_of(fx.prod, k), bit); /* not dropped a second time */
    CHECK(!page_mapped(x)); /* the copy is gone */

    /* A second handle of the same consumer reads on. */
    ts_ring *again = NULL;
    REQUIRE(CHECK_ST(ts_ring_open(fx.name, &again, &err), TS_OK));
    REQUIRE(CHECK_ST(ts_ring_bind_consumer(again, c.index, c.token, &err), TS_OK));
    REQUIRE(CHECK_ST(ts_ring_acquire(again, deadline_ms(1000), &b, &err), TS_OK));
    CHECK_EQ(b.seq, 1);
    CHECK(entry_ok(again, &b, 1));

    /* Fork while holding entry 1: the child reads it as it was after the parent released
     * it and the producer refilled its slot. */
    volatile int32_t *y = leaf0_of(again, b.slot);
    int go[2], done[2];
    REQUIRE(pipe(go) == 0 && pipe(done) == 0);
    ts_fault_fork_prepare();
    pid_t child = fork();
    if (child == 0) {
        ts_fault_fork_child();
        char ch;
        int ok = read(go[0], &ch, 1) == 1 && y[0] == 100 && y[7] == 107;
        ssize_t w = write(done[1], ok ? "y" : "n", 1);
        (void)w;
        _exit(0);
    }
    ts_fault_fork_parent();
    REQUIRE(child > 0);
    ts_ring_release(again, b.slot, c.index, (again)->incarnation);
    REQUIRE(CHECK_ST(ts_ring_acquire(again, deadline_ms(1000), &a, &err), TS_OK)); /* 2 */
    ts_ring_release(again, a.slot, c.index, (again)->incarnation);
    PUBLISH(3); /* into entry 1's slot */
    CHECK_EQ(leaf0_of(fx.prod, b.slot)[0], 300);
    char verdict = 0;
    CHECK_EQ(write(go[1], "g", 1), 1);
    CHECK_EQ(read(done[0], &verdict, 1), 1);
    CHECK_EQ(verdict, 'y');
    int status = 0;
    CHECK_EQ(waitpid(child, &status, 0), child);
    close(go[0]);
    close(go[1]);
    close(done[0]);
    close(done[1]);
    ts_ring_unref(again);
out:
    consumer_drop(&c);
    fx_destroy(&fx);
}

/* Files this process has open. */
static int open_fds(void)
{
    int n = 0;
    DIR *d = opendir("/proc/self/fd");
    if (d == NULL) return -1;
    while (readdir(d) != NULL) n++;
    closedir(d);
    return n;
}

/* Publish entry r for test_set_aside_many: int32[2048] = r (two pages), then int64[2] =
 * {r, -r} on the third page. */
static ts_status publish_two_sizes(ts_ring *prod, uint64_t r, ts_err *err)
{
    static int32_t big[2048];
    int64_t small[2] = {(int64_t)r, -(int64_t)r};
    static const int64_t big_shape[1] = {2048}, small_shape[1] = {2};
    static const int64_t big_stride[1] = {4}, small_stride[1] = {8};
    for (int j = 0; j < 2048; j++) big[j] = (int32_t)r;
    ts_src_leaf leaves[2] = {{big, 1, big_shape, big_stride, 4, {kDLInt, 32, 1}},
                             {small, 1, small_shape, small_stride, 8, {kDLInt, 64, 1}}};
    return ts_ring_publish(prod, TS_ENTRY_BATCH, 0, r, leaves, 2, NULL, 0, deadline_ms(1000),
                           err);
}

/* A consumer that keeps a small piece of every entry sets a handle aside each time, far
 * more often than fault handling has places for mappings (TS_FAULT_WATCHED): each handle
 * keeps only the pages of the leaves still used (the small leaf's page; the big leaf's go
 * once its tensor does, the slot's unused tail at once) and no fd, every kept piece reads
 * its entry for ever, writes into it stay private, and the producer never waits. */
static void test_set_aside_many(void)
{
    enum { ROUNDS = 3 * TS_FAULT_WATCHED };
    fixture fx = {0};
    consumer c = {0};
    ts_err err = {0};
    ts_acquired a;
    DLManagedTensor *kept[ROUNDS] = {0};
    int n_kept = 0;
    REQUIRE(fx_create(&fx, 2, 2, 4 * 4096) == 0);
    REQUIRE(consumer_add(&fx, &c, 1) == 0);
    int fds = open_fds();
    for (uint64_t r = 0; r < ROUNDS; r++) {
        REQUIRE_OK(publish_two_sizes(fx.prod, r, &err));
        REQUIRE(CHECK_ST(ts_ring_acquire(c.ring, deadline_ms(1000), &a, &err), TS_OK));
        ts_lease *lease = ts_lease_new(c.ring, a.slot, a.seq);
        REQUIRE(lease != NULL);
        DLManagedTensor *big = export_leaf(lease, 0, 0, 0, 0, &err);
        DLManagedTensor *small = export_leaf(lease, 1, 0, 0, 0, &err);
        ts_lease_unref(lease, TS_USE_WHOLE);
        REQUIRE(big != NULL && small != NULL);
        volatile int32_t *b = big->dl_tensor.data;
        volatile int64_t *s = small->dl_tensor.data;
        kept[n_kept++] = small;
        uint32_t k = a.slot;
        if (!CHECK_ST(ts_ring_set_aside(c.ring, &err), TS_OK)) break;
        CHECK_EQ(readers_of(fx.prod, k), 0); /* handed back at once */
        CHECK(page_mapped(b) && b[2047] == (int32_t)r); /* still alive: kept */
        CHECK(!page_mapped(s + 512)); /* the slot's unused last page is gone */
        big->deleter(big);
        CHECK(!page_mapped(b) && !page_mapped(b + 1024)); /* its two pages went with it */
        CHECK(page_mapped(s) && s[0] == (int64_t)r && s[1] == -(int64_t)r);
        s[1] = 7; /* private to this process */
        ts_ring *next = NULL;
        REQUIRE(CHECK_ST(ts_ring_open(fx.name, &next, &err), TS_OK));
        REQUIRE(CHECK_ST(ts_ring_bind_consumer(next, c.index, c.token, &err), TS_OK));
        ts_ring_unref(c.ring); /* the kept piece keeps the old handle */
        c.ring = next;
    }
    CHECK_EQ(n_kept, ROUNDS);
    CHECK(open_fds() <= fds + 1);
    for (int r = 0; r < n_kept; r++) {
        volatile int64_t *s = kept[r]->dl_tensor.data;
        if (!CHECK(s[0] == r && s[1] == 7)) break;
    }
    for (int r = 0; r < n_kept; r++) {
        volatile int64_t *s = kept[r]->dl_tensor.data;
        kept[r]->deleter(kept[r]);
        CHECK(!page_mapped(s)); /* the last release unmaps what was kept */
        kept[r] = NULL;
    }
out:
    for (int r = 0; r < n_kept; r++)
        if (kept[r] != NULL) kept[r]->deleter(kept[r]);
    consumer_drop(&c);
    fx_destroy(&fx);
}

/* The ranks of a group start in one step at one entry, with every entry from it on held
 * for each of them; a consumer not waiting to start makes the whole call fail. */
static void test_activate_group(void)
{
    fixture fx = {0};
    consumer c = {0}, d = {0};
    ts_err err = {0};
    ts_acquired a;
    REQUIRE(fx_create(&fx, 4, 2, 4096) == 0);
    REQUIRE(consumer_add(&fx, &c, 1) == 0); /* keeps every entry in the ring */
    for (uint64_t t = 0; t < 3; t++) PUBLISH(t);
    consumer r0 = {0}, r1 = {0};
    REQUIRE(consumer_add(&fx, &r0, 0) == 0);
    REQUIRE(consumer_add(&fx, &r1, 0) == 0);
    uint32_t both[2] = {r0.index, r1.index};
    uint64_t start = 99;
    REQUIRE(CHECK_ST(ts_ring_activate_group(fx.prod, both, 2, 1, 1, &start, &err), TS_OK));
    CHECK_EQ(start, 1);
    CHECK_EQ(cursor_of(fx.prod, r0.index), 1);
    CHECK_EQ(cursor_of(fx.prod, r1.index), 1);
    uint64_t bits = (1ULL << r0.index) | (1ULL << r1.index);
    CHECK_EQ(readers_of(fx.prod, 1) & bits, bits);
    CHECK_EQ(readers_of(fx.prod, 2) & bits, bits);
    CHECK_EQ(readers_of(fx.prod, 0) & bits, 0);
    TAKE(r0, 1, 1);
    TAKE(r1, 1, 1);
    REQUIRE(consumer_add(&fx, &d, 0) == 0);
    uint32_t again[2] = {d.index, r0.index}; /* r0 is active already */
    CHECK_ST(ts_ring_activate_group(fx.prod, again, 2, 0, TS_SEQ_NONE, &start, &err),
             TS_E_INVALID);
    CHECK_EQ(cursor_of(fx.prod, d.index), TS_SEQ_NONE); /* nothing of it happened */
out:
    consumer_drop(&r0);
    consumer_drop(&r1);
    consumer_drop(&c);
    consumer_drop(&d);
    fx_destroy(&fx);
}

/* A consumer that left its epoch with break keeps its place at the next epoch: its unread
 * entries are dropped at once, it gets none of the rest of the epoch (nobody waits for
 * it), and receives again from the first entry after the end marker. */
static void test_await_next_epoch(void)
{
    fixture fx = {0};
    consumer c = {0};
    ts_err err = {0};
    ts_acquired a;
    REQUIRE(fx_create(&fx, 4, 2, 4096) == 0);
    REQUIRE(consumer_add(&fx, &c, 1) == 0);
    uint64_t bit = 1ULL << c.index;
    PUBLISH(0);
    PUBLISH(1);
    TAKE(c, 0, 1);
    CHECK_ST(ts_ring_await_next_epoch(fx.prod, c.index, &err), TS_OK);
    CHECK_EQ(readers_of(fx.prod, 1) & bit, 0); /* its unread entry is dropped */
    PUBLISH(2);
    CHECK_EQ(readers_of(fx.prod, 2) & bit, 0); /* the rest of the epoch is not for it */
    CHECK_ST(ts_ring_acquire(c.ring, deadline_ms(50), &a, &err), TS_E_TIMEOUT);
    REQUIRE_OK(publish_end(fx.prod, 0, 3, &err)); /* seq 3 */
    CHECK_EQ(readers_of(fx.prod, 3) & bit, 0);
    CHECK_EQ(cursor_of(fx.prod, c.index), 4);
    PUBLISH(4);
    CHECK_EQ(readers_of(fx.prod, 0) & bit, bit); /* seq 4 is in slot 0 */
    TAKE(c, 4, 1);
    /* The end marker already published: the place is right after it, at once. */
    PUBLISH(5);
    REQUIRE_OK(publish_end(fx.prod, 1, 6, &err)); /* seq 6 */
    PUBLISH(7);
    TAKE(c, 5, 1);
    CHECK_ST(ts_ring_await_next_epoch(fx.prod, c.index, &err), TS_OK);
    CHECK_EQ(cursor_of(fx.prod, c.index), 7);
    CHECK_EQ(readers_of(fx.prod, 6 % 4) & bit, 0);
    CHECK_EQ(readers_of(fx.prod, 7 % 4) & bit, bit);
    TAKE(c, 7, 1);
    CHECK_ST(ts_ring_await_next_epoch(fx.prod, 63, &err), TS_E_INVALID); /* not active */
out:
    consumer_drop(&c);
    fx_destroy(&fx);
}

/* An acquire with TS_DEADLINE_NOW takes what is published and never waits: no waiter is
 * registered, and a finished ring still says so. */
static void test_try_acquire(void)
{
    fixture fx = {0};
    consumer c = {0};
    ts_err err = {0};
    ts_acquired a;
    REQUIRE(fx_create(&fx, 4, 4, 4096) == 0);
    REQUIRE(consumer_add(&fx, &c, 1) == 0);
    uint64_t t0 = ts_now_ns();
    CHECK_ST(ts_ring_acquire(c.ring, TS_DEADLINE_NOW, &a, &err), TS_E_TIMEOUT);
    CHECK(ts_now_ns() - t0 < 50000000ULL); /* no sleep (50 ms: a loaded machine) */
    CHECK_EQ(fx.prod->hdr->pub_waiters, 0);
    CHECK_EQ(cursor_of(fx.prod, c.index), 0);
    PUBLISH(0);
    PUBLISH(1);
    REQUIRE_OK(ts_ring_acquire(c.ring, TS_DEADLINE_NOW, &a, &err));
    CHECK_EQ(a.seq, 0);
    CHECK(entry_ok(c.ring, &a, 0));
    ts_ring_release(c.ring, a.slot, c.index, c.ring->incarnation);
    TAKE(c, 1, 1);
    CHECK_ST(ts_ring_acquire(c.ring, TS_DEADLINE_NOW, &a, &err), TS_E_TIMEOUT);
    ts_ring_finish(fx.prod);
    CHECK_ST(ts_ring_acquire(c.ring, TS_DEADLINE_NOW, &a, &err), TS_E_FINISHED);
out:
    consumer_drop(&c);
    fx_destroy(&fx);
}

/* Publisher of await_race: epochs of 12 empty batches and an end marker each, as fast as
 * the ring lets it (j->n epochs). */
static void *epochs_run(void *p)
{
    job *j = p;
    for (uint64_t e = 0; e < j->n && j->st == TS_OK; e++) {
        for (uint64_t i = 0; i < 12 && j->st == TS_OK; i++)
            j->st = ts_ring_publish(j->fx->prod, TS_ENTRY_BATCH, e, i, NULL, 0, NULL, 0,
                                    deadline_ms(5000), &j->err);
        if (j->st == TS_OK) j->st = publish_end(j->fx->prod, e, 12, &j->err);
    }
    return NULL;
}

/* await_next_epoch racing publish (the control thread and the producer's loop share the
 * producer handle): a consumer that leaves an epoch after k of its batches, at random
 * moments against a publisher that runs ahead, always goes on at the next epoch's first
 * batch; one that reads a whole epoch gets its end marker, then the next epoch. */
static void test_await_race(void)
{
    fixture fx = {0};
    consumer c = {0};
    ts_err err = {0};
    ts_acquired a;
    enum { EPOCHS = 20000 };
    job pj = {.fx = &fx, .n = EPOCHS};
    pthread_t t;
    int started = 0;
    unsigned seed = 12345;
    REQUIRE(fx_create(&fx, 14, 2, 4096) == 0);
    REQUIRE(consumer_add(&fx, &c, 1) == 0);
    REQUIRE(pthread_create(&t, NULL, epochs_run, &pj) == 0);
    started = 1;
    for (uint64_t e = 0; e + 1 < EPOCHS;) {
        uint64_t k = 1 + (uint64_t)(rand_r(&seed) % 12); /* 12: the whole epoch */
        for (uint64_t i = 0; i < k; i++) {
            REQUIRE_OK(ts_ring_acquire(c.ring, deadline_ms(5000), &a, &err));
            if (!CHECK_EQ(a.epoch, e) || !CHECK_EQ(a.index, i) ||
                !CHECK_EQ(a.kind, TS_ENTRY_BATCH)) {
                printf("    epoch %llu, batch %llu of %llu\n", (unsigned long long)e,
                       (unsigned long long)i, (unsigned long long)k);
                goto out;
            }
            ts_ring_release(c.ring, a.slot, c.index, c.ring->incarnation);
        }
        if (k == 12) { /* read on: the end marker comes next */
            REQUIRE_OK(ts_ring_acquire(c.ring, deadline_ms(5000), &a, &err));
            CHECK_EQ(a.kind, TS_ENTRY_END_EPOCH);
            ts_ring_release(c.ring, a.slot, c.index, c.ring->incarnation);
        } else {
            if (rand_r(&seed) % 2) sched_yield(); /* let the publisher run ahead, or not */
            REQUIRE_OK(ts_ring_await_next_epoch(fx.prod, c.index, &err));
        }
        e++;
    }
out:
    if (started) ts_ring_finish(fx.prod); /* ends a publisher still waiting for a slot */
    consumer_drop(&c);
    if (started) pthread_join(t, NULL);
    fx_destroy(&fx);
}

/* A late release after eviction (issue 23, item 5): consumer A holds entry 0 through a lease,
 * is evicted, and consumer B gets A's table index and holds the same slot (a late joiner's
 * window). A's lease dies only now, as a deferred GPU release or a stopped process that runs
 * again would let it: that release names A's incarnation, which is no longer the index's, so
 * B's hold survives (the producer cannot refill the slot) and the release is counted. A
 * release under way when the entry is free again keeps it from being handed out, unless the
 * process releasing died. */
static void test_late_release(void)
{
    fixture fx = {0};
    consumer A = {0}, B = {0}, C = {0}, D = {0};
    ts_err err = {0};
    ts_acquired a;
    ts_lease *lease = NULL;
    ts_ring_info info;
    REQUIRE(fx_create(&fx, 4, 2, 4096) == 0);
    ts_header *h = fx.prod->hdr;
    REQUIRE_OK(ts_ring_set_policy(fx.prod, 2, 0, &err));
    REQUIRE(consumer_add(&fx, &A, 1) == 0);
    uint64_t bit = 1ULL << A.index;
    PUBLISH(0);
    TAKE(A, 0, 0);
    REQUIRE(a.slot == 0);
    lease = ts_lease_new(A.ring, a.slot, a.seq); /* A's view of entry 0 */
    REQUIRE(lease != NULL);
    CHECK_EQ(lease->token, A.ring->incarnation);
    ts_ring_evict(fx.prod, A.index); /* taken for dead; its lease lives on */
    CHECK_EQ(readers_of(fx.prod, 0), 0);
    CHECK(h->consumers[A.index].gate >> TS_GATE_SHIFT != A.ring->incarnation);

    /* B joins on A's index; the window gives it entry 0, in the slot A's lease still names. */
    REQUIRE(consumer_add(&fx, &B, 1) == 0);
    REQUIRE(CHECK_EQ(B.index, A.index));
    CHECK(B.ring->incarnation != A.ring->incarnation);
    CHECK_EQ(B.start_seq, 0);
    TAKE(B, 0, 0);
    CHECK_EQ(a.slot, 0);
    CHECK_EQ(readers_of(fx.prod, 0), bit);

    /* A's late release: B's bit stays, the release is counted. */
    ts_lease_unref(lease, TS_USE_WHOLE);
    lease = NULL;
    CHECK_EQ(readers_of(fx.prod, 0), bit);
    ts_ring_snapshot(fx.prod, &info);
    CHECK_EQ(info.late_releases, 1);
    /* The same through the plain call (an acquire given back) and on A's handle. */
    ts_ring_release(A.ring, 0, A.index, A.ring->incarnation);
    CHECK_EQ(readers_of(fx.prod, 0), bit);
    CHECK_EQ(h->late_releases, 2);
    CHECK_EQ(h->consumers[B.index].gate & TS_GATE_COUNT, 0);

    /* The producer comes round: slot 0 stays B's, its content entry 0's. */
    for (uint64_t t = 1; t < 4; t++) PUBLISH(t);
    for (uint64_t t = 1; t < 4; t++) TAKE(B, t, 1);
    CHECK_ST(publish_tagged(fx.prod, 4, deadline_ms(20), &err), TS_E_TIMEOUT);
    CHECK_EQ(seq_of(fx.prod, 0), 0);
    CHECK(content_ok(B.ring, 0, 0));
    ts_ring_release(B.ring, 0, B.index, B.ring->incarnation); /* B's own release works */
    CHECK_EQ(readers_of(fx.prod, 0), 0);
    CHECK_EQ(h->late_releases, 2);
    PUBLISH(4);
    TAKE(B, 4, 1);

    /* A release of B's under way (entered, its bit not yet cleared: a stopped process) when
     * B is evicted: the entry is not handed out while its process lives... */
    ts_consumer *cb = &h->consumers[B.index];
    atomic_fetch_add_explicit(&cb->gate, 1, memory_order_acq_rel);
    ts_ring_evict(fx.prod, B.index);
    REQUIRE(consumer_add(&fx, &C, 0) == 0);
    CHECK(C.index != B.index);
    atomic_fetch_sub_explicit(&cb->gate, 1, memory_order_acq_rel); /* ...done: it is */
    REQUIRE(consumer_add(&fx, &D, 0) == 0);
    CHECK_EQ(D.index, B.index);
    ts_ring_retire(fx.prod, D.index);
    /* ...or its process died in the release. */
    pid_t dead = fork();
    REQUIRE(dead >= 0);
    if (dead == 0) _exit(0);
    REQUIRE(waitpid(dead, NULL, 0) == dead);
    ts_consumer *cd = &h->consumers[D.index];
    atomic_fetch_add_explicit(&cd->gate, 1, memory_order_acq_rel);
    cd->pid = (int32_t)dead;
    consumer_drop(&D);
    REQUIRE(consumer_add(&fx, &D, 0) == 0);
    CHECK_EQ(D.index, B.index);
    CHECK_EQ(cd->gate & TS_GATE_COUNT, 0);
out:
    if (lease != NULL) ts_lease_unref(lease, TS_USE_WHOLE);
    consumer_drop(&A), consumer_drop(&B), consumer_drop(&C), consumer_drop(&D);
    fx_destroy(&fx);
}

/* A late release racing the eviction of its consumer and the next incarnation's start. */
typedef struct race_job {
    consumer *c;
    uint32_t slot;
    int when;              /* release once phase >= when (0: before the eviction) */
    uint32_t spins;        /* then after this many yields */
    _Atomic int *phase;    /* 1: being evicted, 2: the new consumer holds the slot */
    _Atomic int released;
} race_job;

/* Release the old consumer's hold at the moment the job names. */
static void *race_release_run(void *p)
{
    race_job *j = p;
    while (atomic_load_explicit(j->phase, memory_order_acquire) < j->when) sched_yield();
    for (uint32_t i = 0; i < j->spins; i++) sched_yield();
    ts_ring_release(j->c->ring, j->slot, j->c->index, j->c->ring->incarnation);
    atomic_store_explicit(&j->released, 1, memory_order_release);
    return NULL;
}

/* Late releases racing the producer: on another thread, consumer A's release of the entry it
 * holds comes before, during or after A's eviction and the start of consumer B, which may
 * get A's index and whose window gives it the same entry. Whatever the order, B's bit is in
 * the slot once all is done: a release under way when the index is handed out keeps it from
 * being handed out (B gets another), a later one clears nothing. */
static void test_late_release_race(void)
{
    fixture fx = {0};
    consumer A = {0}, B = {0};
    ts_err err = {0};
    ts_acquired a;
    _Atomic int phase = 0;
    unsigned seed = 4242;
    uint32_t same = 0, late = 0;
    REQUIRE(fx_create(&fx, 4, 2, 4096) == 0);
    REQUIRE_OK(ts_ring_set_policy(fx.prod, 2, 0, &err));
    for (uint64_t t = 0; t < 400; t++) {
        REQUIRE(consumer_add(&fx, &A, 1) == 0);
        PUBLISH(t);
        for (uint64_t q = A.start_seq; q < t; q++) TAKE(A, q, 1); /* the window's older ones */
        TAKE(A, t, 0);
        atomic_store(&phase, 0);
        uint64_t late_before = fx.prod->hdr->late_releases;
        race_job j = {&A, a.slot, (int)(rand_r(&seed) % 3), (uint32_t)(rand_r(&seed) % 8), &phase,
                      0};
        pthread_t th;
        REQUIRE(pthread_create(&th, NULL, race_release_run, &j) == 0);
        while (j.when == 0 && !atomic_load_explicit(&j.released, memory_order_acquire))
            sched_yield();
        atomic_store_explicit(&phase, 1, memory_order_release);
        ts_ring_evict(fx.prod, A.index);
        int added = consumer_add(&fx, &B, 1) == 0;
        atomic_store_explicit(&phase, 2, memory_order_release);
        pthread_join(th, NULL);
        REQUIRE(added);
        same += B.index == A.index;
        if (!CHECK(readers_of(fx.prod, j.slot) & (1ULL << B.index))) {
            printf("    round %llu: released at phase %d, B on index %u (A's: %u)\n",
                   (unsigned long long)t, j.when, B.index, A.index);
            goto out;
        }
        late += fx.prod->hdr->late_releases != late_before;
        if (j.when == 0) CHECK_EQ(fx.prod->hdr->late_releases, late_before); /* not late */
        for (uint64_t q = B.start_seq; q <= t; q++) TAKE(B, q, 1); /* t is in its window */
        for (uint32_t k = 0; k < 4; k++) CHECK_EQ(readers_of(fx.prod, k), 0);
        ts_ring_retire(fx.prod, B.index);
        consumer_drop(&A), consumer_drop(&B);
    }
    printf("    %u of 400 rounds gave B A's index, %u releases came late\n", same, late);
    CHECK(same > 0 && late > 0);
out:
    consumer_drop(&A), consumer_drop(&B);
    fx_destroy(&fx);
}

/* ---- registry and main ------------------------------------------------------------ */

/* Setting aside a handle bound again since it took a hold (a consumer that rejoined
 * after its first set-aside could not copy): the old entry's hold is dropped as the
 * incarnation that took it, so the slot goes back and the old entry does not stay LEAVING
 * (review 1). */
static void test_set_aside_rebound(void)
{
    fixture fx = {0};
    consumer c = {0};
    ts_err err = {0};
    ts_acquired a;
    ts_ring_info info;
    uint32_t dummy = 0, ib = 0;
    uint64_t token = 0, tokb = 0, start = 0;
    pid_t pid = getpid();
    REQUIRE(fx_create(&fx, 2, 2, 3 * 4096) == 0);
    /* Entry 0 handed out and given back once: c gets it at incarnation 2, entry 1 comes
     * later at incarnation 1. */
    REQUIRE_OK(ts_ring_reserve(fx.prod, pid, ts_proc_start_time(pid), 0, &dummy, &token, &err));
    ts_ring_retire(fx.prod, dummy);
    REQUIRE(consumer_add(&fx, &c, 1) == 0);
    PUBLISH(0);
    TAKE(c, 0, 0);
    uint32_t k = a.slot, old = c.index;
    uint64_t old_inc = c.ring->incarnation;
    ts_ring_detach(fx.prod, old, TS_REASON_LAGGED);
    ts_ring_retire(fx.prod, old);
    CHECK_EQ(atomic_load(&fx.prod->hdr->consumers[old].state), TS_CONSUMER_LEAVING);
    REQUIRE_OK(ts_ring_reserve(fx.prod, pid, ts_proc_start_time(pid), 0, &ib, &tokb, &err));
    REQUIRE_OK(ts_ring_activate(fx.prod, ib, 0, &start, &err));
    REQUIRE_OK(ts_ring_bind_consumer(c.ring, ib, tokb, &err));
    c.index = ib;
    CHECK(ib != old && c.ring->incarnation != old_inc); /* the test's premise */
    CHECK_ST(ts_ring_set_aside(c.ring, &err), TS_OK);
    CHECK_EQ(readers_of(fx.prod, k) & (1ULL << old), 0);
    ts_ring_snapshot(fx.prod, &info);
    CHECK_EQ(info.late_releases, 0);
out:
    consumer_drop(&c);
    fx_destroy(&fx);
}

/* Writer of cache_note_race: notes whose fields and text all tell the same tag k, for k
 * = 1..j->n (the producer's thread, noting its cache as it fills). */
static void *cache_notes_run(void *p)
{
    job *j = p;
    for (uint64_t k = 1; k <= j->n; k++) {
        ts_cache_note note = {.budget = k, .bytes = 2 * k, .samples = 3 * k, .epochs = 4 * k};
        snprintf(note.off, sizeof note.off, "off %llu %0*llu", (unsigned long long)k,
                 (int)(k % 400), (unsigned long long)k); /* lengths vary: stale tails show */
        ts_ring_note_cache(j->fx->prod, &note);
    }
    j->done = 1;
    return NULL;
}

/* The cache note: a consumer's copy taken while the producer writes notes is always one
 * whole note (its counts and its text from the same write), never a mix; the text is
 * cut to the room there is; a fresh ring's note says no budget and no text. */
static void test_cache_note_race(void)
{
    fixture fx = {0};
    consumer c = {0};
    job j = {.fx = &fx, .n = 20000};
    pthread_t t;
    int started = 0;
    ts_cache_note got;
    REQUIRE(fx_create(&fx, 4, 4, 4096) == 0);
    REQUIRE(consumer_add(&fx, &c, 1) == 0);
    REQUIRE(ts_ring_cache(c.ring, &got) == 1);
    CHECK_EQ(got.budget, 0);
    CHECK(got.off[0] == '\0');
    REQUIRE(pthread_create(&t, NULL, cache_notes_run, &j) == 0);
    started = 1;
    uint64_t copies = 0, torn = 0;
    while (!__atomic_load_n(&j.done, __ATOMIC_ACQUIRE) || copies == 0) {
        if (!ts_ring_cache(c.ring, &got)) continue;
        copies++;
        uint64_t k = got.budget;
        char want[TS_CACHE_OFF_BYTES];
        snprintf(want, sizeof want, "off %llu %0*llu", (unsigned long long)k, (int)(k % 400),
                 (unsigned long long)k);
        if (k != 0 && (got.bytes != 2 * k || got.samples != 3 * k || got.epochs != 4 * k ||
                       strcmp(got.off, want) != 0))
            torn++;
    }
    CHECK_EQ(torn, 0);
    CHECK(copies > 0);
    ts_cache_note last = {.budget = 7};
    memset(last.off, 'x', sizeof last.off); /* no NUL: cut to the room there is */
    last.off[sizeof last.off - 1] = 'x';
    ts_ring_note_cache(fx.prod, &last);
    REQUIRE(ts_ring_cache(c.ring, &got) == 1);
    CHECK_EQ(strlen(got.off), TS_CACHE_OFF_BYTES - 1);
out:
    if (started) pthread_join(t, NULL);
    consumer_drop(&c);
    fx_destroy(&fx);
}

static const ts_test g_tests[] = {
    {"wrap_around", test_wrap_around},   {"slot_reuse", test_slot_reuse},
    {"bitmaps", test_bitmaps},           {"leases_dlpack", test_leases_dlpack},
    {"deadlines", test_deadlines},       {"strided_source", test_strided_source},
    {"too_big", test_too_big},           {"finish", test_finish},
    {"fail", test_fail},
    {"cross_thread", test_cross_thread}, {"proc_alive", test_proc_alive},
    {"proc_alive_without_fds", test_proc_alive_without_fds},
    {"handshake_errors", test_handshake_errors},
    {"policy", test_policy},             {"late_joiner", test_late_joiner},
    {"window_holds_slot", test_window_holds_slot}, {"join_epoch", test_join_epoch},
    {"join_aligned", test_join_aligned},
    {"laggard", test_laggard},           {"laggard_blocked", test_laggard_blocked},
    {"detach_api", test_detach_api},     {"evict_silent", test_evict_silent},
    {"silent_keeps_held", test_silent_keeps_held}, {"holes_all_kept", test_holes_all_kept},
    {"batches_delivered", test_batches_delivered},
    {"detach_race", test_detach_race},   {"stream_copy", test_stream_copy},
    {"copy_on_write", test_copy_on_write}, {"set_aside", test_set_aside},
    {"set_aside_many", test_set_aside_many}, {"held_blocking", test_held_blocking},
    {"activate_group", test_activate_group}, {"await_next_epoch", test_await_next_epoch},
    {"try_acquire", test_try_acquire},   {"await_race", test_await_race},
    {"late_release", test_late_release}, {"late_release_race", test_late_release_race},
    {"set_aside_rebound", test_set_aside_rebound}, {"cache_note_race", test_cache_note_race},
};

/* Run the tests whose name contains argv[1] (all without it); non-zero if any failed. */
int main(int argc, char **argv)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    return ts_run_tests(g_tests, sizeof g_tests / sizeof g_tests[0], argc > 1 ? argv[1] : NULL,
                        ts_run_here);
}
