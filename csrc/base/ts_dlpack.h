/* ts_dlpack.h - the DLPack ABI (v1.1) as tensorsocket uses it.
 *
 * Declared here from the published specification so that the core needs no
 * third-party header. Layout matters: these structs cross library boundaries
 * (torch, numpy) and must match the spec byte for byte. */
#ifndef TS_DLPACK_H
#define TS_DLPACK_H

#include <stdint.h>

#define TS_DLPACK_MAJOR 1
#define TS_DLPACK_MINOR 1

#define TS_DLPACK_FLAG_READ_ONLY (1ULL << 0)
#define TS_DLPACK_FLAG_IS_COPIED (1ULL << 1)

typedef enum {
    kDLCPU = 1,
    kDLCUDA = 2,
    kDLCUDAHost = 3,
} DLDeviceType;

typedef enum {
    kDLInt = 0,
    kDLUInt = 1,
    kDLFloat = 2,
    kDLBfloat = 4,
    kDLComplex = 5,
    kDLBool = 6,
} DLDataTypeCode;

typedef struct {
    uint32_t major;
    uint32_t minor;
} DLPackVersion;

typedef struct {
    int32_t device_type; /* DLDeviceType */
    int32_t device_id;
} DLDevice;

typedef struct {
    uint8_t code;
    uint8_t bits;
    uint16_t lanes;
} DLDataType;

typedef struct {
    void *data;
    DLDevice device;
    int32_t ndim;
    DLDataType dtype;
    int64_t *shape;
    int64_t *strides; /* in elements; tensorsocket always fills it */
    uint64_t byte_offset;
} DLTensor;

typedef struct DLManagedTensor {
    DLTensor dl_tensor;
    void *manager_ctx;
    void (*deleter)(struct DLManagedTensor *self);
} DLManagedTensor;

typedef struct DLManagedTensorVersioned {
    DLPackVersion version;
    void *manager_ctx;
    void (*deleter)(struct DLManagedTensorVersioned *self);
    uint64_t flags;
    DLTensor dl_tensor;
} DLManagedTensorVersioned;

_Static_assert(sizeof(DLTensor) == 48, "DLTensor layout");
_Static_assert(sizeof(DLManagedTensor) == 64, "DLManagedTensor layout");
_Static_assert(sizeof(DLManagedTensorVersioned) == 80, "DLManagedTensorVersioned layout");

#endif /* TS_DLPACK_H */
