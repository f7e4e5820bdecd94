/* ts_device.c - what every backend shares: finding one, driver references (ts_device.h). */
#include "device/ts_device.h"

/* The backend whose device memory has this DLDeviceType, or NULL. */
const ts_device *ts_device_for(int32_t device_type)
{
    if (device_type == ts_device_cuda.device_type) return &ts_device_cuda;
    return NULL;
}

/* Take a reference on a driver. */
void ts_device_driver_ref(ts_device_driver *driver)
{
    atomic_fetch_add_explicit(&driver->refs, 1, memory_order_relaxed);
}

/* Drop a reference; the backend unloads the driver at zero. */
void ts_device_driver_unref(ts_device_driver *driver)
{
    if (driver == NULL) return;
    if (atomic_fetch_sub_explicit(&driver->refs, 1, memory_order_acq_rel) != 1) return;
    driver->device->unload(driver);
}
