// A stand-in for ROCm 7's libhsa-runtime64.so.1 on a host with no AMD GPU, for the same tests as
// hip_no_device.c: Debian's ROCm 5.2 HSA runtime lacks `hsa_amd_portable_export_dmabuf`, which
// mori 1.2.4 imports, so mori cannot be loaded against it. Every call fails as ROCr does when
// no agent can be opened. The symbol list is what libmori_io.so and libmori_application.so
// import. Never installed or shipped.

#include <stddef.h>

#define HSA_STATUS_SUCCESS 0
#define HSA_STATUS_ERROR_OUT_OF_RESOURCES 0x1008
#define HSA_STATUS_ERROR_NOT_INITIALIZED 0x100B

int hsa_init(void) { return HSA_STATUS_ERROR_OUT_OF_RESOURCES; }
int hsa_shut_down(void) { return HSA_STATUS_ERROR_NOT_INITIALIZED; }
int hsa_iterate_agents(void* callback, void* data) { (void)callback; (void)data; return HSA_STATUS_ERROR_NOT_INITIALIZED; }
int hsa_agent_get_info(void) { return HSA_STATUS_ERROR_NOT_INITIALIZED; }
int hsa_amd_agent_iterate_memory_pools(void) { return HSA_STATUS_ERROR_NOT_INITIALIZED; }
int hsa_amd_memory_pool_get_info(void) { return HSA_STATUS_ERROR_NOT_INITIALIZED; }
int hsa_amd_memory_lock_to_pool(void) { return HSA_STATUS_ERROR_NOT_INITIALIZED; }
int hsa_amd_portable_export_dmabuf(void) { return HSA_STATUS_ERROR_NOT_INITIALIZED; }
int hsa_status_string(int status, const char** text) {
  if (text == NULL) return HSA_STATUS_ERROR_NOT_INITIALIZED;
  *text = status == HSA_STATUS_SUCCESS ? "HSA_STATUS_SUCCESS" : "HSA runtime not initialized: no AMD GPU agent";
  return HSA_STATUS_SUCCESS;
}
