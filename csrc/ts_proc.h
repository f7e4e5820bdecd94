/* ts_proc.h - process identity that survives pid reuse: pid + start time. */
#ifndef TS_PROC_H
#define TS_PROC_H

#include <stdint.h>
#include <sys/types.h>

/* Start time of pid in clock ticks since boot (field 22 of /proc/pid/stat),
 * or 0 if the process does not exist. */
uint64_t ts_proc_start_time(pid_t pid);

/* 1 if the process pid exists and started at start_time, else 0. A zombie
 * counts as gone: it can no longer touch the ring. */
int ts_proc_alive(pid_t pid, uint64_t start_time);

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
