// A stand-in for ROCm 7's libamdhip64.so.7 on a host with no AMD GPU: every call answers
// hipErrorNoDevice, as the real runtime does there. It exists so tests can load mori's
// libmori_io.so (which links libamdhip64.so.7) on a CPU-only machine and run pdkv's mori shim
// through its real error paths. The symbol list and versions are those libmori_io.so and
// libmori_application.so 1.2.4 import (`nm -D --undefined-only`). Never installed or shipped.

#define HIP_ERROR_NO_DEVICE 100

int hipDeviceCanAccessPeer(void) { return HIP_ERROR_NO_DEVICE; }
int hipDeviceEnablePeerAccess(void) { return HIP_ERROR_NO_DEVICE; }
int hipDeviceGetAttribute(void) { return HIP_ERROR_NO_DEVICE; }
int hipDeviceGetPCIBusId(void) { return HIP_ERROR_NO_DEVICE; }
int hipDeviceSynchronize(void) { return HIP_ERROR_NO_DEVICE; }
int hipEventCreateWithFlags(void) { return HIP_ERROR_NO_DEVICE; }
int hipEventDestroy(void) { return HIP_ERROR_NO_DEVICE; }
int hipEventQuery(void) { return HIP_ERROR_NO_DEVICE; }
int hipEventRecord(void) { return HIP_ERROR_NO_DEVICE; }
int hipEventSynchronize(void) { return HIP_ERROR_NO_DEVICE; }
int hipExtMallocWithFlags(void) { return HIP_ERROR_NO_DEVICE; }
int hipFree(void) { return HIP_ERROR_NO_DEVICE; }
int hipGetDevice(int* device) { if (device) *device = -1; return HIP_ERROR_NO_DEVICE; }
int hipGetDeviceCount(int* count) { if (count) *count = 0; return HIP_ERROR_NO_DEVICE; }
const char* hipGetErrorString(int error) { return error == 0 ? "hipSuccess" : "hipErrorNoDevice"; }
int hipGetLastError(void) { return HIP_ERROR_NO_DEVICE; }
int hipHostGetDevicePointer(void) { return HIP_ERROR_NO_DEVICE; }
int hipHostRegister(void) { return HIP_ERROR_NO_DEVICE; }
int hipHostUnregister(void) { return HIP_ERROR_NO_DEVICE; }
int hipIpcCloseMemHandle(void) { return HIP_ERROR_NO_DEVICE; }
int hipIpcGetMemHandle(void) { return HIP_ERROR_NO_DEVICE; }
int hipIpcOpenMemHandle(void) { return HIP_ERROR_NO_DEVICE; }
int hipMalloc(void) { return HIP_ERROR_NO_DEVICE; }
int hipMemAddressFree(void) { return HIP_ERROR_NO_DEVICE; }
int hipMemAddressReserve(void) { return HIP_ERROR_NO_DEVICE; }
int hipMemCreate(void) { return HIP_ERROR_NO_DEVICE; }
int hipMemExportToShareableHandle(void) { return HIP_ERROR_NO_DEVICE; }
int hipMemGetAddressRange(void) { return HIP_ERROR_NO_DEVICE; }
int hipMemGetAllocationGranularity(void) { return HIP_ERROR_NO_DEVICE; }
int hipMemGetHandleForAddressRange(void) { return HIP_ERROR_NO_DEVICE; }
int hipMemImportFromShareableHandle(void) { return HIP_ERROR_NO_DEVICE; }
int hipMemMap(void) { return HIP_ERROR_NO_DEVICE; }
int hipMemRelease(void) { return HIP_ERROR_NO_DEVICE; }
int hipMemRetainAllocationHandle(void) { return HIP_ERROR_NO_DEVICE; }
int hipMemSetAccess(void) { return HIP_ERROR_NO_DEVICE; }
int hipMemUnmap(void) { return HIP_ERROR_NO_DEVICE; }
int hipMemcpy(void) { return HIP_ERROR_NO_DEVICE; }
int hipMemcpyAsync(void) { return HIP_ERROR_NO_DEVICE; }
int hipMemcpyPeerAsync(void) { return HIP_ERROR_NO_DEVICE; }
int hipMemset(void) { return HIP_ERROR_NO_DEVICE; }
int hipModuleGetFunction(void) { return HIP_ERROR_NO_DEVICE; }
int hipModuleLaunchKernel(void) { return HIP_ERROR_NO_DEVICE; }
int hipModuleLoad(void) { return HIP_ERROR_NO_DEVICE; }
int hipModuleUnload(void) { return HIP_ERROR_NO_DEVICE; }
int hipPointerGetAttributes(void) { return HIP_ERROR_NO_DEVICE; }
int hipRuntimeGetVersion(int* version) { if (version) *version = 70000000; return 0; }
int hipSetDevice(void) { return HIP_ERROR_NO_DEVICE; }
int hipStreamCreateWithFlags(void) { return HIP_ERROR_NO_DEVICE; }
int hipStreamDestroy(void) { return HIP_ERROR_NO_DEVICE; }
