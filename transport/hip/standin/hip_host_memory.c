// A HIP runtime whose one "GPU" is host memory, for tests only: the HIP shim built against HIP's
// real header is linked against this library in a second copy (see build.rs), so the tests can
// drive GPU regions through every staging-copy path (host to device, device to host, device to
// device) on a machine with no GPU. Never installed or shipped.

#include <stdlib.h>
#include <string.h>

#define hipSuccess 0
#define hipErrorInvalidValue 1
#define hipErrorOutOfMemory 2
#define hipErrorInvalidDevice 101

static int current = 0;

int hipGetDeviceCount(int* count) {
  *count = 1;
  return hipSuccess;
}

int hipSetDevice(int device) {
  if (device != 0) return hipErrorInvalidDevice;
  current = device;
  return hipSuccess;
}

int hipMalloc(void** ptr, size_t size) {
  *ptr = malloc(size);
  return *ptr == NULL ? hipErrorOutOfMemory : hipSuccess;
}

int hipMemset(void* ptr, int value, size_t size) {
  memset(ptr, value, size);
  return hipSuccess;
}

int hipFree(void* ptr) {
  free(ptr);
  return hipSuccess;
}

int hipMemcpy(void* dst, const void* src, size_t size, int kind) {
  if (kind < 1 || kind > 3) return hipErrorInvalidValue;
  memmove(dst, src, size);
  return hipSuccess;
}

const char* hipGetErrorName(int error) {
  switch (error) {
    case hipSuccess: return "hipSuccess";
    case hipErrorInvalidValue: return "hipErrorInvalidValue";
    case hipErrorOutOfMemory: return "hipErrorOutOfMemory";
    case hipErrorInvalidDevice: return "hipErrorInvalidDevice";
    default: return "hipErrorUnknown";
  }
}

const char* hipGetErrorString(int error) { return hipGetErrorName(error); }
