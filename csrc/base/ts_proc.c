/* ts_proc.c - read a process's start time and state from /proc. */
#define _GNU_SOURCE
#include "base/ts_proc.h"

#include <sys/prctl.h>
#include <sys/stat.h>

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static _Atomic pid_t ts_self_pid;           /* 0: not known (yet, or since a fork) */
static pthread_once_t ts_self_once = PTHREAD_ONCE_INIT;

/* In a forked child: the cached pid is the parent's. */
static void ts_proc_forget_pid(void)
{
    atomic_store_explicit(&ts_self_pid, 0, memory_order_relaxed);
}

/* Register ts_proc_forget_pid for every fork from now on. */
static void ts_proc_watch_forks(void)
{
    (void)pthread_atfork(NULL, NULL, ts_proc_forget_pid);
}

/* This process's pid, cached (see ts_proc.h). */
pid_t ts_proc_self(void)
{
    pid_t pid = atomic_load_explicit(&ts_self_pid, memory_order_relaxed);
    if (pid != 0) return pid;
    pthread_once(&ts_self_once, ts_proc_watch_forks); /* before caching: no fork missed */
    pid = getpid();
    atomic_store_explicit(&ts_self_pid, pid, memory_order_relaxed);
    return pid;
}

/* Read /proc/pid/stat; fill state and start time. Returns 0 on success, else -1 with
 * errno (ESRCH for a process that is gone, EIO for a file it could not parse). */
static int ts_proc_read_stat(pid_t pid, char *state, uint64_t *start_time)
{
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    int fd;
    do {
        fd = open(path, O_RDONLY | O_CLOEXEC);
    } while (fd < 0 && errno == EINTR);
    if (fd < 0) return -1;
    ssize_t n;
    do {
        n = read(fd, buf, sizeof buf - 1);
    } while (n < 0 && errno == EINTR);
    int saved = errno;
    close(fd);
    errno = saved;
    if (n < 0) return -1;
    if (n == 0) {
        errno = ESRCH; /* the process was reaped between open and read */
        return -1;
    }
    buf[n] = '\0';
    /* comm (field 2) may contain spaces and parentheses: skip to the last ')'. */
    char *p = strrchr(buf, ')');
    if (p == NULL || p[1] == '\0') {
        errno = EIO;
        return -1;
    }
    p += 2;
    *state = *p;
    /* p now points at field 3; the start time is field 22. */
    for (int field = 3; field < 22; field++) {
        p = strchr(p, ' ');
        if (p == NULL) {
            errno = EIO;
            return -1;
        }
        p++;
    }
    *start_time = strtoull(p, NULL, 10);
    return 0;
}

/* Start time of pid in clock ticks since boot, or 0 if it does not exist. */
uint64_t ts_proc_start_time(pid_t pid)
{
    char state;
    uint64_t start = 0;
    if (pid <= 0 || ts_proc_read_stat(pid, &state, &start) != 0) return 0;
    return start;
}

/* Whether pid (started at start_time) lives (see ts_proc.h). */
ts_proc_state ts_proc_check(pid_t pid, uint64_t start_time)
{
    char state;
    uint64_t start = 0;
    if (pid <= 0) return TS_PROC_DEAD;
    if (ts_proc_read_stat(pid, &state, &start) == 0) {
        if (state == 'Z' || state == 'X' || state == 'x') return TS_PROC_DEAD;
        return start == start_time ? TS_PROC_ALIVE : TS_PROC_DEAD;
    }
    /* No stat to read. EMFILE, ENFILE, ENOMEM or EACCES say nothing of the target, and
     * ENOENT may be a /proc that is not mounted: ask the kernel, which needs no fd. */
    if (kill(pid, 0) != 0 && errno == ESRCH) return TS_PROC_DEAD;
    return TS_PROC_UNKNOWN; /* it exists (or may: EPERM), its start time unread */
}

/* 0 only if pid is known to be gone or another process (see ts_proc.h). */
int ts_proc_alive(pid_t pid, uint64_t start_time)
{
    return ts_proc_check(pid, start_time) != TS_PROC_DEAD;
}

/* Inode of this process's PID namespace, or 0. */
uint64_t ts_proc_pid_ns(void)
{
    struct stat st;
    if (stat("/proc/self/ns/pid", &st) != 0) return 0;
    return (uint64_t)st.st_ino;
}

/* Name the calling thread (see ts_proc.h). */
int ts_proc_set_name(const char *name)
{
    char comm[16];
    snprintf(comm, sizeof comm, "%s", name); /* the kernel keeps 15 bytes and a NUL */
    return prctl(PR_SET_NAME, (unsigned long)comm, 0UL, 0UL, 0UL);
}
