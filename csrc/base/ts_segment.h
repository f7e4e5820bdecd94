/* ts_segment.h - named POSIX shared-memory segments of mode 0600. */
#ifndef TS_SEGMENT_H
#define TS_SEGMENT_H

#include <stdint.h>

#include "base/ts_error.h"

/* Create segment name of bytes, mode 0600, every page allocated up front so
 * that a too-small /dev/shm fails here and not with SIGBUS later. */
ts_status ts_segment_create(const char *name, uint64_t bytes, int *fd_out, ts_err *err);

/* Open an existing segment owned by this user; returns its size. */
ts_status ts_segment_open(const char *name, int *fd_out, uint64_t *bytes_out, ts_err *err);

/* Remove the name; a missing name is not an error. */
ts_status ts_segment_unlink(const char *name, ts_err *err);

#endif /* TS_SEGMENT_H */
