/* test_store.c - C unit tests of the decoded-sample store (csrc/store, issue 38; see
 * docs/decoded-store.md). Build: cc -std=c11 -Wall -Wextra -Werror -pthread -Icsrc csrc/tests/test_store.c
 * csrc/store/ts_store.c csrc/base/ts_*.c csrc/device/ts_*.c csrc/ring/ts_*.c -lrt -ldl */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>
#include "base/ts_clock.h"
#include "base/ts_error.h"
#include "base/ts_segment.h"
#include "store/ts_store.h"
#include "ts_check.h"

static int g_stores;

/* A fresh store name of this process. */
static void store_name(char *buf, size_t cap)
{
    snprintf(buf, cap, "/tensorsocket-cstore-%d-%d", (int)getpid(), g_stores++);
    ts_segment_unlink(buf, NULL);
}

/* A store made for a test, attached: its name and this process's handle. */
typedef struct fixture {
    char name[64];
    ts_store *st;
} fixture;

/* Create and attach store fx of `samples` samples and an arena of budget bytes; 0 on
 * success. */
static int fx_create(fixture *fx, uint64_t samples, uint64_t budget)
{
    ts_err err = {0};
    store_name(fx->name, sizeof fx->name);
    int ok = CHECK_ST(ts_store_create(fx->name, samples, budget, &fx->st, &err), TS_OK) &&
             CHECK_ST(ts_store_attach(fx->st, &err), TS_OK);
    return ok ? 0 : -1;
}

/* Close the handle of fx and remove its store. */
static void fx_destroy(fixture *fx)
{
    ts_store_close(fx->st);
    fx->st = NULL;
    ts_segment_unlink(fx->name, NULL);
}

/* Fill n bytes at p with the pattern of sample s. */
static void fill(void *p, uint64_t n, uint64_t s)
{
    for (uint64_t i = 0; i < n; i++) ((uint8_t *)p)[i] = (uint8_t)(s * 31 + i);
}

/* Whether n bytes at p hold the pattern of sample s. */
static int filled(const void *p, uint64_t n, uint64_t s)
{
    for (uint64_t i = 0; i < n; i++)
        if (((const uint8_t *)p)[i] != (uint8_t)(s * 31 + i)) return 0;
    return 1;
}

/* Reserve, fill and commit sample s of n bytes; 1 on success. */
static int put(ts_store *st, uint64_t s, uint64_t n)
{
    ts_err err = {0};
    ts_store_outcome o;
    uint32_t e;
    void *p = NULL;
    if (!CHECK_ST(ts_store_reserve(st, s, n, &o, &e, &p, &err), TS_OK) ||
        !CHECK_EQ(o, TS_STORE_RESERVED))
        return 0;
    fill(p, n, s);
    return CHECK_ST(ts_store_commit(st, e, &err), TS_OK);
}

/* Whether sample s is READY with n bytes of its pattern (pinned, then unpinned). */
static int has(ts_store *st, uint64_t s, uint64_t n)
{
    ts_err err = {0};
    uint32_t e;
    const void *p;
    uint64_t bytes;
    if (ts_store_get(st, s, 1, &e, &p, &bytes, &err) != TS_OK) return 0;
    int ok = bytes == n && filled(p, n, s);
    ts_store_unpin(st, e);
    return ok;
}

/* A sample is visible only once committed, with its bytes; a second reserve finds it. */
static void test_put_get(void)
{
    fixture fx = {0};
    ts_err err = {0};
    ts_store_outcome o;
    uint32_t e, e2;
    void *p;
    const void *q;
    uint64_t bytes;
    REQUIRE(fx_create(&fx, 100, 1 << 20) == 0);
    ts_store *st = fx.st;
    REQUIRE_OK(ts_store_reserve(st, 3, 5000, &o, &e, &p, &err));
    REQUIRE(CHECK_EQ(o, TS_STORE_RESERVED));
    fill(p, 5000, 3);
    CHECK_ST(ts_store_get(st, 3, 1, &e2, &q, &bytes, &err), TS_E_NOT_FOUND); /* FILLING */
    REQUIRE_OK(ts_store_commit(st, e, &err));
    REQUIRE_OK(ts_store_get(st, 3, 1, &e2, &q, &bytes, &err));
    CHECK_EQ(e2, e);
    CHECK_EQ(bytes, 5000);
    CHECK(filled(q, 5000, 3));
    ts_store_unpin(st, e2);
    REQUIRE_OK(ts_store_reserve(st, 3, 5000, &o, &e2, &p, &err));
    CHECK_EQ(o, TS_STORE_PRESENT);
    CHECK_EQ(st->hdr->races, 1); /* a decode that came second */
    CHECK_ST(ts_store_reserve(st, 100, 10, &o, &e2, &p, &err), TS_E_INVALID);
    CHECK_ST(ts_store_commit(st, e, &err), TS_E_INVALID); /* READY: not this writer's now */
    CHECK_EQ(st->hdr->hits, 1);
    CHECK_EQ(st->hdr->misses, 1);
out:
    fx_destroy(&fx);
}

/* The arena's blocks split and merge: after samples of mixed sizes come and go, one
 * sample of the whole arena fits again. */
static void test_buddy(void)
{
    fixture fx = {0};
    ts_err err = {0};
    ts_store_outcome o;
    uint32_t e[8];
    void *p;
    REQUIRE(fx_create(&fx, 100, 1 << 16) == 0); /* one 64 KiB top block */
    ts_store *st = fx.st;
    const uint64_t sizes[8] = {4096, 100, 8192, 3000, 16384, 4097, 1, 4096};
    for (uint32_t i = 0; i < 8; i++) {
        REQUIRE_OK(ts_store_reserve(st, i, sizes[i], &o, &e[i], &p, &err));
        REQUIRE(CHECK_EQ(o, TS_STORE_RESERVED));
        fill(p, sizes[i], i);
    }
    CHECK_EQ(st->hdr->used_bytes, 4096 * 3 + 8192 * 2 + 16384 + 4096 * 2);
    for (uint32_t i = 0; i < 8; i += 2) REQUIRE_OK(ts_store_commit(st, e[i], &err));
    for (uint32_t i = 1; i < 8; i += 2) REQUIRE_OK(ts_store_abort(st, e[i], &err));
    for (uint32_t i = 0; i < 8; i += 2) CHECK(has(st, i, sizes[i]));
    CHECK(put(st, 50, 1 << 16)); /* the whole arena: every committed one evicted, merged */
    CHECK_EQ(st->hdr->used_entries, 1);
    CHECK_EQ(st->hdr->evictions, 4);
    CHECK(has(st, 50, 1 << 16));
out:
    fx_destroy(&fx);
}

/* Eviction takes the sample fewest jobs still need, then the least recently used; a pinned
 * sample is never evicted, and an insert that would need one is refused (NO_ROOM). */
static void test_eviction(void)
{
    fixture fx = {0};
    ts_store *other = NULL;
    ts_err err = {0};
    ts_store_outcome o;
    uint32_t e, pinned[16];
    void *p;
    const void *q;
    uint64_t bytes;
    REQUIRE(fx_create(&fx, 100, 1 << 16) == 0); /* 16 blocks of 4 KiB */
    ts_store *st = fx.st;
    uint64_t all[16];
    for (uint64_t s = 0; s < 16; s++) all[s] = s;
    REQUIRE_OK(ts_store_open(fx.name, &other, &err)); /* a second job */
    REQUIRE_OK(ts_store_attach(other, &err));
    REQUIRE_OK(ts_store_need(st, st->job, all, 16, &err));
    REQUIRE_OK(ts_store_need(other, other->job, all, 16, &err));
    REQUIRE_OK(ts_store_visited(st, st->job, 5, &err)); /* this one read 5 and 9 */
    REQUIRE_OK(ts_store_visited(st, st->job, 9, &err));
    for (uint64_t s = 0; s < 16; s++) REQUIRE(put(st, s, 4096));
    CHECK(has(st, 5, 4096)); /* 5 used last: 9 is the older of the two needed least */
    REQUIRE(put(st, 20, 4096));
    CHECK(!has(st, 9, 4096));
    CHECK(has(st, 5, 4096));
    REQUIRE(put(st, 21, 4096)); /* 20, which no job counted, goes before 5 */
    CHECK(!has(st, 20, 4096));
    CHECK(has(st, 5, 4096));
    for (uint64_t s = 0; s < 16; s++) pinned[s] = TS_STORE_NONE;
    uint32_t n = 0;
    for (uint64_t s = 0; s < 22 && n < 16; s++)
        if (ts_store_get(st, s, 1, &pinned[n], &q, &bytes, &err) == TS_OK) n++;
    CHECK_EQ(n, 16);
    REQUIRE_OK(ts_store_reserve(st, 30, 4096, &o, &e, &p, &err));
    CHECK_EQ(o, TS_STORE_NO_ROOM);
    CHECK_EQ(st->hdr->no_room, 1);
    ts_store_unpin(st, pinned[0]);
    REQUIRE_OK(ts_store_reserve(st, 30, 4096, &o, &e, &p, &err));
    CHECK_EQ(o, TS_STORE_RESERVED);
    REQUIRE_OK(ts_store_abort(st, e, &err));
out:
    ts_store_close(other);
    fx_destroy(&fx);
}

/* Run fn(st, arg) in a child process with its own handle on store `name`; the child's exit
 * status (it exits by _exit in fn, or 0). */
static int in_child(const char *name, void (*fn)(ts_store *, int), int arg)
{
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        ts_store *st = NULL;
        ts_err err = {0};
        if (ts_store_open(name, &st, &err) != TS_OK || ts_store_attach(st, &err) != TS_OK)
            _exit(90);
        fn(st, arg);
        _exit(0);
    }
    int status = 0;
    waitpid(pid, &status, 0);
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

/* A writer that dies mid-insert: reserve sample `arg`, never commit. */
static void die_filling(ts_store *st, int arg)
{
    ts_err err = {0};
    ts_store_outcome o;
    uint32_t e;
    void *p;
    if (ts_store_reserve(st, (uint64_t)arg, 4096, &o, &e, &p, &err) != TS_OK ||
        o != TS_STORE_RESERVED)
        _exit(91);
    memset(p, 0xee, 100); /* half written */
    _exit(0);
}

/* A job that needs sample `arg` and dies. */
static void need_and_die(ts_store *st, int arg)
{
    ts_err err = {0};
    uint64_t x = (uint64_t)arg;
    if (ts_store_need(st, st->job, &x, 1, &err) != TS_OK) _exit(96);
    _exit(0);
}

/* A process that dies holding the store's lock. */
static void die_locked(ts_store *st, int arg)
{
    (void)arg;
    if (pthread_mutex_lock(&st->hdr->lock) != 0) _exit(92);
    st->hdr->free_head[0] = 12345; /* a change left half done */
    _exit(0);
}

/* A writer SIGKILLed mid-insert leaves no torn sample (never visible) and no leak: the
 * next reserve of it frees its entry and takes it; a process that dies holding the lock
 * leaves a state rebuilt from the entries (EOWNERDEAD), with every committed sample kept. */
static void test_dead_processes(void)
{
    fixture fx = {0};
    ts_err err = {0};
    ts_store_outcome o;
    uint32_t e;
    void *p;
    const void *q;
    uint64_t bytes;
    REQUIRE(fx_create(&fx, 100, 1 << 16) == 0);
    ts_store *st = fx.st;
    REQUIRE(put(st, 1, 5000));
    REQUIRE(CHECK_EQ(in_child(fx.name, die_filling, 7), 0));
    CHECK_ST(ts_store_get(st, 7, 1, &e, &q, &bytes, &err), TS_E_NOT_FOUND);
    CHECK_EQ(st->hdr->used_entries, 2);
    REQUIRE_OK(ts_store_reserve(st, 7, 4096, &o, &e, &p, &err));
    CHECK_EQ(o, TS_STORE_RESERVED); /* the dead writer's entry was freed */
    CHECK_EQ(st->hdr->used_entries, 2);
    fill(p, 4096, 7);
    REQUIRE_OK(ts_store_commit(st, e, &err));

    REQUIRE(CHECK_EQ(in_child(fx.name, die_filling, 8), 0));
    REQUIRE(CHECK_EQ(in_child(fx.name, die_locked, 0), 0));
    CHECK(has(st, 1, 5000)); /* the lock's next taker repaired the state */
    CHECK_EQ(st->hdr->repairs, 1);
    CHECK(has(st, 7, 4096));
    CHECK_EQ(st->hdr->used_entries, 2); /* 1, 7: the dead writer's 8 went in the repair */
    CHECK(put(st, 9, 1 << 15)); /* the arena's lists work: half of it in one block */
    CHECK(has(st, 9, 1 << 15));
out:
    fx_destroy(&fx);
}

/* A sample's remaining uses are the jobs that still need it: needing it twice counts once,
 * a visit takes the job's need away, a job's needs go when it closes or dies, and a
 * job's next epoch's needs replace those it left unvisited. */
static void test_needs(void)
{
    fixture fx = {0};
    ts_store *other = NULL;
    ts_err err = {0};
    REQUIRE(fx_create(&fx, 200, 1 << 16) == 0);
    ts_store *st = fx.st;
    const uint16_t *uses = (const uint16_t *)((char *)st->hdr + st->hdr->layout.uses_offset);
    uint64_t some[4] = {3, 64, 199, 3};
    REQUIRE_OK(ts_store_need(st, st->job, some, 4, &err));
    CHECK_EQ(uses[3], 1);
    CHECK_EQ(uses[64], 1);
    REQUIRE_OK(ts_store_open(fx.name, &other, &err));
    REQUIRE_OK(ts_store_attach(other, &err));
    REQUIRE_OK(ts_store_need(other, other->job, some, 2, &err));
    CHECK_EQ(uses[3], 2);
    REQUIRE_OK(ts_store_visited(st, st->job, 3, &err));
    REQUIRE_OK(ts_store_visited(st, st->job, 3, &err)); /* (a second visit: nothing more to take) */
    CHECK_EQ(uses[3], 1);
    ts_store_close(other);
    other = NULL;
    CHECK_EQ(uses[3], 0);
    CHECK_EQ(uses[64], 1);
    REQUIRE(CHECK_EQ(in_child(fx.name, need_and_die, 150), 0));
    CHECK_EQ(uses[150], 1); /* a dead job's needs stay until it is reaped */
    uint32_t writers = 0, jobs = 0;
    REQUIRE_OK(ts_store_reap(st, &writers, &jobs, &err));
    CHECK_EQ(jobs, 1);
    CHECK_EQ(uses[150], 0);
    CHECK_EQ(uses[199], 1);
    uint64_t next[2] = {5, 64}; /* the next epoch: 199, never visited, is needed no more */
    REQUIRE_OK(ts_store_need(st, st->job, next, 2, &err));
    CHECK_EQ(uses[199], 0);
    CHECK_EQ(uses[64], 1);
    CHECK_EQ(uses[5], 1);
out:
    ts_store_close(other);
    fx_destroy(&fx);
}

/* A sample another live process fills is RACED: decoded privately, not waited for. */
static void test_race(void)
{
    fixture fx = {0};
    ts_err err = {0};
    ts_store_outcome o;
    uint32_t e;
    void *p;
    REQUIRE(fx_create(&fx, 100, 1 << 16) == 0);
    ts_store *st = fx.st;
    /* This process's own reserve stands for the live other writer. */
    REQUIRE_OK(ts_store_reserve(st, 4, 4096, &o, &e, &p, &err));
    REQUIRE(CHECK_EQ(o, TS_STORE_RESERVED));
    uint32_t e2;
    REQUIRE_OK(ts_store_reserve(st, 4, 4096, &o, &e2, &p, &err));
    CHECK_EQ(o, TS_STORE_RACED);
    CHECK_EQ(st->hdr->races, 1);
    REQUIRE_OK(ts_store_abort(st, e, &err));
    REQUIRE(CHECK_EQ(in_child(fx.name, die_filling, 5), 0)); /* a writer that is gone */
    REQUIRE_OK(ts_store_reserve(st, 5, 4096, &o, &e2, &p, &err));
    CHECK_EQ(o, TS_STORE_RESERVED);
out:
    fx_destroy(&fx);
}

/* One worker of the stress test: random reserves (filled with the sample's pattern, then
 * committed, or aborted one time in 8), gets (each read checked whole while pinned, and
 * again after a yield: a pinned sample is never rewritten), over a store small enough to
 * evict all the time. Exits 0, or 94 on wrong data, 95 on an error. */
static void stress_worker(ts_store *st, int seed)
{
    ts_err err = {0};
    uint64_t x = (uint64_t)seed * 0x9E3779B97F4A7C15ULL + 1;
    for (int i = 0; i < 3000; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        uint64_t s = x % 64, n = 512 + (x >> 8) % 12000;
        n = n - n % 7 + s % 7; /* its length tells its sample too */
        uint32_t e;
        if ((x >> 32) & 1) {
            ts_store_outcome o;
            void *p;
            if (ts_store_reserve(st, s, n, &o, &e, &p, &err) != TS_OK) _exit(95);
            if (o != TS_STORE_RESERVED) continue;
            fill(p, n, s);
            if (((x >> 40) & 7) == 0) {
                if (ts_store_abort(st, e, &err) != TS_OK) _exit(95);
            } else if (ts_store_commit(st, e, &err) != TS_OK) {
                _exit(95);
            }
        } else {
            const void *q;
            uint64_t bytes;
            ts_status r = ts_store_get(st, s, 1, &e, &q, &bytes, &err);
            if (r == TS_E_NOT_FOUND) continue;
            if (r != TS_OK) _exit(95);
            if (bytes % 7 != s % 7 || !filled(q, bytes, s)) _exit(94);
            sched_yield();
            if (!filled(q, bytes, s)) _exit(94);
            ts_store_unpin(st, e);
        }
    }
}

/* Four processes at once over a store that evicts all the time, one of them SIGKILLed in
 * the middle (holding the lock, filling an entry or pinning one, wherever it was) and
 * another started: no wrong data anywhere, and afterwards the store's accounting matches
 * its entries and every READY sample reads back whole. */
static void test_stress(void)
{
    fixture fx = {0};
    ts_err err = {0};
    pid_t kids[5] = {0};
    REQUIRE(fx_create(&fx, 64, 1 << 17) == 0); /* 128 KiB: ~10 samples */
    ts_store *st = fx.st;
    fflush(NULL);
    for (int k = 0; k < 5; k++) {
        if (k == 4) { /* one of the first four killed meanwhile, a fifth in its place */
            sleep_ms(20);
            kill(kids[0], SIGKILL);
            /* and one that dies holding the lock, a change half done, while they run */
            CHECK_EQ(in_child(fx.name, die_locked, 0), 0);
        }
        kids[k] = fork();
        REQUIRE(kids[k] >= 0);
        if (kids[k] == 0) {
            ts_store *mine = NULL;
            ts_err e2 = {0};
            if (ts_store_open(fx.name, &mine, &e2) != TS_OK || ts_store_attach(mine, &e2) != TS_OK)
                _exit(90);
            stress_worker(mine, k + 1);
            ts_store_close(mine);
            _exit(0);
        }
    }
    for (int k = 0; k < 5; k++) {
        int status = 0;
        waitpid(kids[k], &status, 0);
        if (k == 0) CHECK(WIFEXITED(status) || WTERMSIG(status) == SIGKILL);
        else CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    }
    /* The killed one's entry and pins go; then a walk of the whole table checks. */
    uint32_t writers = 0, jobs = 0;
    REQUIRE_OK(ts_store_reap(st, &writers, &jobs, &err));
    CHECK(writers <= 1 && jobs <= 1);
    uint64_t used = 0;
    uint32_t live = 0;
    ts_store_entry *entries = ts_store_entries(st);
    for (uint32_t i = 0; i < st->hdr->layout.entries; i++) {
        uint32_t state = atomic_load(&entries[i].state);
        if (state == TS_STORE_FREE) continue;
        CHECK_EQ(state, TS_STORE_READY); /* no FILLING left: its writer is gone */
        used += 1ULL << entries[i].order;
        live++;
        CHECK(has(st, entries[i].sample, entries[i].bytes));
    }
    CHECK_EQ(st->hdr->used_bytes, used);
    CHECK_EQ(st->hdr->used_entries, live);
    CHECK(st->hdr->evictions > 0);
    CHECK(st->hdr->repairs >= 1);
    printf("  stress: %llu commits, %llu evictions, %llu races, %llu no room, %llu repairs, "
           "%u writers and %u jobs reaped\n", (unsigned long long)st->hdr->commits,
           (unsigned long long)st->hdr->evictions, (unsigned long long)st->hdr->races,
           (unsigned long long)st->hdr->no_room, (unsigned long long)st->hdr->repairs,
           writers, jobs);
out:
    fx_destroy(&fx);
}

/* A budget that is no power of two is used whole: its top blocks are its powers of two
 * (128 KiB + 64 KiB + 4 KiB here), every 4 KiB of it holds a sample, and blocks merge up
 * to each top block's size again. */
static void test_odd_budget(void)
{
    fixture fx = {0};
    REQUIRE(fx_create(&fx, 100, (128 + 64 + 4) << 10) == 0);
    ts_store *st = fx.st;
    CHECK_EQ(st->hdr->layout.arena_bytes, (128 + 64 + 4) << 10);
    for (uint64_t s = 0; s < 49; s++) REQUIRE(put(st, s, 4096));
    CHECK_EQ(st->hdr->evictions, 0);
    CHECK_EQ(st->hdr->used_bytes, 49 * 4096);
    REQUIRE(put(st, 60, 4096)); /* full: one goes */
    CHECK_EQ(st->hdr->evictions, 1);
    REQUIRE(put(st, 61, 128 << 10)); /* a whole top block, merged from 32 small ones */
    CHECK(has(st, 61, 128 << 10));
    CHECK(put(st, 62, 64 << 10));
    CHECK(has(st, 62, 64 << 10));
    CHECK_EQ(st->hdr->used_bytes, (128 + 64 + 4) << 10);
out:
    fx_destroy(&fx);
}

/* A process stopped while it holds the store's lock (SIGSTOP, Ctrl-Z) costs the others
 * one wait of TS_STORE_LOCK_WAIT_NS, then nothing until the backoff passes: their calls
 * fail TS_E_TIMEOUT at once (they decode privately); once it runs again, the store is
 * used as before. A handle backing off still closes (gives its job slot back). */
static void test_stopped_holder(void)
{
    fixture fx = {0};
    ts_err err = {0};
    uint32_t e;
    const void *q;
    uint64_t bytes;
    REQUIRE(fx_create(&fx, 10, 1 << 16) == 0);
    ts_store *st = fx.st;
    REQUIRE(put(st, 1, 100));
    pid_t child = fork();
    if (child == 0) {
        pthread_mutex_lock(&st->hdr->lock);
        raise(SIGSTOP);
        pthread_mutex_unlock(&st->hdr->lock);
        _exit(0);
    }
    int status = 0;
    REQUIRE(waitpid(child, &status, WUNTRACED) == child && WIFSTOPPED(status));
    uint64_t t0 = ts_now_ns();
    CHECK_ST(ts_store_get(st, 1, 1, &e, &q, &bytes, &err), TS_E_TIMEOUT);
    uint64_t waited = ts_now_ns() - t0;
    CHECK(waited >= TS_STORE_LOCK_WAIT_NS - 10000000ULL);
    t0 = ts_now_ns();
    CHECK_ST(ts_store_get(st, 1, 1, &e, &q, &bytes, &err), TS_E_TIMEOUT); /* backing off */
    CHECK(ts_now_ns() - t0 < TS_STORE_LOCK_WAIT_NS / 2);
    CHECK_EQ(st->hdr->busy, 2); /* the wait that timed out, the call refused after */
    kill(child, SIGCONT);
    REQUIRE(waitpid(child, &status, 0) == child && WIFEXITED(status));
    uint64_t deadline = ts_now_ns() + 5 * TS_STORE_BUSY_BACKOFF_NS;
    ts_status s;
    while ((s = ts_store_get(st, 1, 1, &e, &q, &bytes, &err)) == TS_E_TIMEOUT &&
           ts_now_ns() < deadline)
        usleep(10000);
    REQUIRE_OK(s);
    ts_store_unpin(st, e);
    CHECK(has(st, 1, 100));
    /* Backing off, a handle still ends what it began: its close gives its slot back. */
    ts_store *other = NULL;
    REQUIRE_OK(ts_store_open(fx.name, &other, &err));
    REQUIRE_OK(ts_store_attach(other, &err));
    uint32_t slot = other->job;
    other->busy_until = ts_now_ns() + 10 * TS_STORE_BUSY_BACKOFF_NS;
    ts_store_close(other);
    CHECK_EQ(st->hdr->jobs[slot].pid, 0);
out:
    fx_destroy(&fx);
}

/* Pins are counted per process: of two gets of one sample, the first unpin leaves it
 * pinned (an insert that needs its room evicts nothing); the second frees it. A dropped
 * store misses every get and stores nothing, and keeps its first reason. A forked child's
 * copy of the handle, closed, leaves the parent's job attached. */
static void test_pins_drop_fork(void)
{
    fixture fx = {0};
    ts_err err = {0};
    ts_store_outcome o;
    uint32_t e1, e2, e3;
    const void *q;
    void *p;
    uint64_t bytes;
    char why[TS_STORE_REASON_BYTES];
    REQUIRE(fx_create(&fx, 10, 8192) == 0); /* two 4 KiB blocks */
    ts_store *st = fx.st;
    REQUIRE(put(st, 1, 4096) && put(st, 2, 4096));
    REQUIRE_OK(ts_store_get(st, 1, 1, &e1, &q, &bytes, &err));
    REQUIRE_OK(ts_store_get(st, 1, 1, &e2, &q, &bytes, &err));
    REQUIRE_OK(ts_store_get(st, 2, 1, &e3, &q, &bytes, &err));
    ts_store_unpin(st, e1); /* one of two pins of sample 1 */
    REQUIRE_OK(ts_store_reserve(st, 3, 4096, &o, &e1, &p, &err));
    CHECK_EQ(o, TS_STORE_NO_ROOM);
    ts_store_unpin(st, e2);
    REQUIRE_OK(ts_store_reserve(st, 3, 4096, &o, &e1, &p, &err));
    CHECK_EQ(o, TS_STORE_RESERVED); /* sample 1 went for it */
    REQUIRE_OK(ts_store_abort(st, e1, &err));
    CHECK(!has(st, 1, 4096));
    CHECK(has(st, 2, 4096));
    ts_store_unpin(st, e3);
    CHECK(!ts_store_dropped(st, why, sizeof why));
    REQUIRE_OK(ts_store_drop(st, "sample 2 decoded twice differs", &err));
    REQUIRE_OK(ts_store_drop(st, "a later reason", &err));
    CHECK(ts_store_dropped(st, why, sizeof why));
    CHECK(strcmp(why, "sample 2 decoded twice differs") == 0);
    CHECK_ST(ts_store_get(st, 2, 1, &e1, &q, &bytes, &err), TS_E_NOT_FOUND);
    REQUIRE_OK(ts_store_reserve(st, 4, 4096, &o, &e1, &p, &err));
    CHECK_EQ(o, TS_STORE_NO_ROOM);
    pid_t child = fork();
    if (child == 0) {
        ts_store_close(st); /* the child's copy */
        _exit(0);
    }
    int status = 0;
    REQUIRE(waitpid(child, &status, 0) == child);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    CHECK_EQ(st->hdr->jobs[st->job].pid, (int32_t)getpid());
    CHECK_ST(ts_store_need(st, 63, &bytes, 1, &err), TS_E_INVALID); /* no such job */
out:
    fx_destroy(&fx);
}

static const ts_test g_tests[] = {
    {"store_put_get", test_put_get},
    {"store_buddy", test_buddy},
    {"store_odd_budget", test_odd_budget},
    {"store_eviction", test_eviction},
    {"store_needs", test_needs},
    {"store_dead_processes", test_dead_processes},
    {"store_race", test_race},
    {"store_pins_drop_fork", test_pins_drop_fork},
    {"store_stopped_holder", test_stopped_holder},
    {"store_stress", test_stress},
};

/* Run the tests whose name contains argv[1] (all without it); non-zero if any failed. */
int main(int argc, char **argv)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    return ts_run_tests(g_tests, sizeof g_tests / sizeof g_tests[0], argc > 1 ? argv[1] : NULL,
                        ts_run_here);
}
