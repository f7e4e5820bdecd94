/* ts_error.h - the one error record every fallible core function fills.
 *
 * The core never raises: it returns a ts_status and describes the failure in
 * a ts_err. The binding turns that into exactly one Python exception type per
 * status (see ts_module.c), so meaning is added in one place. */
#ifndef TS_ERROR_H
#define TS_ERROR_H

typedef enum {
    TS_OK = 0,
    TS_E_SYS,            /* a system call failed; sys_errno says which errno */
    TS_E_INVALID,        /* bad argument or malformed input */
    TS_E_TOO_BIG,        /* a batch does not fit in a slot */
    TS_E_NOSPACE,        /* /dev/shm (or device memory) is too small */
    TS_E_TIMEOUT,        /* the deadline passed */
    TS_E_INTR,           /* a signal arrived: check for Ctrl-C and retry */
    TS_E_FINISHED,       /* the producer finished and everything was read */
    TS_E_PRODUCER_GONE,  /* the producer process died */
    TS_E_DETACHED,       /* this consumer was removed from the ring */
    TS_E_FULL,           /* no free entry in the consumer table */
    TS_E_VERSION,        /* a segment of another layout version */
    TS_E_EXISTS,         /* the segment name is taken */
    TS_E_NOT_FOUND,      /* no such segment */
    TS_E_GPU_UNAVAILABLE, /* the GPU path cannot work here (no driver, no IPC, ...) */
    TS_E_CUDA,           /* a CUDA driver call failed */
} ts_status;

typedef struct ts_err {
    ts_status code;
    int sys_errno;
    char msg[512];
} ts_err;

/* Record a failure in err (may be NULL) and return its code. */
ts_status ts_err_set(ts_err *err, ts_status code, int sys_errno, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

#endif /* TS_ERROR_H */
