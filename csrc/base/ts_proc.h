/* ts_proc.h - process identity that survives pid reuse: pid + start time. */
#ifndef TS_PROC_H
#define TS_PROC_H

#include <stdint.h>
#include <sys/types.h>

/* What /proc/<pid>/stat says of a process: the fields tensorsocket reads. */
typedef struct ts_proc_stat {
    char state;          /* field 3: R, S, D, T, Z, X, ... */
    int32_t ppid;        /* field 4: the parent's pid */
    uint64_t utime;      /* field 14: CPU time in user mode, clock ticks */
    uint64_t stime;      /* field 15: CPU time in kernel mode, clock ticks */
    uint64_t cutime;     /* field 16: user CPU of its children it waited for (and theirs) */
    uint64_t cstime;     /* field 17: kernel CPU of those children */
    uint64_t start_time; /* field 22: start, clock ticks since boot */
} ts_proc_stat;

/* Read /proc/<pid>/stat into out: the one parser of that file (the CLI's status and the
 * test harness reach it through the binding, tensorsocket._core.process_stat). 0, or -1
 * with errno: ESRCH for a process that is gone, EIO for a file it could not parse, or
 * what open and read said (EMFILE, EACCES, ...). */
int ts_proc_read_stat(pid_t pid, ts_proc_stat *out);

/* Start time of pid in clock ticks since boot (field 22 of /proc/pid/stat),
 * or 0 if the process does not exist. */
uint64_t ts_proc_start_time(pid_t pid);

/* What is known of a process: an error reading /proc (EMFILE when this process is out
 * of fds, ENFILE, ENOMEM) says nothing of the target, so it is never taken for death. */
typedef enum {
    TS_PROC_DEAD = 0,    /* gone (ESRCH), a zombie, or its pid now names another process */
    TS_PROC_ALIVE = 1,   /* exists, not a zombie, started at start_time */
    TS_PROC_UNKNOWN = 2, /* kill(pid, 0) finds it, but its start time could not be read */
} ts_proc_state;

/* Whether the process pid that started at start_time lives. */
ts_proc_state ts_proc_check(pid_t pid, uint64_t start_time);

/* 0 if the process pid is known to be gone (or a zombie, which can no longer touch the
 * ring, or another process under a reused pid), else 1: unknown counts as alive. */
int ts_proc_alive(pid_t pid, uint64_t start_time);

/* A pidfd of the process pid that started at start_time (pidfd_open(2), its start time
 * checked after the open, so that the fd names that process and not a later one under a
 * reused pid): the fd (close-on-exec), or -1 where there is none (a kernel or sandbox
 * without pidfd_open, no fd left, or the process gone): callers fall back to ts_proc_alive.
 * A pidfd "is a stable reference" and "becomes readable when the process exits"
 * (pidfd_open(2)): one poll per check, no /proc read. */
int ts_proc_pidfd(pid_t pid, uint64_t start_time);

/* Whether the process of a ts_proc_pidfd fd still runs: 0 once it exited (a zombie
 * included), 1 otherwise (an error of poll says nothing of the process: alive). */
int ts_proc_pidfd_alive(int fd);

/* Whether process pid exists and is no zombie, whatever its start time (for a record whose
 * start time is not written yet): 1, or 0 if it is known to be gone. */
int ts_proc_pid_alive(pid_t pid);

/* Inode of this process's PID namespace (/proc/self/ns/pid), or 0. Two
 * processes with different values cannot share CUDA IPC handles. */
uint64_t ts_proc_pid_ns(void);

/* getpid() without a system call: cached, and forgotten in a forked child (pthread_atfork).
 * For the per-batch checks that a handle is used in the process that opened it. */
pid_t ts_proc_self(void);

/* Name the calling thread (the process, from its main thread) as ps, top and
 * /proc/pid/comm show it: the first 15 bytes of name. 0, or -1 with errno. */
int ts_proc_set_name(const char *name);

#endif /* TS_PROC_H */
