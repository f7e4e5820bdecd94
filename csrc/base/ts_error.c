/* ts_error.c - filling the error record. */
#include "base/ts_error.h"

#include <stdarg.h>
#include <stdio.h>

/* Record a failure in err (may be NULL) and return its code. */
ts_status ts_err_set(ts_err *err, ts_status code, int sys_errno, const char *fmt, ...)
{
    if (err != NULL) {
        va_list ap;
        err->code = code;
        err->sys_errno = sys_errno;
        va_start(ap, fmt);
        vsnprintf(err->msg, sizeof err->msg, fmt, ap);
        va_end(ap);
    }
    return code;
}
