// pdkv's C surface over the HIP runtime: GPU memory for KV regions and the staging copies the
// reference engine reads and writes them through. Built against HIP's own header (so every call
// is checked against the real signatures) into a shared library that pdkv loads with dlopen at
// node start: a binary built with the `hip` feature still runs, and says what is missing, on a
// host without ROCm or without a GPU.

#include <hip/hip_runtime_api.h>
#include <stddef.h>
#include <string.h>

static int fail(hipError_t error, const char* call, char* err, size_t err_cap) {
  if (err != NULL && err_cap > 0) {
    const char* name = hipGetErrorName(error);
    const char* text = hipGetErrorString(error);
    size_t used = 0;
    name = name ? name : "?";
    text = text ? text : "?";
    const char* parts[] = {call, ": ", name, " (", text, ")"};
    // Older runtimes answer the name for both: say it once.
    size_t count = strcmp(name, text) == 0 ? 3 : 6;
    for (size_t i = 0; i < count; i++) {
      size_t n = strlen(parts[i]);
      if (used + n >= err_cap) n = err_cap - 1 - used;
      memcpy(err + used, parts[i], n);
      used += n;
    }
    err[used] = '\0';
  }
  return (int)error;
}

/// Number of HIP devices; hipErrorNoDevice (100) with *count = 0 when there is none.
int pdkv_hip_device_count(int* count, char* err, size_t err_cap) {
  *count = 0;
  hipError_t error = hipGetDeviceCount(count);
  if (error != hipSuccess) {
    *count = 0;
    return fail(error, "hipGetDeviceCount", err, err_cap);
  }
  return 0;
}

/// `size` zeroed bytes of device memory on `device`.
int pdkv_hip_malloc(int device, size_t size, void** out, char* err, size_t err_cap) {
  *out = NULL;
  hipError_t error = hipSetDevice(device);
  if (error != hipSuccess) return fail(error, "hipSetDevice", err, err_cap);
  error = hipMalloc(out, size);
  if (error != hipSuccess) return fail(error, "hipMalloc", err, err_cap);
  error = hipMemset(*out, 0, size);
  if (error != hipSuccess) {
    (void)hipFree(*out);
    *out = NULL;
    return fail(error, "hipMemset", err, err_cap);
  }
  return 0;
}

int pdkv_hip_free(int device, void* ptr) {
  (void)hipSetDevice(device);
  return (int)hipFree(ptr);
}

/// Copies `len` bytes between host and device memory (kind: 1 host to device, 2 device to host,
/// 3 device to device), synchronously.
int pdkv_hip_copy(void* dst, const void* src, size_t len, int kind, char* err, size_t err_cap) {
  enum hipMemcpyKind how = kind == 1   ? hipMemcpyHostToDevice
                           : kind == 2 ? hipMemcpyDeviceToHost
                                       : hipMemcpyDeviceToDevice;
  hipError_t error = hipMemcpy(dst, src, len, how);
  if (error != hipSuccess) return fail(error, "hipMemcpy", err, err_cap);
  return 0;
}
