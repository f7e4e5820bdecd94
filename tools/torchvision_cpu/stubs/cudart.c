/* libcudart.so.13 (soname and symbol version libcudart.so.13, see cudart.map) for a
 * CPU-only torch: what torchvision's _C.so calls at load, and the names it binds.
 *
 * The __cuda* registration functions are called by _C.so's static initialisers (nvcc's
 * generated code registers each kernel with the runtime) and must behave: a handle, no
 * error. The cuda* API functions are referenced by its CUDA kernels' launchers, which
 * run only on CUDA tensors: defined so that an eager binding (LD_BIND_NOW) still finds
 * them, each answering cudaErrorNoDevice if ever called (declared without parameters:
 * never called, only bound). The registration functions' signatures use plain C types
 * in place of CUDA's (same size and ABI class on x86-64 and aarch64). */

#include <stddef.h>

/* cudaErrorNoDevice: "no CUDA-capable device is detected". */
#define TS_NO_DEVICE 100

/* The handle __cudaRegisterFatBinary hands out; the runtime's is opaque, ours is unused. */
static void *ts_fatbin_handle[4];

/* Registers a fat binary (static initialiser): a non-NULL dummy handle. */
void **__cudaRegisterFatBinary(void *fatbin)
{
    (void)fatbin;
    return ts_fatbin_handle;
}

/* Ends a fat binary's registration (static initialiser): nothing to finish. */
void __cudaRegisterFatBinaryEnd(void **handle)
{
    (void)handle;
}

/* Unregisters a fat binary (at exit): nothing was registered. */
void __cudaUnregisterFatBinary(void **handle)
{
    (void)handle;
}

/* Registers one kernel (static initialiser): ignored, kernels never launch on CPU. */
void __cudaRegisterFunction(void **handle, const char *host_fun, char *device_fun,
                            const char *device_name, int thread_limit, void *tid,
                            void *bid, void *block_dim, void *grid_dim, int *w_size)
{
    (void)handle, (void)host_fun, (void)device_fun, (void)device_name;
    (void)thread_limit, (void)tid, (void)bid, (void)block_dim, (void)grid_dim;
    (void)w_size;
}

/* Registers one __device__ variable (static initialiser): ignored. */
void __cudaRegisterVar(void **handle, char *host_var, char *device_address,
                       const char *device_name, int ext, size_t size, int constant,
                       int global)
{
    (void)handle, (void)host_var, (void)device_address, (void)device_name;
    (void)ext, (void)size, (void)constant, (void)global;
}

/* Initialises a registered module: reports success (1), there is nothing to load. */
char __cudaInitModule(void **handle)
{
    (void)handle;
    return 1;
}

/* The kernel-launch plumbing and the runtime API below are never called on CPU; each
 * answers "no device" where a caller checks the result. */

/* Looks a kernel up by its host stub: no device. */
int __cudaGetKernel(void) { return TS_NO_DEVICE; }
/* Launches a kernel (<<<>>> lowering): no device. */
int __cudaLaunchKernel(void) { return TS_NO_DEVICE; }
/* Pops a launch configuration (<<<>>> lowering): no device. */
int __cudaPopCallConfiguration(void) { return TS_NO_DEVICE; }
/* Pushes a launch configuration (<<<>>> lowering): no device. */
unsigned __cudaPushCallConfiguration(void) { return TS_NO_DEVICE; }
/* cudaDeviceSynchronize: no device. */
int cudaDeviceSynchronize(void) { return TS_NO_DEVICE; }
/* cudaEventCreateWithFlags: no device. */
int cudaEventCreateWithFlags(void) { return TS_NO_DEVICE; }
/* cudaEventDestroy: no device. */
int cudaEventDestroy(void) { return TS_NO_DEVICE; }
/* cudaEventElapsedTime: no device. */
int cudaEventElapsedTime(void) { return TS_NO_DEVICE; }
/* cudaEventQuery: no device. */
int cudaEventQuery(void) { return TS_NO_DEVICE; }
/* cudaEventRecord: no device. */
int cudaEventRecord(void) { return TS_NO_DEVICE; }
/* cudaEventRecordWithFlags: no device. */
int cudaEventRecordWithFlags(void) { return TS_NO_DEVICE; }
/* cudaEventSynchronize: no device. */
int cudaEventSynchronize(void) { return TS_NO_DEVICE; }
/* cudaGetLastError: no device. */
int cudaGetLastError(void) { return TS_NO_DEVICE; }
/* cudaStreamIsCapturing: no device. */
int cudaStreamIsCapturing(void) { return TS_NO_DEVICE; }
/* cudaStreamSynchronize: no device. */
int cudaStreamSynchronize(void) { return TS_NO_DEVICE; }
/* cudaStreamWaitEvent: no device. */
int cudaStreamWaitEvent(void) { return TS_NO_DEVICE; }

/* cudaGetErrorString: the one message this runtime can produce. */
const char *cudaGetErrorString(int error)
{
    (void)error;
    return "no CUDA device (tensorsocket's CPU-only libcudart stub)";
}
