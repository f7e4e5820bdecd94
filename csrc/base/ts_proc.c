/* ts_proc.c - read a process's start time and state from /proc. */
#define _GNU_SOURCE
#include "base/ts_proc.h"

#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>

#include <poll.h>

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

/* Read all of /proc/<pid>/stat into buf (bytes, NUL terminated): 0, or -1 with errno. */
static int ts_proc_slurp_stat(pid_t pid, char *buf, size_t bytes)
{
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    int fd;
    do {
        fd = open(path, O_RDONLY | O_CLOEXEC);
    } while (fd < 0 && errno == EINTR);
    if (fd < 0) return -1;
    ssize_t n;
    do {
        n = read(fd, buf, bytes - 1);
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
    return 0;
}

/* Parse the text of /proc/<pid>/stat into out: 0, or -1 with errno EIO. */
static int ts_proc_parse_stat(const char *buf, ts_proc_stat *out)
{
    /* comm (field 2) may contain spaces and parentheses: skip to the last ')'. */
    const char *p = strrchr(buf, ')');
    if (p == NULL || p[1] != ' ' || p[2] == '\0') {
        errno = EIO;
        return -1;
    }
    p += 2; /* field 3 */
    out->state = *p;
    for (int field = 4; field <= 22; field++) {
        p = strchr(p, ' ');
        if (p == NULL) {
            errno = EIO;
            return -1;
        }
        p++;
        if (field == 4) out->ppid = (int32_t)strtol(p, NULL, 10);
        else if (field == 14) out->utime = strtoull(p, NULL, 10);
        else if (field == 15) out->stime = strtoull(p, NULL, 10);
        else if (field == 16) out->cutime = strtoull(p, NULL, 10);
        else if (field == 17) out->cstime = strtoull(p, NULL, 10);
        else if (field == 22) out->start_time = strtoull(p, NULL, 10);
    }
    return 0;
}

/* Read /proc/<pid>/stat into out (see ts_proc.h). */
int ts_proc_read_stat(pid_t pid, ts_proc_stat *out)
{
    char buf[1024];
    if (ts_proc_slurp_stat(pid, buf, sizeof buf) != 0) return -1;
    return ts_proc_parse_stat(buf, out);
}

/* Start time of pid in clock ticks since boot, or 0 if it does not exist. */
uint64_t ts_proc_start_time(pid_t pid)
{
    ts_proc_stat st;
    if (pid <= 0 || ts_proc_read_stat(pid, &st) != 0) return 0;
    return st.start_time;
}

/* Whether pid (started at start_time) lives (see ts_proc.h). */
ts_proc_state ts_proc_check(pid_t pid, uint64_t start_time)
{
    ts_proc_stat st;
    if (pid <= 0) return TS_PROC_DEAD;
    if (ts_proc_read_stat(pid, &st) == 0) {
        if (st.state == 'Z' || st.state == 'X' || st.state == 'x') return TS_PROC_DEAD;
        return st.start_time == start_time ? TS_PROC_ALIVE : TS_PROC_DEAD;
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

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434 /* the same number on every architecture (Linux 5.3) */
#endif

/* A pidfd of pid, checked against start_time (see ts_proc.h). */
int ts_proc_pidfd(pid_t pid, uint64_t start_time)
{
    if (pid <= 0) return -1;
    int fd = (int)syscall(SYS_pidfd_open, pid, 0); /* close-on-exec, by the kernel */
    if (fd < 0) return -1;
    /* Opened first, checked second: a process that still has pid and the start time it
     * had before the open is the one the fd names. */
    if (ts_proc_check(pid, start_time) != TS_PROC_ALIVE) {
        close(fd);
        return -1;
    }
    return fd;
}

/* Whether the process of a pidfd still runs (see ts_proc.h). */
int ts_proc_pidfd_alive(int fd)
{
    struct pollfd p = {.fd = fd, .events = POLLIN};
    int n;
    do {
        n = poll(&p, 1, 0);
    } while (n < 0 && errno == EINTR);
    return n <= 0 || !(p.revents & (POLLIN | POLLHUP));
}

/* Whether pid exists and is no zombie, whatever its start time (see ts_proc.h). */
int ts_proc_pid_alive(pid_t pid)
{
    ts_proc_stat st;
    if (pid <= 0) return 0;
    if (ts_proc_read_stat(pid, &st) == 0) return st.state != 'Z' && st.state != 'X';
    return !(kill(pid, 0) != 0 && errno == ESRCH);
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
