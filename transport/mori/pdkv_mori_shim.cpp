// pdkv's C surface over mori::io (AMD's RDMA IO engine).
//
// mori has a C++ API only and throws C++ exceptions; Rust cannot call either. Every function
// here takes opaque handles and flat arrays, catches every exception and returns a status code
// with the message copied into the caller's buffer. The shim is built as its own shared library
// and loaded with dlopen at node start, so a pdkv binary built with the `mori` feature still runs
// (and says what is missing) on a host without ROCm 7 or mori.
//
// No byte of KV passes through here: a READ posts (local offset, remote offset, length) triples
// to mori's session, and the NIC moves the bytes between the two registered regions.

#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "mori/io/io.hpp"

namespace {

using mori::io::EngineDesc;
using mori::io::IOEngine;
using mori::io::IOEngineSession;
using mori::io::MemoryDesc;
using mori::io::TransferStatus;

// Status codes (mirrored in transport/src/mori/ffi.rs).
constexpr int kOk = 0;
constexpr int kException = 1;        // mori threw; message says what
constexpr int kInvalidArgument = 2;  // a null handle or a malformed descriptor
constexpr int kNoSession = 3;        // CreateSession found no backend route
constexpr int kBufferTooSmall = 4;   // *len holds the size needed
constexpr int kUnknown = 5;          // a non-std exception

void copy_message(const std::string& message, char* err, size_t err_cap) {
  if (err == nullptr || err_cap == 0) return;
  size_t n = message.size() < err_cap - 1 ? message.size() : err_cap - 1;
  std::memcpy(err, message.data(), n);
  err[n] = '\0';
}

template <typename F>
int guarded(char* err, size_t err_cap, F&& body) {
  try {
    return body();
  } catch (const std::exception& e) {
    copy_message(e.what(), err, err_cap);
    return kException;
  } catch (...) {
    copy_message("unknown C++ exception", err, err_cap);
    return kUnknown;
  }
}

template <typename T>
int pack(const T& value, uint8_t* out, size_t out_cap, size_t* out_len) {
  msgpack::sbuffer buffer;
  msgpack::pack(buffer, value);
  *out_len = buffer.size();
  if (buffer.size() > out_cap) return kBufferTooSmall;
  std::memcpy(out, buffer.data(), buffer.size());
  return kOk;
}

template <typename T>
T unpack(const uint8_t* bytes, size_t len) {
  msgpack::object_handle handle = msgpack::unpack(reinterpret_cast<const char*>(bytes), len);
  return handle.get().as<T>();
}

struct Session {
  IOEngineSession session;
};

}  // namespace

extern "C" {

/// Mirrors `ffi::RdmaConfig`.
struct pdkv_mori_rdma_config {
  int32_t qp_per_transfer;
  int32_t post_batch_size;
  int32_t num_worker_threads;
  uint32_t poll_cq_mode;  // 0 polling, 1 event
  uint32_t enable_notification;
};

int pdkv_mori_engine_new(const char* key, const char* host, uint16_t port, void** out, char* err,
                         size_t err_cap) {
  return guarded(err, err_cap, [&] {
    if (key == nullptr || host == nullptr || out == nullptr) return kInvalidArgument;
    *out = new IOEngine(std::string(key), mori::io::IOEngineConfig{std::string(host), port});
    return kOk;
  });
}

void pdkv_mori_engine_free(void* engine) {
  try {
    delete static_cast<IOEngine*>(engine);
  } catch (...) {
  }
}

int pdkv_mori_create_rdma_backend(void* engine, const pdkv_mori_rdma_config* config, char* err,
                                  size_t err_cap) {
  return guarded(err, err_cap, [&] {
    if (engine == nullptr || config == nullptr) return kInvalidArgument;
    mori::io::RdmaBackendConfig rdma(
        config->qp_per_transfer, config->post_batch_size, config->num_worker_threads,
        config->poll_cq_mode == 1 ? mori::io::PollCqMode::EVENT : mori::io::PollCqMode::POLLING,
        config->enable_notification != 0);
    static_cast<IOEngine*>(engine)->CreateBackend(mori::io::BackendType::RDMA, rdma);
    return kOk;
  });
}

int pdkv_mori_engine_desc(void* engine, uint8_t* out, size_t out_cap, size_t* out_len, char* err,
                          size_t err_cap) {
  return guarded(err, err_cap, [&] {
    if (engine == nullptr || out_len == nullptr) return kInvalidArgument;
    return pack(static_cast<IOEngine*>(engine)->GetEngineDesc(), out, out_cap, out_len);
  });
}

int pdkv_mori_register_remote(void* engine, const uint8_t* packed, size_t len, char* err,
                              size_t err_cap) {
  return guarded(err, err_cap, [&] {
    if (engine == nullptr || packed == nullptr) return kInvalidArgument;
    static_cast<IOEngine*>(engine)->RegisterRemoteEngine(unpack<EngineDesc>(packed, len));
    return kOk;
  });
}

int pdkv_mori_deregister_remote(void* engine, const uint8_t* packed, size_t len, char* err,
                                size_t err_cap) {
  return guarded(err, err_cap, [&] {
    if (engine == nullptr || packed == nullptr) return kInvalidArgument;
    static_cast<IOEngine*>(engine)->DeregisterRemoteEngine(unpack<EngineDesc>(packed, len));
    return kOk;
  });
}

int pdkv_mori_register_memory(void* engine, void* ptr, size_t size, int32_t device,
                              uint32_t location, uint8_t* out, size_t out_cap, size_t* out_len,
                              char* err, size_t err_cap) {
  return guarded(err, err_cap, [&] {
    if (engine == nullptr || ptr == nullptr || out_len == nullptr) return kInvalidArgument;
    auto loc = location == 2 ? mori::io::MemoryLocationType::GPU : mori::io::MemoryLocationType::CPU;
    MemoryDesc desc = static_cast<IOEngine*>(engine)->RegisterMemory(ptr, size, device, loc);
    int packed = pack(desc, out, out_cap, out_len);
    if (packed != kOk) static_cast<IOEngine*>(engine)->DeregisterMemory(desc);
    return packed;
  });
}

int pdkv_mori_deregister_memory(void* engine, const uint8_t* packed, size_t len, char* err,
                                size_t err_cap) {
  return guarded(err, err_cap, [&] {
    if (engine == nullptr || packed == nullptr) return kInvalidArgument;
    static_cast<IOEngine*>(engine)->DeregisterMemory(unpack<MemoryDesc>(packed, len));
    return kOk;
  });
}

int pdkv_mori_session_new(void* engine, const uint8_t* local, size_t local_len,
                          const uint8_t* remote, size_t remote_len, void** out, char* err,
                          size_t err_cap) {
  return guarded(err, err_cap, [&] {
    if (engine == nullptr || local == nullptr || remote == nullptr || out == nullptr)
      return kInvalidArgument;
    std::optional<IOEngineSession> session = static_cast<IOEngine*>(engine)->CreateSession(
        unpack<MemoryDesc>(local, local_len), unpack<MemoryDesc>(remote, remote_len));
    if (!session.has_value()) {
      copy_message("mori found no backend that connects these two memory regions", err, err_cap);
      return kNoSession;
    }
    *out = new Session{std::move(*session)};
    return kOk;
  });
}

void pdkv_mori_session_free(void* session) {
  try {
    delete static_cast<Session*>(session);
  } catch (...) {
  }
}

int pdkv_mori_session_alive(void* session) {
  try {
    return session != nullptr && static_cast<Session*>(session)->session.Alive() ? 1 : 0;
  } catch (...) {
    return 0;
  }
}

void* pdkv_mori_status_new() {
  try {
    return new TransferStatus();
  } catch (...) {
    return nullptr;
  }
}

void pdkv_mori_status_free(void* status) { delete static_cast<TransferStatus*>(status); }

/// Posts one batch of `count` runs on `session`; completion is reported through `status`,
/// which must stay alive (and unmoved) until it leaves IN_PROGRESS.
int pdkv_mori_session_batch_read(void* session, const uint64_t* local_offsets,
                                 const uint64_t* remote_offsets, const uint64_t* sizes,
                                 size_t count, void* status, char* err, size_t err_cap) {
  return guarded(err, err_cap, [&] {
    if (session == nullptr || status == nullptr || (count > 0 && (local_offsets == nullptr ||
                                                                   remote_offsets == nullptr ||
                                                                   sizes == nullptr)))
      return kInvalidArgument;
    mori::io::SizeVec l(local_offsets, local_offsets + count);
    mori::io::SizeVec r(remote_offsets, remote_offsets + count);
    mori::io::SizeVec s(sizes, sizes + count);
    IOEngineSession& sess = static_cast<Session*>(session)->session;
    sess.BatchRead(l, r, s, static_cast<TransferStatus*>(status), sess.AllocateTransferUniqueId());
    return kOk;
  });
}

/// Waits at most `timeout_ms` (0 polls once) and returns mori's status code; a failed status's
/// message is copied into `msg`.
uint32_t pdkv_mori_status_wait(void* status, int32_t timeout_ms, char* msg, size_t msg_cap) {
  try {
    auto* s = static_cast<TransferStatus*>(status);
    auto code = static_cast<uint32_t>(s->WaitFor(timeout_ms));
    if (code > static_cast<uint32_t>(mori::io::StatusCode::ERR_BEGIN)) copy_message(s->Message(), msg, msg_cap);
    return code;
  } catch (const std::exception& e) {
    copy_message(e.what(), msg, msg_cap);
    return static_cast<uint32_t>(mori::io::StatusCode::ERR_BAD_STATE);
  } catch (...) {
    return static_cast<uint32_t>(mori::io::StatusCode::ERR_BAD_STATE);
  }
}

}  // extern "C"
