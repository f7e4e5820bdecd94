/* ts_cuda_release.h - a consumer's releases of GPU-read slots, ordered after the GPU work.
 *
 * A slot whose views GPU work may read (device views of a CUDA ring, or page-locked host
 * views read by asynchronous copies) goes back to the producer only once the work queued on
 * it has finished. The DLPack deleter that drops the last view may run on any thread, in a
 * CUDA-graph capture, at interpreter exit: it makes no driver call, it queues the release
 * (ts_cuda_releases_queue). The consumer's own next call flushes the queue
 * (ts_cuda_releases_flush): one event recorded on each stream the releases name (the
 * streams their views were exported to, the stream current at the flush, and the legacy
 * default stream for views read through a raw pointer), each only if that stream is not
 * being captured; a release thread waits for the events and then calls each release back.
 *
 * No call here concerns the whole context: cuCtxRecordEvent "will return
 * CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED if the specified context hCtx has a stream in the
 * capture mode. In such a case, the call will invalidate all the conflicting captures",
 * and cuCtxSynchronize both synchronizes a capture of any thread and stalls the calling
 * thread on all the context's work. A capture on another thread (torch.compile's
 * CUDA-graph warm-up beside a prefetch thread) is left alone; a release whose stream is
 * being captured waits for a later flush.
 *
 * Threads: queue on any thread without the GIL; flush on the consumer's threads; the
 * release thread is the object's own. Once the process's exit has begun (ts_cuda_exiting)
 * nothing here calls the driver: the release thread stops at its next call. */
#ifndef TS_CUDA_RELEASE_H
#define TS_CUDA_RELEASE_H

#include <stdint.h>

#include "base/ts_error.h"
#include "device/ts_cuda_api.h"
#include "device/ts_device.h"

typedef struct ts_cuda_releases ts_cuda_releases;

/* A consumer's release queue on the context ctx of api (a reference of the caller's,
 * borrowed: it outlives the queue), and its release thread, started now. NULL with err set
 * if the thread cannot start. */
ts_cuda_releases *ts_cuda_releases_new(const ts_cuda_api *api, CUcontext ctx, ts_err *err);

/* Queue a release (no driver call; any thread): done(arg, slot, consumer, token, ok) once a
 * flush recorded the work queued on the n streams, and (see the header) on the flush's
 * current stream and, if unnamed or if no stream is known, on the legacy stream, and that
 * work finished (ok), or waiting for it failed (!ok: the slot stays held). */
void ts_cuda_releases_queue(ts_cuda_releases *r, uint32_t slot, uint32_t consumer,
                            uint64_t token, const ts_device_stream *streams, uint32_t n,
                            int unnamed, ts_device_done_fn done, void *arg);

/* Record the events of what was queued (current: the calling thread's current stream, or 0)
 * and hand it to the release thread; a release that waited and failed earlier is reported
 * here (TS_E_CUDA), on every call. wait_ms > 0: then wait up to that long until the release
 * thread has called back every release handed to it (TS_E_TIMEOUT if it has not). */
ts_status ts_cuda_releases_flush(ts_cuda_releases *r, ts_device_stream current,
                                 uint32_t wait_ms, ts_err *err);

/* The consumer's handle is closed: from now on the release thread flushes what is queued
 * by itself (no current stream), retrying while a stream is being captured. */
void ts_cuda_releases_orphan(ts_cuda_releases *r);

/* Stop the release thread and free the queue and its events (inside the context, unless the
 * process is exiting). Called on the release thread itself (a callback dropped the ring's
 * last reference), it returns at once and the thread frees the queue on its way out. */
void ts_cuda_releases_free(ts_cuda_releases *r);

#endif /* TS_CUDA_RELEASE_H */
