/* libc10_cuda.so (soname libc10_cuda.so) for a CPU-only torch: the symbols torchvision's
 * _C.so binds from it.
 *
 * PyPI's torchvision wheel is a CUDA build: its _C.so names libc10_cuda.so as NEEDED and
 * relocates one data symbol of it at load (data relocations are never lazy). The
 * functions are called only by its CUDA kernels' launchers, on CUDA tensors, which a
 * CPU-only torch never makes; they are defined so that an eager binding (LD_BIND_NOW)
 * finds them too. The names are the Itanium C++ ABI's mangled names (valid C names);
 * where a caller would read a result, it says "no device": 0 devices, device 0, a null
 * stream. Return types are plain C types of the same ABI class. */

#include <stdint.h>

/* c10::cuda::CUDACachingAllocator::allocator, the global allocator pointer; never read on
 * CPU (null: a use would crash loudly, not compute wrongly). */
void *_ZN3c104cuda20CUDACachingAllocator9allocatorE = 0;

/* c10::cuda::device_count(): no devices. */
int8_t _ZN3c104cuda12device_countEv(void) { return 0; }
/* c10::cuda::current_device(): device 0 (there is none; never called on CPU). */
int8_t _ZN3c104cuda14current_deviceEv(void) { return 0; }
/* c10::cuda::ExchangeDevice(DeviceIndex): the previous device, 0 (never called on CPU). */
int8_t _ZN3c104cuda14ExchangeDeviceEa(void) { return 0; }
/* c10::cuda::MaybeSetDevice(DeviceIndex): nothing to set (never called on CPU). */
void _ZN3c104cuda14MaybeSetDeviceEa(void) {}
/* c10::cuda::GetDevice(DeviceIndex *): cudaErrorNoDevice (never called on CPU). */
int _ZN3c104cuda9GetDeviceEPa(void) { return 100; }
/* c10::cuda::SetDevice(DeviceIndex, bool): cudaErrorNoDevice (never called on CPU). */
int _ZN3c104cuda9SetDeviceEab(void) { return 100; }
/* c10::cuda::c10_cuda_check_implementation(...): no check to make (never called on CPU). */
void _ZN3c104cuda29c10_cuda_check_implementationEiPKcS2_jb(void) {}
/* c10::cuda::getStreamFromPool(bool, DeviceIndex): a null stream (never called on CPU). */
void *_ZN3c104cuda17getStreamFromPoolEba(void) { return 0; }
/* c10::cuda::getStreamFromPool(int, DeviceIndex): a null stream (never called on CPU). */
void *_ZN3c104cuda17getStreamFromPoolEia(void) { return 0; }
/* c10::cuda::getCurrentCUDAStream(DeviceIndex): a null stream (never called on CPU). */
void *_ZN3c104cuda20getCurrentCUDAStreamEa(void) { return 0; }
/* c10::cuda::getDefaultCUDAStream(DeviceIndex): a null stream (never called on CPU). */
void *_ZN3c104cuda20getDefaultCUDAStreamEa(void) { return 0; }
/* c10::cuda::setCurrentCUDAStream(CUDAStream): nothing to set (never called on CPU). */
void _ZN3c104cuda20setCurrentCUDAStreamENS0_10CUDAStreamE(void) {}
/* c10::cuda::CUDAStream::synchronize() const: nothing to wait for (never called on CPU). */
void _ZNK3c104cuda10CUDAStream11synchronizeEv(void) {}
/* c10::cuda::CUDAStream::query() const: idle (never called on CPU). */
_Bool _ZNK3c104cuda10CUDAStream5queryEv(void) { return 1; }
/* c10::cuda::CUDAStream::stream() const: a null cudaStream_t (never called on CPU). */
void *_ZNK3c104cuda10CUDAStream6streamEv(void) { return 0; }
