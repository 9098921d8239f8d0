// The Python binding's shared part (kvtier._kvtier; module.cc is its entry):
// converters from Python arguments to the C++ client's, the GIL and error
// rules, and the classes behind kvtier.Client (PyClient), kvtier.Op (PyOp)
// and kvtier.KvCache. Internal to the module: who may include it is
// module.cc, module_types.cc, module_client.cc and binding.cc, as "binding.h"
// (the GPU bundle builds them from one folder: build-extension.sh).
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common/kv_cache_layout.h"
#include "common/layout.h"
#include "common/status.h"
#include "kvtier/client.h"
#include "kvtier/host_memory.h"
#include "kvtier/shm_kv_cache.h"

namespace py = pybind11;

namespace kvtier::python {

// Raises the kvtier.Error subclass of `status`'s code.
[[noreturn]] void Raise(const Status& status);

[[noreturn]] void RaiseInvalid(const std::string& message);

// A timeout argument in seconds as the C++ client takes it (0 = no limit):
// None is no limit; NaN, an infinity and a negative number are refused (a
// NaN passes every comparison, and would convert to anything). A timeout of
// 0 s waits 1 ms (`zero_ok`) or is refused.
std::chrono::milliseconds TimeoutArg(const std::optional<double>& seconds, const char* what, bool zero_ok);

template <typename T>
T Must(Result<T> r) {
  if (!r) Raise(r.error());
  return std::move(*r);
}

// A register call's codec and fp8_group arguments.
CodecChoice Codec(const std::string& name, uint32_t fp8_group);

// Runs `call`, a call of the C++ client that may wait on the daemon, without
// the GIL, and returns its Result.
template <typename F>
auto Unlocked(F&& call) {
  std::optional<decltype(call())> r;
  {
    py::gil_scoped_release release;
    r.emplace(call());
  }
  return std::move(*r);
}

// The same, returning the value or raising the error.
template <typename F>
auto WithoutGil(F&& call) {
  return Must(Unlocked(std::forward<F>(call)));
}

// Whether obj is a NumPy array. NumPy is an optional dependency and
// pybind11's isinstance<array> imports it (and raises without it), so NumPy
// is asked only once something has imported it: no object is an array of a
// NumPy that nobody imported.
bool IsNumpyArray(const py::handle& obj);

// Integers from a list, a tuple or a NumPy integer array, each in [0, max].
std::vector<uint32_t> UInt32s(const py::handle& obj, const char* what, uint64_t max = UINT32_MAX);

BlockKey KeyFrom(const py::handle& obj);

std::vector<BlockKey> Keys(const py::handle& obj);

py::bytes KeyBytes(const BlockKey& key);

py::list KeyList(const std::vector<BlockKey>& keys);

std::optional<BlockKey> OptionalKey(const py::object& obj);

// A registered KV cache: its id on the client, and what must live as long
// as the registration (the CPU cache it was made from, adopted memfds).
struct KvCache {
  CacheId id = 0;
  Layout layout;
  uint32_t num_blocks = 0;
  std::string kind;                          // "shm", "host" or "cuda"
  py::object keep_alive;                     // the CpuKvCache, for "shm"
  // For "host": the memory adopted, shared by the caches registered over it
  // (register_host_memory's same_memory_as), and the regions it was adopted from.
  std::shared_ptr<const AdoptedHostMemory> adopted;
  std::vector<std::pair<uintptr_t, uint64_t>> adopted_regions;
  uint64_t client_serial = 0;                // which Client registered it
};

uint64_t NextSerial();

// The Python Client: owns the C++ client until close().
class PyClient {
 public:
  static std::shared_ptr<PyClient> Connect(const std::string& socket_path,
                                           const std::optional<std::string>& token,
                                           const std::string& name, double reconnect_interval_s,
                                           const std::optional<double>& call_timeout_s) {
    if (socket_path.empty()) RaiseInvalid("socket_path must not be empty");
    if (!(reconnect_interval_s >= 0) || !std::isfinite(reconnect_interval_s))
      RaiseInvalid("reconnect_interval must be >= 0 seconds and finite");
    ClientOptions options{
        .socket_path = socket_path,
        .token = token.value_or(""),
        .client_name = name,
        .reconnect_interval =
            std::chrono::milliseconds(static_cast<int64_t>(reconnect_interval_s * 1000.0)),
        .call_timeout = TimeoutArg(call_timeout_s, "call_timeout", /*zero_ok=*/false)};
    std::unique_ptr<Client> c = WithoutGil([&] { return Client::Connect(std::move(options)); });
    return std::make_shared<PyClient>(std::shared_ptr<Client>(std::move(c)));
  }

  explicit PyClient(std::shared_ptr<Client> client)
      : client_(std::move(client)), serial_(NextSerial()) {}

  // The C++ client, or kvtier.FailedPreconditionError once closed. Callers
  // hold the returned reference across the GIL release.
  std::shared_ptr<Client> Get() const {
    if (!client_) Raise(Status(StatusCode::kFailedPrecondition, "the client is closed"));
    return client_;
  }
  void Close() {
    std::shared_ptr<Client> c = std::move(client_);
    py::gil_scoped_release release;
    c.reset();  // the last call in flight, if any, destroys it
  }
  bool closed() const { return !client_; }

  // A registered cache of this client, checked.
  void Check(const KvCache& cache) const {
    if (cache.client_serial != serial_)
      RaiseInvalid("this KV cache was registered with another client");
  }
  uint64_t serial() const { return serial_; }

 private:
  std::shared_ptr<Client> client_;
  uint64_t serial_;
};

// The result of an async load or store: wait() once.
class PyOp {
 public:
  PyOp(std::shared_ptr<Client> client, OpHandle handle, std::string what)
      : client_(std::move(client)), handle_(handle), what_(std::move(what)) {}

  // Another thread may wait on (or cancel) the same op meanwhile: each call
  // copies the client before the GIL is released, and the loser of the race
  // gets the C++ client's error for an op already over.
  OpResult Wait(std::optional<double> timeout_s) {
    std::shared_ptr<Client> client = client_;
    if (!client) Raise(Status(StatusCode::kFailedPrecondition, "this " + what_ + " was waited for already"));
    const std::chrono::milliseconds timeout = TimeoutArg(timeout_s, "timeout", /*zero_ok=*/true);
    Result<OpResult> r = Unlocked([&] { return client->Wait(handle_, timeout); });
    if (!r && (r.error().code() == StatusCode::kDeadlineExceeded || r.error().code() == StatusCode::kAborted))
      Raise(r.error());  // still running, or a copy of it still is: wait again, or cancel
    client_.reset();
    return Must(std::move(r));
  }
  void Cancel(std::optional<double> timeout_s) {
    std::shared_ptr<Client> client = client_;
    if (!client) return;  // over: its result was returned
    const std::chrono::milliseconds timeout = TimeoutArg(timeout_s, "timeout", /*zero_ok=*/true);
    Status st = Unlocked([&] { return client->Cancel(handle_, timeout); });
    if (!st.ok()) Raise(st);  // a copy still in progress: cancel again
    client_.reset();
  }
  // Whether the first `layers` layers of a load by layer are in place
  // (False: it is over without them, or was waited for: wait() says why).
  bool WaitLayers(uint32_t layers, std::optional<double> timeout_s) {
    std::shared_ptr<Client> client = client_;
    if (!client) return false;
    const std::chrono::milliseconds timeout = TimeoutArg(timeout_s, "timeout", /*zero_ok=*/true);
    return Must(Unlocked([&] { return client->WaitLayers(handle_, layers, timeout); }));
  }
  void StreamWaitLayers(uint32_t layers, uintptr_t stream) {
    std::shared_ptr<Client> client = client_;
    if (!client) Raise(InvalidArgument("this " + what_ + " was waited for already: its layers are all it has"));
    const auto cuda_stream = reinterpret_cast<CudaStream>(stream);
    if (Status st = Unlocked([&] { return client->StreamWaitLayers(handle_, layers, cuda_stream); }); !st.ok()) {
      Raise(st);
    }
  }
  void LayersWritten(uint32_t layers) {
    std::shared_ptr<Client> client = client_;
    if (!client) return;
    if (Status st = Unlocked([&] { return client->LayersWritten(handle_, layers); }); !st.ok()) Raise(st);
  }
  bool waited() const { return !client_; }

 private:
  std::shared_ptr<Client> client_;
  OpHandle handle_;
  std::string what_;
};

Layout MakeLayout(const std::string& model_id, uint32_t num_layers, uint32_t num_kv_heads,
                  uint32_t head_dim, const std::string& dtype, uint32_t block_tokens,
                  const std::string& kv_kind, uint32_t tp_rank, uint32_t tp_size);

std::vector<Placement> PlacementsFor(const Layout& layout, uint32_t num_blocks,
                                     const std::string& scheme);

// Placements from a scheme name or a list of Placement.
std::vector<Placement> PlacementsArg(const Layout& layout, uint32_t num_blocks,
                                     const py::object& arg);

// (pointer, size) pairs of memory regions.
std::vector<std::pair<uintptr_t, uint64_t>> Regions(const py::object& arg);

py::dict StatsDict(const DaemonStats& s);

// Checks keys and block ids for a load or store.
std::pair<std::vector<BlockKey>, std::vector<uint32_t>> KeysAndIds(const KvCache& cache,
                                                                   const py::object& keys,
                                                                   const py::object& block_ids);

// A retention hint from Python's arguments (the client checks it).
BlockHint MakeHint(int priority, uint32_t next_use_ms, bool session_over, bool last_partial,
                   bool engine_holds = false, bool engine_dropped = false);

// A store's KV-event arguments (BlockEventInfo), owned. engine_hashes: one
// per key, each bytes (all of one length, 1-32) or an int (its low 64 bits,
// sent as 8 big-endian bytes, as vLLM's events carry them).
struct PyBlockEvents {
  uint32_t hash_bytes = 0;
  std::vector<uint8_t> hashes;
  std::vector<uint8_t> parent;
  std::vector<uint32_t> tokens;
  uint32_t block_size = 0;
  std::string lora;
  // Views of the members: made where it is used, so a moved-from copy
  // (a short string's bytes live inside it) is never seen.
  BlockEventInfo info() const {
    return BlockEventInfo{.hash_bytes = hash_bytes, .engine_hashes = hashes, .parent_hash = parent,
                          .token_ids = tokens, .block_size = block_size, .lora_name = lora};
  }
};

void AppendEngineHash(const py::handle& h, const char* what, std::vector<uint8_t>& out, uint32_t& width);

std::optional<PyBlockEvents> BlockEvents(const py::object& engine_hashes, const py::object& parent_hash,
                                         const py::object& token_ids, uint32_t block_size,
                                         const py::object& lora_name);

// The module's parts: the value types (Layout, Placement, CpuKvCache,
// KvCache, LookupResult, OpResult, Op) in module_types.cc, and Client in
// module_client.cc.
void BindTypes(py::module_& m);
void BindClient(py::module_& m);

}  // namespace kvtier::python
