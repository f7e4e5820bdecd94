/* ts_segment.c - named POSIX shared memory, checked for space and owner. */
#define _GNU_SOURCE
#include "base/ts_segment.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

/* Create segment name of bytes, mode 0600, with every page allocated. A name that is
 * taken fails with TS_E_EXISTS and the file there is left alone: anyone may create files
 * in /dev/shm, so it may not be ours (the caller picks another name). */
ts_status ts_segment_create(const char *name, uint64_t bytes, int *fd_out, ts_err *err)
{
    ts_status st = TS_OK;
    int fd = shm_open(name, O_CREAT | O_EXCL | O_NOFOLLOW | O_RDWR | O_CLOEXEC, 0600);
    if (fd < 0) {
        if (errno == EEXIST)
            return ts_err_set(err, TS_E_EXISTS, errno,
                              "shared-memory segment %s already exists (a file there that "
                              "this call did not create)", name);
        return ts_err_set(err, TS_E_SYS, errno, "shm_open(%s): %s", name, strerror(errno));
    }
    /* The umask may have cleared bits we never set, never added any: still, be exact. */
    if (fchmod(fd, 0600) != 0) {
        st = ts_err_set(err, TS_E_SYS, errno, "fchmod(%s): %s", name, strerror(errno));
        goto error;
    }
    struct statvfs vfs;
    if (fstatvfs(fd, &vfs) == 0) {
        uint64_t avail = (uint64_t)vfs.f_bavail * (uint64_t)vfs.f_frsize;
        if (avail < bytes) {
            st = ts_err_set(err, TS_E_NOSPACE, ENOSPC,
                            "/dev/shm has %llu bytes free but the ring needs %llu bytes",
                            (unsigned long long)avail, (unsigned long long)bytes);
            goto error;
        }
    }
    int rc = posix_fallocate(fd, 0, (off_t)bytes);
    if (rc != 0) {
        if (rc == ENOSPC || rc == EFBIG)
            st = ts_err_set(err, TS_E_NOSPACE, rc,
                            "/dev/shm cannot hold the ring: it needs %llu bytes",
                            (unsigned long long)bytes);
        else
            st = ts_err_set(err, TS_E_SYS, rc, "posix_fallocate(%s, %llu): %s", name,
                            (unsigned long long)bytes, strerror(rc));
        goto error;
    }
    *fd_out = fd;
    return TS_OK;

error:
    close(fd);
    shm_unlink(name);
    return st;
}

/* Open an existing segment owned by this user; returns its size. */
ts_status ts_segment_open(const char *name, int *fd_out, uint64_t *bytes_out, ts_err *err)
{
    ts_status st = TS_OK;
    int fd = shm_open(name, O_RDWR | O_NOFOLLOW | O_CLOEXEC, 0);
    if (fd < 0) {
        if (errno == ENOENT)
            return ts_err_set(err, TS_E_NOT_FOUND, errno, "no shared-memory segment %s", name);
        return ts_err_set(err, TS_E_SYS, errno, "shm_open(%s): %s", name, strerror(errno));
    }
    struct stat sb;
    if (fstat(fd, &sb) != 0) {
        st = ts_err_set(err, TS_E_SYS, errno, "fstat(%s): %s", name, strerror(errno));
        goto error;
    }
    if (sb.st_uid != geteuid() || (sb.st_mode & 0077) != 0) {
        st = ts_err_set(err, TS_E_SYS, EACCES,
                        "segment %s is not private to this user: owner uid %u (we are %u), "
                        "mode %o (must be 600); refusing to map it",
                        name, (unsigned)sb.st_uid, (unsigned)geteuid(),
                        (unsigned)(sb.st_mode & 0777));
        goto error;
    }
    *fd_out = fd;
    *bytes_out = (uint64_t)sb.st_size;
    return TS_OK;

error:
    close(fd);
    return st;
}

/* Remove the name; a missing name is not an error. */
ts_status ts_segment_unlink(const char *name, ts_err *err)
{
    if (shm_unlink(name) != 0 && errno != ENOENT)
        return ts_err_set(err, TS_E_SYS, errno, "shm_unlink(%s): %s", name, strerror(errno));
    return TS_OK;
}
