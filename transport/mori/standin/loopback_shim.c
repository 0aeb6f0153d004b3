// A loopback stand-in for pdkv's mori shim, for tests only: the same C functions as
// pdkv_mori_shim.cpp, but a "READ" is a memcpy inside this process, done on a thread of its own
// after an optional delay, as a NIC completes a posted work request later. It lets the tests run
// pdkv's MoriEngine end to end (sessions, run batching, the completion thread, bounded
// outstanding batches, generation reads, failure reporting) and a whole in-process cluster over
// it, on a machine without mori's hardware. What it cannot show is mori itself: that is
// mori_no_device.rs (mori's real error paths) and hardware.
//
// Knobs (read at each batch): PDKV_LOOPBACK_DELAY_US delays completion; PDKV_LOOPBACK_FAIL_EVERY=N
// fails every Nth batch with mori's ERR_RDMA_OP (13) after copying half its bytes.
// Never installed or shipped.

#define _DEFAULT_SOURCE

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define OK 0
#define EXCEPTION 1
#define INVALID_ARGUMENT 2
#define BUFFER_TOO_SMALL 4
#define SUCCESS 0
#define IN_PROGRESS 2
#define ERR_RDMA_OP 13

static const char ENGINE_MAGIC[8] = "LOOPENG";
static const char MEMORY_MAGIC[8] = "LOOPMEM";

struct engine {
  char key[128];
};

struct memory {
  char magic[8];
  uint64_t ptr;
  uint64_t size;
};

struct session {
  uint8_t* local;
  uint64_t local_size;
  const uint8_t* remote;
  uint64_t remote_size;
};

struct status {
  _Atomic uint32_t code;
  char message[256];
};

struct pdkv_mori_rdma_config {
  int32_t qp_per_transfer;
  int32_t post_batch_size;
  int32_t num_worker_threads;
  uint32_t poll_cq_mode;
  uint32_t enable_notification;
};

static _Atomic uint64_t batches;

static void message(char* err, size_t cap, const char* text) {
  if (err != NULL && cap > 0) snprintf(err, cap, "%s", text);
}

int pdkv_mori_engine_new(const char* key, const char* host, uint16_t port, void** out, char* err,
                         size_t cap) {
  (void)host;
  (void)port;
  if (key == NULL || out == NULL) return INVALID_ARGUMENT;
  struct engine* e = calloc(1, sizeof *e);
  snprintf(e->key, sizeof e->key, "%s", key);
  *out = e;
  (void)err;
  (void)cap;
  return OK;
}

void pdkv_mori_engine_free(void* e) { free(e); }

int pdkv_mori_create_rdma_backend(void* e, const struct pdkv_mori_rdma_config* config, char* err,
                                  size_t cap) {
  (void)e;
  (void)config;
  (void)err;
  (void)cap;
  return OK;
}

int pdkv_mori_engine_desc(void* e, uint8_t* out, size_t out_cap, size_t* out_len, char* err,
                          size_t cap) {
  (void)err;
  (void)cap;
  struct engine* engine = e;
  size_t key_len = strlen(engine->key);
  *out_len = sizeof ENGINE_MAGIC + key_len;
  if (*out_len > out_cap) return BUFFER_TOO_SMALL;
  memcpy(out, ENGINE_MAGIC, sizeof ENGINE_MAGIC);
  memcpy(out + sizeof ENGINE_MAGIC, engine->key, key_len);
  return OK;
}

static int remote(const uint8_t* packed, size_t len, char* err, size_t cap) {
  if (packed == NULL || len < sizeof ENGINE_MAGIC || memcmp(packed, ENGINE_MAGIC, sizeof ENGINE_MAGIC) != 0) {
    message(err, cap, "std::bad_cast");
    return EXCEPTION;
  }
  return OK;
}

int pdkv_mori_register_remote(void* e, const uint8_t* packed, size_t len, char* err, size_t cap) {
  (void)e;
  return remote(packed, len, err, cap);
}

int pdkv_mori_deregister_remote(void* e, const uint8_t* packed, size_t len, char* err, size_t cap) {
  (void)e;
  return remote(packed, len, err, cap);
}

int pdkv_mori_register_memory(void* e, void* ptr, size_t size, int32_t device, uint32_t location,
                              uint8_t* out, size_t out_cap, size_t* out_len, char* err,
                              size_t cap) {
  (void)e;
  (void)device;
  (void)location;
  (void)err;
  (void)cap;
  struct memory memory;
  memcpy(memory.magic, MEMORY_MAGIC, sizeof MEMORY_MAGIC);
  memory.ptr = (uint64_t)(uintptr_t)ptr;
  memory.size = size;
  *out_len = sizeof memory;
  if (*out_len > out_cap) return BUFFER_TOO_SMALL;
  memcpy(out, &memory, sizeof memory);
  return OK;
}

int pdkv_mori_deregister_memory(void* e, const uint8_t* packed, size_t len, char* err, size_t cap) {
  (void)e;
  (void)packed;
  (void)len;
  (void)err;
  (void)cap;
  return OK;
}

static int unpack(const uint8_t* packed, size_t len, struct memory* memory) {
  if (packed == NULL || len != sizeof *memory) return 0;
  memcpy(memory, packed, sizeof *memory);
  return memcmp(memory->magic, MEMORY_MAGIC, sizeof MEMORY_MAGIC) == 0;
}

int pdkv_mori_session_new(void* e, const uint8_t* local, size_t local_len, const uint8_t* remote_desc,
                          size_t remote_len, void** out, char* err, size_t cap) {
  (void)e;
  struct memory l, r;
  if (!unpack(local, local_len, &l) || !unpack(remote_desc, remote_len, &r)) {
    message(err, cap, "std::bad_cast");
    return EXCEPTION;
  }
  struct session* s = calloc(1, sizeof *s);
  s->local = (uint8_t*)(uintptr_t)l.ptr;
  s->local_size = l.size;
  s->remote = (const uint8_t*)(uintptr_t)r.ptr;
  s->remote_size = r.size;
  *out = s;
  return OK;
}

void pdkv_mori_session_free(void* s) { free(s); }

int pdkv_mori_session_alive(void* s) { return s != NULL; }

void* pdkv_mori_status_new(void) { return calloc(1, sizeof(struct status)); }

void pdkv_mori_status_free(void* status) { free(status); }

struct work {
  struct session session;
  uint64_t* triples;
  size_t count;
  struct status* status;
  uint64_t delay_us;
  int fail;
};

static void* complete(void* arg) {
  struct work* w = arg;
  if (w->delay_us > 0) usleep((useconds_t)w->delay_us);
  size_t upto = w->fail ? w->count / 2 : w->count;
  uint32_t code = w->fail ? ERR_RDMA_OP : SUCCESS;
  for (size_t i = 0; i < upto; i++) {
    uint64_t l = w->triples[3 * i], r = w->triples[3 * i + 1], n = w->triples[3 * i + 2];
    if (l + n > w->session.local_size || r + n > w->session.remote_size) {
      code = ERR_RDMA_OP;
      snprintf(w->status->message, sizeof w->status->message, "remote access error: run outside the memory region");
      break;
    }
    memcpy(w->session.local + l, w->session.remote + r, n);
  }
  if (w->fail) snprintf(w->status->message, sizeof w->status->message, "injected RDMA failure");
  atomic_store(&w->status->code, code);
  free(w->triples);
  free(w);
  return NULL;
}

int pdkv_mori_session_batch_read(void* session, const uint64_t* local_offsets,
                                 const uint64_t* remote_offsets, const uint64_t* sizes,
                                 size_t count, void* status, char* err, size_t cap) {
  if (session == NULL || status == NULL) return INVALID_ARGUMENT;
  struct work* w = calloc(1, sizeof *w);
  w->session = *(struct session*)session;
  w->triples = calloc(3 * (count ? count : 1), sizeof(uint64_t));
  for (size_t i = 0; i < count; i++) {
    w->triples[3 * i] = local_offsets[i];
    w->triples[3 * i + 1] = remote_offsets[i];
    w->triples[3 * i + 2] = sizes[i];
  }
  w->count = count;
  w->status = status;
  const char* delay = getenv("PDKV_LOOPBACK_DELAY_US");
  w->delay_us = delay ? strtoull(delay, NULL, 10) : 0;
  const char* every = getenv("PDKV_LOOPBACK_FAIL_EVERY");
  uint64_t n = atomic_fetch_add(&batches, 1) + 1;
  w->fail = every != NULL && strtoull(every, NULL, 10) > 0 && n % strtoull(every, NULL, 10) == 0;
  atomic_store(&w->status->code, IN_PROGRESS);
  pthread_t thread;
  if (pthread_create(&thread, NULL, complete, w) != 0) {
    message(err, cap, "cannot start the completion thread");
    free(w->triples);
    free(w);
    return EXCEPTION;
  }
  pthread_detach(thread);
  return OK;
}

uint32_t pdkv_mori_status_wait(void* status, int32_t timeout_ms, char* msg, size_t msg_cap) {
  struct status* s = status;
  struct timespec start, now;
  clock_gettime(CLOCK_MONOTONIC, &start);
  for (;;) {
    uint32_t code = atomic_load(&s->code);
    if (code != IN_PROGRESS) {
      if (code > 10) message(msg, msg_cap, s->message);
      return code;
    }
    clock_gettime(CLOCK_MONOTONIC, &now);
    int64_t waited_ms = (now.tv_sec - start.tv_sec) * 1000 + (now.tv_nsec - start.tv_nsec) / 1000000;
    if (timeout_ms >= 0 && waited_ms >= timeout_ms) return code;
    usleep(50);
  }
}
