/* ts_check.h - the small test framework of the C unit tests (test_ring.c, test_gpu.c).
 *
 * Failed checks are counted and reported, and a test goes on after them; REQUIRE and
 * REQUIRE_OK end it instead (they jump to its `out:` label). A registry of named tests is
 * run by ts_run_tests, in this process or otherwise. Also the time and ring helpers both
 * test programs use. Header only: include it from one file of a program, after defining
 * _GNU_SOURCE (for nanosleep and getpid under -std=c11). */
#ifndef TS_CHECK_H
#define TS_CHECK_H

#ifndef _GNU_SOURCE
#error "define _GNU_SOURCE before including ts_check.h"
#endif

#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "base/ts_clock.h"
#include "base/ts_error.h"
#include "ring/ts_ring.h"

/* ---- checks ------------------------------------------------------------------------ */

/* Failed checks of this process so far. */
static _Atomic int g_failed_checks;
/* This process's name in failure lines, where processes share stdout (none if NULL). */
static const char *g_role;

/* Count a failed check; print "  [role pid] file:line: <message>" ([...] if g_role is set). */
__attribute__((format(printf, 3, 4))) static inline void ts_fail(const char *file, int line,
                                                               const char *fmt, ...)
{
    va_list ap;
    char buf[2048];
    atomic_fetch_add(&g_failed_checks, 1);
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    if (g_role != NULL) printf("  [%s %d] %s:%d: %s", g_role, (int)getpid(), file, line, buf);
    else printf("  %s:%d: %s", file, line, buf);
    fflush(stdout);
}

/* CHECK: fail unless ok; returns ok. */
static inline int ts_check(int ok, const char *expr, const char *file, int line)
{
    if (!ok) ts_fail(file, line, "CHECK(%s) failed\n", expr);
    return ok;
}

/* CHECK_EQ: fail unless a == b; 1 if they are equal. */
static inline int ts_check_eq(unsigned long long a, unsigned long long b, const char *ea,
                              const char *eb, const char *file, int line)
{
    if (a != b) ts_fail(file, line, "%s == %s failed: %llu (0x%llx) != %llu\n", ea, eb, a, a, b);
    return a == b;
}

/* CHECK_ST: fail unless got == want, with the error message of err; 1 if they are equal. */
static inline int ts_check_st(ts_status got, ts_status want, const char *expr, const ts_err *err,
                              const char *file, int line)
{
    if (got != want)
        ts_fail(file, line, "%s returned status %d, expected %d (%s)\n", expr, (int)got,
                (int)want, got != TS_OK ? err->msg : "");
    return got == want;
}

#define CHECK(c) ts_check(!!(c), #c, __FILE__, __LINE__)
#define CHECK_EQ(a, b)                                                                       \
    ts_check_eq((unsigned long long)(a), (unsigned long long)(b), #a, #b, __FILE__, __LINE__)
/* Needs a `ts_err err` in scope: the call fills it. */
#define CHECK_ST(call, want) ts_check_st((call), (want), #call, &err, __FILE__, __LINE__)
#define REQUIRE(c) do { if (!CHECK(c)) goto out; } while (0)
#define REQUIRE_OK(call) do { if (!CHECK_ST(call, TS_OK)) goto out; } while (0)

/* ---- the registry and its runner ---------------------------------------------------- */

/* A named test (or test group): fn makes its checks. */
typedef struct ts_test {
    const char *name;
    void (*fn)(void);
} ts_test;

/* Run tests[i] in this process; 1 if none of its checks failed. */
static inline int ts_run_here(const ts_test *tests, size_t i)
{
    int before = atomic_load(&g_failed_checks);
    tests[i].fn();
    return atomic_load(&g_failed_checks) == before;
}

/* Run (via run) the tests whose name contains filter, all if NULL; print results; exit status. */
static inline int ts_run_tests(const ts_test *tests, size_t count, const char *filter,
                               int (*run)(const ts_test *tests, size_t i))
{
    int passed = 0, failed = 0;
    for (size_t i = 0; i < count; i++) {
        if (filter != NULL && strstr(tests[i].name, filter) == NULL) continue;
        uint64_t t0 = ts_now_ns();
        int ok = run(tests, i);
        printf("%s %s (%.1f ms)\n", ok ? "PASS" : "FAIL", tests[i].name,
               (double)(ts_now_ns() - t0) / 1e6);
        if (ok) passed++;
        else failed++;
    }
    if (passed + failed == 0) printf("no test matches '%s'\n", filter);
    printf("%d passed, %d failed\n", passed, failed);
    return failed != 0 || passed == 0 ? 1 : 0;
}

/* ---- time ------------------------------------------------------------------------- */

#define MS 1000000ULL

/* The absolute deadline ms milliseconds from now. */
static inline uint64_t deadline_ms(uint64_t ms) { return ts_now_ns() + ms * MS; }

/* Sleep ms milliseconds (all of them, signals or not). */
static inline void sleep_ms(long ms)
{
    struct timespec t = {ms / 1000, (ms % 1000) * 1000000L};
    while (nanosleep(&t, &t) != 0) {}
}

/* Sleep us microseconds (all of them, signals or not). */
static inline void sleep_us(long us)
{
    struct timespec t = {us / 1000000, (us % 1000000) * 1000L};
    while (nanosleep(&t, &t) != 0) {}
}

/* ---- rings -------------------------------------------------------------------------- */

/* The readers bitmap of slot k of r. */
static inline uint64_t readers_of(const ts_ring *r, uint32_t k)
{
    return atomic_load(&ts_ring_slot(r, k)->readers);
}

/* 1 if any slot's readers bitmap carries bit. */
static inline int bit_in_use(const ts_ring *r, uint64_t bit)
{
    for (uint32_t k = 0; k < r->hdr->slot_count; k++)
        if (readers_of(r, k) & bit) return 1;
    return 0;
}

#endif /* TS_CHECK_H */
