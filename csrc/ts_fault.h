/* ts_fault.h - a one-line reason for a write into a consumer's read-only slot mapping.
 *
 * Consumers map slot data read-only, so an in-place op on a batch tensor (torch has no
 * read-only tensors) faults with SIGSEGV instead of changing the batch under the other
 * jobs. This module names that fault: its SIGSEGV handler recognises an access fault
 * inside a watched mapping, writes one line to stderr saying what happened and what to do
 * instead, and hands the fault on to the handler installed before it (the default one
 * ends the process as before; Python's faulthandler or a sanitizer report as usual). */
#ifndef TS_FAULT_H
#define TS_FAULT_H

#include <stddef.h>

/* Watch the read-only mapping [start, start + len); installs the handler on first use.
 * Silently does nothing once TS_FAULT_WATCHED mappings are watched. */
void ts_fault_watch(const void *start, size_t len);

/* Stop watching the mapping at start (call before unmapping it). */
void ts_fault_unwatch(const void *start);

/* Most mappings watched at once (rings a process reads at the same time). */
#define TS_FAULT_WATCHED 64

#endif /* TS_FAULT_H */
