/* libtorch_cuda.so (soname libtorch_cuda.so) for a CPU-only torch: the one symbol
 * torchvision's _C.so binds from it.
 *
 * Called only by its CUDA kernels (on CUDA tensors, which a CPU-only torch never makes);
 * defined so that an eager binding (LD_BIND_NOW) finds it too. */

/* at::cuda::getCurrentDeviceProperties(): no device, no properties (never called on CPU). */
void *_ZN2at4cuda26getCurrentDevicePropertiesEv(void) { return 0; }
