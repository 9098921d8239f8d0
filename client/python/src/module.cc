// kvtier._kvtier: the Python binding of libkvtier (kvtier::Client and the
// types it uses). The public Python API is the `kvtier` package
// (client/python/src/kvtier/__init__.py), which re-exports these names and adds the
// PyTorch helpers; its stubs are in _kvtier.pyi.
// Past 800 lines on purpose: one pybind11 module, whose bindings mirror
// kvtier/client.h call for call and share its argument converters.
//
// Rules kept here:
//   - every call that may wait on the daemon releases the GIL;
//   - every error is a kvtier.Error subclass chosen by the status code
//     (kvtier/_errors.py), raised with the C++ message;
//   - bad input (wrong types, lengths, ranges, a closed client) is an
//     exception before anything reaches the C++ client, never a crash.
//
// A Client is usable from several Python threads: the C++ client serialises
// calls on its connection, and close() waits for the calls in flight (they
// hold a reference to it).
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
namespace {

// Raises the kvtier.Error subclass of `status`'s code.
[[noreturn]] void Raise(const Status& status) {
  py::object errors = py::module_::import("kvtier._errors");
  py::object cls = errors.attr("error_class")(std::string(StatusCodeName(status.code())));
  PyErr_SetObject(
      cls.ptr(),
      py::make_tuple(status.message(), std::string(StatusCodeName(status.code()))).ptr());
  throw py::error_already_set();
}
[[noreturn]] void RaiseInvalid(const std::string& message) { Raise(InvalidArgument(message)); }

// A timeout argument in seconds as the C++ client takes it (0 = no limit):
// None is no limit; NaN, an infinity and a negative number are refused (a
// NaN passes every comparison, and would convert to anything). A timeout of
// 0 s waits 1 ms (`zero_ok`) or is refused.
std::chrono::milliseconds TimeoutArg(const std::optional<double>& seconds, const char* what, bool zero_ok) {
  if (!seconds) return std::chrono::milliseconds(0);
  const double s = *seconds;
  if (!std::isfinite(s) || s < 0 || (!zero_ok && s == 0)) {
    RaiseInvalid(std::string(what) + (zero_ok ? " must be >= 0 seconds" : " must be > 0 seconds") +
                 " and finite, or None (no limit)");
  }
  // At most a year, so that it converts exactly (a Wait on the wire is
  // bounded to 49 days anyway).
  const double ms = std::min(s * 1000.0, 365.0 * 24 * 3600 * 1000);
  return std::chrono::milliseconds(std::max<int64_t>(1, static_cast<int64_t>(ms)));
}


template <typename T>
T Must(Result<T> r) {
  if (!r) Raise(r.error());
  return std::move(*r);
}

// A register call's codec and fp8_group arguments.
CodecChoice Codec(const std::string& name, uint32_t fp8_group) {
  return CodecChoice{.kind = Must(ParseCodec(name)), .fp8_group = fp8_group};
}

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
bool IsNumpyArray(const py::handle& obj) {
  PyObject* numpy = PyDict_GetItemString(PyImport_GetModuleDict(), "numpy");  // borrowed
  return numpy != nullptr && numpy != Py_None && py::isinstance<py::array>(obj);
}

// Integers from a list, a tuple or a NumPy integer array, each in [0, max].
std::vector<uint32_t> UInt32s(const py::handle& obj, const char* what, uint64_t max = UINT32_MAX) {
  std::vector<uint32_t> out;
  auto take = [&](int64_t v) {
    if (v < 0 || static_cast<uint64_t>(v) > max) {
      RaiseInvalid(std::string(what) + ": " + std::to_string(v) + " is out of range [0, " +
                   std::to_string(max) + "]");
    }
    out.push_back(static_cast<uint32_t>(v));
  };
  if (IsNumpyArray(obj)) {
    auto array = py::reinterpret_borrow<py::array>(obj);
    const char kind = array.dtype().kind();
    if (kind != 'i' && kind != 'u')
      RaiseInvalid(std::string(what) + ": an integer array is needed, not " +
                   std::string(py::str(array.dtype())));
    if (array.ndim() != 1) RaiseInvalid(std::string(what) + ": a one-dimensional array is needed");
    auto as64 = py::array_t<int64_t, py::array::c_style | py::array::forcecast>::ensure(array);
    if (kind == 'u' && array.dtype().itemsize() == 8) {
      auto u = py::array_t<uint64_t, py::array::c_style | py::array::forcecast>::ensure(array);
      out.reserve(static_cast<size_t>(u.size()));
      for (py::ssize_t i = 0; i < u.size(); ++i) {
        if (u.data()[i] > max) RaiseInvalid(std::string(what) + ": a value is out of range");
        out.push_back(static_cast<uint32_t>(u.data()[i]));
      }
      return out;
    }
    out.reserve(static_cast<size_t>(as64.size()));
    for (py::ssize_t i = 0; i < as64.size(); ++i) take(as64.data()[i]);
    return out;
  }
  if (!py::isinstance<py::sequence>(obj) || py::isinstance<py::str>(obj) ||
      py::isinstance<py::bytes>(obj)) {
    throw py::type_error(std::string(what) + ": a list of ints or a NumPy integer array is needed");
  }
  auto seq = py::reinterpret_borrow<py::sequence>(obj);
  out.reserve(seq.size());
  for (const py::handle item : seq) {
    if (!PyLong_Check(item.ptr()) || PyBool_Check(item.ptr())) {
      throw py::type_error(std::string(what) + ": every item must be an int, not " +
                           std::string(py::str(py::type::handle_of(item).attr("__name__"))));
    }
    int overflow = 0;
    const long long v = PyLong_AsLongLongAndOverflow(item.ptr(), &overflow);
    if (overflow != 0) RaiseInvalid(std::string(what) + ": a value is out of range");
    take(v);
  }
  return out;
}

BlockKey KeyFrom(const py::handle& obj) {
  if (!py::isinstance<py::bytes>(obj))
    throw py::type_error("keys: every key must be bytes (16 of them)");
  const std::string s = py::reinterpret_borrow<py::bytes>(obj);
  if (s.size() != BlockKey::kSize) {
    RaiseInvalid("keys: a key has " + std::to_string(s.size()) + " bytes; keys have 16");
  }
  BlockKey key;
  std::memcpy(key.bytes.data(), s.data(), BlockKey::kSize);
  return key;
}

std::vector<BlockKey> Keys(const py::handle& obj) {
  if (!py::isinstance<py::sequence>(obj) || py::isinstance<py::bytes>(obj) ||
      py::isinstance<py::str>(obj)) {
    throw py::type_error("keys: a list of 16-byte bytes objects is needed");
  }
  std::vector<BlockKey> keys;
  for (const py::handle item : py::reinterpret_borrow<py::sequence>(obj))
    keys.push_back(KeyFrom(item));
  return keys;
}

py::bytes KeyBytes(const BlockKey& key) {
  return py::bytes(reinterpret_cast<const char*>(key.bytes.data()), key.bytes.size());
}

py::list KeyList(const std::vector<BlockKey>& keys) {
  py::list out;
  for (const BlockKey& k : keys) out.append(KeyBytes(k));
  return out;
}

std::optional<BlockKey> OptionalKey(const py::object& obj) {
  if (obj.is_none()) return std::nullopt;
  return KeyFrom(obj);
}

// A registered KV cache: its id on the client, and what must live as long
// as the registration (the CPU cache it was made from, adopted memfds).
struct KvCache {
  CacheId id = 0;
  Layout layout;
  uint32_t num_blocks = 0;
  std::string kind;                          // "shm", "host" or "cuda"
  py::object keep_alive;                     // the CpuKvCache, for "shm"
  std::optional<AdoptedHostMemory> adopted;  // for "host"
  uint64_t client_serial = 0;                // which Client registered it
};

uint64_t NextSerial() {
  static uint64_t serial = 0;
  return ++serial;
}

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
  bool waited() const { return !client_; }

 private:
  std::shared_ptr<Client> client_;
  OpHandle handle_;
  std::string what_;
};

Layout MakeLayout(const std::string& model_id, uint32_t num_layers, uint32_t num_kv_heads,
                  uint32_t head_dim, const std::string& dtype, uint32_t block_tokens,
                  const std::string& kv_kind, uint32_t tp_rank, uint32_t tp_size) {
  const DType d = Must(ParseDType(dtype));
  const KvKind k = Must(ParseKvKind(kv_kind));
  return Must(Layout::Create(LayoutSpec{.model_id = model_id,
                                        .num_layers = num_layers,
                                        .kv_kind = k,
                                        .num_kv_heads = num_kv_heads,
                                        .head_dim = head_dim,
                                        .dtype = d,
                                        .block_tokens = block_tokens,
                                        .tp_rank = tp_rank,
                                        .tp_size = tp_size}));
}

std::vector<Placement> PlacementsFor(const Layout& layout, uint32_t num_blocks,
                                     const std::string& scheme) {
  if (num_blocks == 0) RaiseInvalid("num_blocks must be > 0");
  if (scheme == "contiguous") return KvCacheLayout::Contiguous(layout);
  if (layout.spec().scale_bytes_per_layer != 0)
    RaiseInvalid("engine layouts have no fp8 scale bytes");
  if (scheme == "vllm_nhd") return KvCacheLayout::VllmNhd(layout, num_blocks);
  if (scheme == "vllm_hnd") return KvCacheLayout::VllmHnd(layout, num_blocks);
  if (scheme == "sglang_layer_first") return KvCacheLayout::SglangLayerFirst(layout, num_blocks);
  if (scheme == "sglang_page_first") return KvCacheLayout::SglangPageFirst(layout, num_blocks);
  RaiseInvalid("placements: unknown scheme '" + scheme +
               "' (contiguous, vllm_nhd, vllm_hnd, sglang_layer_first, sglang_page_first)");
}

// Placements from a scheme name or a list of Placement.
std::vector<Placement> PlacementsArg(const Layout& layout, uint32_t num_blocks,
                                     const py::object& arg) {
  if (py::isinstance<py::str>(arg))
    return PlacementsFor(layout, num_blocks, arg.cast<std::string>());
  try {
    return arg.cast<std::vector<Placement>>();
  } catch (const py::cast_error&) {
    throw py::type_error("placements: a scheme name or a list of kvtier.Placement is needed");
  }
}

// (pointer, size) pairs of memory regions.
std::vector<std::pair<uintptr_t, uint64_t>> Regions(const py::object& arg) {
  std::vector<std::pair<uintptr_t, uint64_t>> out;
  try {
    for (const auto& [ptr, size] : arg.cast<std::vector<std::pair<uint64_t, uint64_t>>>()) {
      if (ptr == 0 || size == 0) RaiseInvalid("regions: a region has a null pointer or no bytes");
      out.emplace_back(static_cast<uintptr_t>(ptr), size);
    }
  } catch (const py::cast_error&) {
    throw py::type_error("regions: a list of (pointer, size in bytes) pairs of ints is needed");
  }
  if (out.empty()) RaiseInvalid("regions: at least one region is needed");
  return out;
}

py::dict StatsDict(const DaemonStats& s) {
  py::dict d;
  d["scope"] = s.scope;
  d["backend"] = s.backend;
  d["release"] = s.release;
  d["metrics"] = s.metrics;
  py::list tiers;
  for (const TierStats& t : s.tiers) {
    py::dict td;
    td["tier"] = std::string(BlockTierName(t.tier));
    td["capacity_bytes"] = t.capacity_bytes;
    td["used_bytes"] = t.used_bytes;
    td["blocks"] = t.blocks;
    tiers.append(td);
  }
  d["tiers"] = tiers;
  d["sessions"] = s.sessions;
  d["leases"] = s.leases;
  d["mappings"] = s.mappings;
  d["inflight_ops"] = s.inflight_ops;
  py::dict counters;
  for (const auto& [name, value] : s.counters) counters[py::str(name)] = value;
  d["counters"] = counters;
  return d;
}

// Checks keys and block ids for a load or store.
std::pair<std::vector<BlockKey>, std::vector<uint32_t>> KeysAndIds(const KvCache& cache,
                                                                   const py::object& keys,
                                                                   const py::object& block_ids) {
  std::vector<BlockKey> k = Keys(keys);
  std::vector<uint32_t> ids = UInt32s(block_ids, "block_ids", cache.num_blocks - 1);
  if (k.size() != ids.size()) {
    RaiseInvalid("keys and block_ids differ in length (" + std::to_string(k.size()) + " and " +
                 std::to_string(ids.size()) + ")");
  }
  return {std::move(k), std::move(ids)};
}

// A retention hint from Python's arguments (the client checks it).
BlockHint MakeHint(int priority, uint32_t next_use_ms, bool session_over, bool last_partial) {
  return BlockHint{.priority = priority,
                   .next_use_ms = next_use_ms,
                   .session_over = session_over,
                   .last_partial = last_partial};
}

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

void AppendEngineHash(const py::handle& h, const char* what, std::vector<uint8_t>& out, uint32_t& width) {
  std::string bytes;
  if (py::isinstance<py::bytes>(h)) {
    bytes = py::cast<std::string>(h);
  } else if (py::isinstance<py::int_>(h)) {
    const uint64_t v = py::cast<uint64_t>(py::reinterpret_borrow<py::int_>(h) & py::int_(UINT64_MAX));
    for (int i = 7; i >= 0; --i) bytes.push_back(static_cast<char>(v >> (8 * i)));
  } else {
    RaiseInvalid(std::string(what) + ": bytes or an int is needed, not " + std::string(py::str(h.get_type())));
  }
  if (width == 0) width = static_cast<uint32_t>(bytes.size());
  if (bytes.size() != width) {
    RaiseInvalid(std::string(what) + ": hashes of " + std::to_string(bytes.size()) + " and " +
                 std::to_string(width) + " bytes are mixed");
  }
  out.insert(out.end(), bytes.begin(), bytes.end());
}

std::optional<PyBlockEvents> BlockEvents(const py::object& engine_hashes, const py::object& parent_hash,
                                         const py::object& token_ids, uint32_t block_size,
                                         const py::object& lora_name) {
  if (engine_hashes.is_none()) {
    if (!parent_hash.is_none() || !token_ids.is_none() || !lora_name.is_none()) {
      RaiseInvalid("parent_hash, token_ids and lora_name go with engine_hashes");
    }
    return std::nullopt;
  }
  PyBlockEvents e;
  uint32_t width = 0;
  for (const py::handle h : engine_hashes) AppendEngineHash(h, "engine_hashes", e.hashes, width);
  if (!parent_hash.is_none()) AppendEngineHash(parent_hash, "parent_hash", e.parent, width);
  if (!token_ids.is_none()) e.tokens = UInt32s(token_ids, "token_ids");
  if (!lora_name.is_none()) e.lora = py::cast<std::string>(lora_name);
  e.hash_bytes = width;
  e.block_size = block_size;
  return e;
}

}  // namespace
}  // namespace kvtier::python

using namespace kvtier;          // NOLINT: the binding names every type
using namespace kvtier::python;  // NOLINT

PYBIND11_MODULE(_kvtier, m) {
  m.doc() = "The binding of libkvtier; use the kvtier package.";
  m.attr("__version__") = kvtier::Client::release();

  py::class_<Layout>(m, "Layout",
                     "The shape of one engine's KV cache block; its fingerprint names a namespace.")
      .def(py::init(&MakeLayout), py::arg("model_id"), py::arg("num_layers"),
           py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("dtype"), py::arg("block_tokens"),
           py::arg("kv_kind") = "kv", py::arg("tp_rank") = 0, py::arg("tp_size") = 1,
           "dtype: fp16, bf16, fp32, fp8_e4m3 or fp8_e5m2; kv_kind: kv (K and V) or latent (MLA).")
      .def_property_readonly("model_id", [](const Layout& l) { return l.spec().model_id; })
      .def_property_readonly("num_layers", [](const Layout& l) { return l.spec().num_layers; })
      .def_property_readonly("num_kv_heads", [](const Layout& l) { return l.spec().num_kv_heads; })
      .def_property_readonly("head_dim", [](const Layout& l) { return l.spec().head_dim; })
      .def_property_readonly("dtype",
                             [](const Layout& l) { return std::string(DTypeName(l.spec().dtype)); })
      .def_property_readonly(
          "kv_kind", [](const Layout& l) { return std::string(KvKindName(l.spec().kv_kind)); })
      .def_property_readonly("block_tokens", [](const Layout& l) { return l.spec().block_tokens; })
      .def_property_readonly("tp_rank", [](const Layout& l) { return l.spec().tp_rank; })
      .def_property_readonly("tp_size", [](const Layout& l) { return l.spec().tp_size; })
      .def_property_readonly("block_bytes", &Layout::block_bytes,
                             "Bytes of one block (all layers).")
      .def_property_readonly("tensor_bytes", &Layout::tensor_bytes,
                             "Bytes of one K (or V) tensor of one layer of one block.")
      .def_property_readonly("fingerprint", [](const Layout& l) { return l.fingerprint().ToHex(); })
      .def("__repr__", [](const Layout& l) { return "kvtier.Layout(" + l.ToString() + ")"; });

  py::class_<Placement>(
      m, "Placement",
      "Where one (layer, K/V) piece of engine block b lives: row (token t, head h) starts at "
      "regions[region] + offset_bytes + b*block_stride_bytes + t*token_stride_bytes + "
      "h*head_stride_bytes.")
      .def(py::init([](uint32_t region, uint64_t offset, uint64_t block_stride,
                       uint64_t token_stride, uint64_t head_stride) {
             return Placement{region, offset, block_stride, token_stride, head_stride};
           }),
           py::arg("region"), py::arg("offset_bytes"), py::arg("block_stride_bytes"),
           py::arg("token_stride_bytes"), py::arg("head_stride_bytes"))
      .def_readwrite("region", &Placement::region)
      .def_readwrite("offset_bytes", &Placement::offset_bytes)
      .def_readwrite("block_stride_bytes", &Placement::block_stride_bytes)
      .def_readwrite("token_stride_bytes", &Placement::token_stride_bytes)
      .def_readwrite("head_stride_bytes", &Placement::head_stride_bytes)
      .def("__repr__", [](const Placement& p) {
        return "kvtier.Placement(region=" + std::to_string(p.region) +
               ", offset_bytes=" + std::to_string(p.offset_bytes) +
               ", block_stride_bytes=" + std::to_string(p.block_stride_bytes) +
               ", token_stride_bytes=" + std::to_string(p.token_stride_bytes) +
               ", head_stride_bytes=" + std::to_string(p.head_stride_bytes) + ")";
      });
  m.def("placements", &PlacementsFor, py::arg("layout"), py::arg("num_blocks"), py::arg("scheme"),
        "The placements of an engine layout: contiguous, vllm_nhd, vllm_hnd, sglang_layer_first or "
        "sglang_page_first (docs in common/kv_cache_layout.h).");

  py::class_<ShmKvCache>(
      m, "CpuKvCache", py::buffer_protocol(),
      "A CPU KV cache in shared memory that kvtier allocates: num_blocks blocks, each in "
      "canonical order. A buffer of shape (num_blocks, block_bytes), uint8: "
      "numpy.asarray(cache) and torch.frombuffer(cache, dtype=torch.uint8) see it without a "
      "copy.")
      .def(py::init([](const Layout& layout, uint32_t num_blocks) {
             return Must(ShmKvCache::Create(layout, num_blocks));
           }),
           py::arg("layout"), py::arg("num_blocks"))
      .def_property_readonly("layout", &ShmKvCache::layout)
      .def_property_readonly("num_blocks", &ShmKvCache::num_blocks)
      .def_property_readonly("block_bytes", &ShmKvCache::block_bytes)
      .def_property_readonly("nbytes", &ShmKvCache::size_bytes)
      .def_buffer([](ShmKvCache& c) {
        return py::buffer_info(
            c.block(0).data(), 1, py::format_descriptor<uint8_t>::format(), 2,
            {static_cast<py::ssize_t>(c.num_blocks()), static_cast<py::ssize_t>(c.block_bytes())},
            {static_cast<py::ssize_t>(c.block_bytes()), py::ssize_t{1}});
      });

  py::class_<KvCache, std::shared_ptr<KvCache>>(m, "KvCache",
                                                "A KV cache registered with a Client.")
      .def_readonly("id", &KvCache::id)
      .def_readonly("layout", &KvCache::layout)
      .def_readonly("num_blocks", &KvCache::num_blocks)
      .def_readonly("kind", &KvCache::kind)
      .def("__repr__", [](const KvCache& c) {
        return "kvtier.KvCache(id=" + std::to_string(c.id) + ", kind=" + c.kind +
               ", num_blocks=" + std::to_string(c.num_blocks) + ")";
      });

  py::class_<LookupResult>(m, "LookupResult")
      .def_readonly("hits", &LookupResult::hits, "Leading keys cached.")
      .def_property_readonly(
          "tiers",
          [](const LookupResult& r) {
            std::vector<std::string> t;
            for (BlockTier x : r.tiers) t.emplace_back(BlockTierName(x));
            return t;
          },
          "The tier of each hit: hbm, host or disk.")
      .def("__repr__", [](const LookupResult& r) {
        return "kvtier.LookupResult(hits=" + std::to_string(r.hits) + ")";
      });

  py::class_<OpResult>(m, "OpResult")
      .def_readonly("blocks", &OpResult::blocks, "Blocks loaded, or newly stored.")
      .def_readonly("already", &OpResult::already, "Store: keys already present or in flight.")
      .def("__repr__", [](const OpResult& r) {
        return "kvtier.OpResult(blocks=" + std::to_string(r.blocks) +
               ", already=" + std::to_string(r.already) + ")";
      });

  py::class_<PyOp>(m, "Op", "An async load or store; wait() for its result once.")
      .def(
          "wait", &PyOp::Wait, py::arg("timeout") = py::none(),
          "Waits for the op (timeout in seconds; None = no limit) and returns its OpResult. Raises "
          "DeadlineExceededError when the timeout passes first (the op keeps running: wait again), "
          "the op's own "
          "error otherwise. After any error but DeadlineExceededError, no copy of the op touches its "
          "blocks any more.")
      .def("cancel", &PyOp::Cancel, py::arg("timeout") = py::none(),
           "Cancels the op without the daemon (it works while kvtierd is hung): copies not started "
           "never start, and this waits for any in progress (timeout in seconds; None = no limit). "
           "Once it returns, the daemon never touches the op's blocks again and the engine may reuse "
           "them. Raises DeadlineExceededError when a copy is still in progress after the timeout "
           "(kvtierd stopped in the middle of it): the blocks are not safe yet, cancel again.")
      .def_property_readonly("done", &PyOp::waited, "Whether wait() or cancel() has returned.");

  py::class_<PyClient, std::shared_ptr<PyClient>>(
      m, "Client",
      "A connection to kvtierd. Calls that wait on the daemon release "
      "the GIL. While the daemon is down every call raises "
      "UnavailableError: treat it as a miss; the client reconnects and "
      "re-registers its caches by itself.")
      .def_static(
          "connect", &PyClient::Connect, py::arg("socket_path"), py::arg("token") = py::none(),
          py::arg("name") = "", py::arg("reconnect_interval") = 0.2,
          py::arg("call_timeout") = py::none(),
          "Connects to the kvtierd listening on socket_path. The tenant comes from this "
          "process's uid, "
          "or from token when the daemon's config names tenants by token. call_timeout "
          "(seconds; None: no limit) bounds each call's wait for the daemon's reply: past it "
          "the call raises DeadlineExceededError and the connection is dropped (the next "
          "call connects again).")
      .def("close", &PyClient::Close,
           "Closes the connection; later calls raise FailedPreconditionError.")
      .def_property_readonly("closed", &PyClient::closed)
      .def_property_readonly("tenant", [](const PyClient& c) { return c.Get()->tenant(); })
      .def_property_readonly("daemon_release", [](const PyClient& c) { return c.Get()->daemon_release(); },
                             "kvtierd's version, as its Welcome said (\"0.1.0\").")
      .def_property_readonly("connected", [](const PyClient& c) { return c.Get()->connected(); })
      .def(
          "register_cpu_cache",
          [](const PyClient& self, const py::object& cache_obj, const std::string& codec,
             uint32_t fp8_group) {
            auto& cache = cache_obj.cast<ShmKvCache&>();
            const CodecChoice choice = Codec(codec, fp8_group);
            std::shared_ptr<Client> c = self.Get();
            CacheId id = WithoutGil([&] { return c->RegisterKvCache(cache, choice); });
            return std::make_shared<KvCache>(KvCache{.id = id,
                                                     .layout = cache.layout(),
                                                     .num_blocks = cache.num_blocks(),
                                                     .kind = "shm",
                                                     .keep_alive = cache_obj,
                                                     .adopted = std::nullopt,
                                                     .client_serial = self.serial()});
          },
          py::arg("cache"), py::kw_only(), py::arg("codec") = "none", py::arg("fp8_group") = 0,
          "Registers a CpuKvCache. codec: how its blocks are stored on the daemon's disk: 'none', "
          "'lossless' (bit-exact) or 'fp8' (LOSSY: E4M3 with a scale per fp8_group elements, 0 = "
          "head_dim); the tenant's config must allow it (docs/compression.md).")
      .def(
          "register_host_memory",
          [](const PyClient& self, const Layout& layout, uint32_t num_blocks,
             const py::object& regions_arg, const py::object& placements_arg,
             const std::string& codec, uint32_t fp8_group) {
            const CodecChoice choice = Codec(codec, fp8_group);
            std::vector<std::pair<uintptr_t, uint64_t>> regions = Regions(regions_arg);
            std::vector<Placement> placements = PlacementsArg(layout, num_blocks, placements_arg);
            std::shared_ptr<Client> c = self.Get();
            // What the daemon would refuse is refused before any memory moves:
            // adopted memory cannot be adopted again.
            std::vector<uint64_t> sizes;
            for (const auto& r : regions) sizes.push_back(r.second);
            Must(KvCacheLayout::Create(layout, num_blocks, placements, sizes));
            std::vector<HostRange> ranges;
            for (const auto& [ptr, size] : regions)
              ranges.push_back(HostRange{reinterpret_cast<void*>(ptr), size});
            auto out = std::make_shared<KvCache>(KvCache{.id = 0,
                                                         .layout = layout,
                                                         .num_blocks = num_blocks,
                                                         .kind = "host",
                                                         .keep_alive = py::none(),
                                                         .adopted = std::nullopt,
                                                         .client_serial = self.serial()});
            out->adopted.emplace(Must(AdoptedHostMemory::Adopt(ranges)));
            placements = Must(out->adopted->Rebase(std::move(placements)));
            std::vector<KvRegion> kv_regions = out->adopted->regions();
            CacheId id = WithoutGil([&] {
              return c->RegisterKvCache(layout, num_blocks, std::move(placements),
                                        std::move(kv_regions), choice);
            });
            out->id = id;
            return out;
          },
          py::arg("layout"), py::arg("num_blocks"), py::arg("regions"), py::arg("placements"),
          py::kw_only(), py::arg("codec") = "none", py::arg("fp8_group") = 0,
          "Registers CPU memory the engine allocated (regions: (pointer, size) pairs, e.g. of "
          "torch tensors) "
          "without moving it: see kvtier/host_memory.h. placements: a scheme name or a list of "
          "Placement.")
      .def(
          "register_cuda_memory",
          [](const PyClient& self, const Layout& layout, uint32_t num_blocks,
             const py::object& regions_arg, const py::object& placements_arg,
             const std::string& codec, uint32_t fp8_group) {
            const CodecChoice choice = Codec(codec, fp8_group);
            std::vector<CudaKvRegion> regions;
            for (const auto& [ptr, size] : Regions(regions_arg)) {
              regions.push_back(CudaKvRegion{reinterpret_cast<void*>(ptr), size});
            }
            std::vector<Placement> placements = PlacementsArg(layout, num_blocks, placements_arg);
            std::shared_ptr<Client> c = self.Get();
            CacheId id = WithoutGil([&] {
              return c->RegisterCudaKvCache(layout, num_blocks, std::move(placements),
                                            std::move(regions), choice);
            });
            return std::make_shared<KvCache>(KvCache{.id = id,
                                                     .layout = layout,
                                                     .num_blocks = num_blocks,
                                                     .kind = "cuda",
                                                     .keep_alive = py::none(),
                                                     .adopted = std::nullopt,
                                                     .client_serial = self.serial()});
          },
          py::arg("layout"), py::arg("num_blocks"), py::arg("regions"), py::arg("placements"),
          py::kw_only(), py::arg("codec") = "none", py::arg("fp8_group") = 0,
          "Registers GPU memory (regions: (device pointer, size) pairs, e.g. of CUDA tensors) "
          "through CUDA IPC. "
          "Raises UnimplementedError where libkvtier or the daemon has no CUDA.")
      .def(
          "compute_keys",
          [](const PyClient& self, const KvCache& cache, const py::object& tokens,
             const py::object& parent) {
            self.Check(cache);
            std::vector<uint32_t> t = UInt32s(tokens, "tokens");
            std::optional<BlockKey> p = OptionalKey(parent);
            std::shared_ptr<Client> c = self.Get();
            std::vector<BlockKey> keys =
                WithoutGil([&] { return c->ComputeKeys(cache.id, t, {}, p); });
            return KeyList(keys);
          },
          py::arg("cache"), py::arg("tokens"), py::arg("parent") = py::none(),
          "The chain keys (16-byte bytes) of every full block of tokens (a list or NumPy array of "
          "token ids), "
          "optionally continuing from the key of the block before them.")
      .def(
          "key_from_engine_hash",
          [](const PyClient& self, const KvCache& cache, const py::bytes& hash) {
            self.Check(cache);
            const std::string bytes = hash;
            std::shared_ptr<Client> c = self.Get();
            const auto* data = reinterpret_cast<const uint8_t*>(bytes.data());
            return KeyBytes(Must(c->KeyFromEngineHash(cache.id, std::span(data, bytes.size()))));
          },
          py::arg("cache"), py::arg("hash"),
          "An engine's own block hash (16 or 32 bytes) as a key.")
      .def(
          "lookup",
          [](const PyClient& self, const KvCache& cache, const py::object& keys) {
            self.Check(cache);
            std::vector<BlockKey> k = Keys(keys);
            std::shared_ptr<Client> c = self.Get();
            return WithoutGil([&] { return c->Lookup(cache.id, k); });
          },
          py::arg("cache"), py::arg("keys"),
          "How many leading keys are cached, and where. Pins nothing.")
      .def(
          "prefetch",
          [](const PyClient& self, const KvCache& cache, const py::object& keys) {
            self.Check(cache);
            std::vector<BlockKey> k = Keys(keys);
            std::shared_ptr<Client> c = self.Get();
            return WithoutGil([&] { return c->Prefetch(cache.id, k); });
          },
          py::arg("cache"), py::arg("keys"),
          "Starts moving the cached blocks of keys to faster tiers; returns how many leading keys "
          "are cached.")
      .def(
          "load",
          [](const PyClient& self, const KvCache& cache, const py::object& keys,
             const py::object& block_ids) {
            self.Check(cache);
            auto [k, ids] = KeysAndIds(cache, keys, block_ids);
            std::shared_ptr<Client> c = self.Get();
            return WithoutGil([&] { return c->Load(cache.id, k, ids); });
          },
          py::arg("cache"), py::arg("keys"), py::arg("block_ids"),
          "Copies the cached prefix of keys into the engine blocks block_ids; OpResult.blocks says "
          "how many.")
      .def(
          "store",
          [](const PyClient& self, const KvCache& cache, const py::object& keys,
             const py::object& block_ids, const py::object& parent, const py::object& engine_hashes,
             const py::object& parent_hash, const py::object& token_ids, uint32_t block_size,
             const py::object& lora_name, int priority, uint32_t next_use_ms, bool last_partial) {
            self.Check(cache);
            const BlockHint hint = MakeHint(priority, next_use_ms, false, last_partial);
            auto [k, ids] = KeysAndIds(cache, keys, block_ids);
            std::optional<BlockKey> p = OptionalKey(parent);
            std::optional<PyBlockEvents> ev = BlockEvents(engine_hashes, parent_hash, token_ids, block_size, lora_name);
            std::shared_ptr<Client> c = self.Get();
            const std::optional<BlockEventInfo> info = ev ? std::optional(ev->info()) : std::nullopt;
            return WithoutGil([&] { return c->Store(cache.id, k, ids, p, info ? &*info : nullptr, &hint); });
          },
          py::arg("cache"), py::arg("keys"), py::arg("block_ids"), py::arg("parent") = py::none(),
          py::kw_only(), py::arg("engine_hashes") = py::none(), py::arg("parent_hash") = py::none(),
          py::arg("token_ids") = py::none(), py::arg("block_size") = 0,
          py::arg("lora_name") = py::none(), py::arg("priority") = 0, py::arg("next_use_ms") = 0,
          py::arg("last_partial") = false,
          "Copies engine blocks block_ids out under keys (parent: the key of the block before the "
          "first). For KV events (docs/kv-events.md), optionally: the engine's hash of each block "
          "(bytes, or an int sent as its low 64 bits), of the block before the first, the blocks' "
          "token ids (block_size per key, flat) and the LoRA adapter's name. A retention hint "
          "(docs/policy.md), optionally: priority -1 (evict first), 0 or 1 (keep over unhinted "
          "blocks); next_use_ms, when the engine expects to use them again (kept until then, at "
          "most twice as long); last_partial, the last key's block is partial (not stored).")
      .def(
          "hint",
          [](const PyClient& self, const KvCache& cache, const py::object& keys, int priority,
             uint32_t next_use_ms, bool session_over) {
            self.Check(cache);
            const BlockHint hint = MakeHint(priority, next_use_ms, session_over, false);
            std::vector<BlockKey> k = Keys(keys);
            std::shared_ptr<Client> c = self.Get();
            HintResult r = WithoutGil([&] { return c->Hint(cache.id, k, hint); });
            py::dict d;
            d["hinted"] = r.hinted;
            d["refused"] = r.refused;
            return d;
          },
          py::arg("cache"), py::arg("keys"), py::kw_only(), py::arg("priority") = 0,
          py::arg("next_use_ms") = 0, py::arg("session_over") = false,
          "A retention hint for the cached blocks of keys (a request's, or a finished session's: "
          "session_over=True), replacing theirs. Returns {'hinted': blocks that took it, "
          "'refused': of which hinted to be kept past the tier's share}.")
      .def(
          "load_async",
          [](const PyClient& self, const KvCache& cache, const py::object& keys,
             const py::object& block_ids) {
            self.Check(cache);
            auto [k, ids] = KeysAndIds(cache, keys, block_ids);
            std::shared_ptr<Client> c = self.Get();
            OpHandle h = WithoutGil([&] { return c->LoadAsync(cache.id, k, ids); });
            return PyOp(c, h, "load");
          },
          py::arg("cache"), py::arg("keys"), py::arg("block_ids"),
          "As load, returning an Op to wait() for.")
      .def(
          "store_async",
          [](const PyClient& self, const KvCache& cache, const py::object& keys,
             const py::object& block_ids, const py::object& parent, const py::object& engine_hashes,
             const py::object& parent_hash, const py::object& token_ids, uint32_t block_size,
             const py::object& lora_name, int priority, uint32_t next_use_ms, bool last_partial) {
            self.Check(cache);
            const BlockHint hint = MakeHint(priority, next_use_ms, false, last_partial);
            auto [k, ids] = KeysAndIds(cache, keys, block_ids);
            std::optional<BlockKey> p = OptionalKey(parent);
            std::optional<PyBlockEvents> ev = BlockEvents(engine_hashes, parent_hash, token_ids, block_size, lora_name);
            std::shared_ptr<Client> c = self.Get();
            const std::optional<BlockEventInfo> info = ev ? std::optional(ev->info()) : std::nullopt;
            OpHandle h =
                WithoutGil([&] { return c->StoreAsync(cache.id, k, ids, p, info ? &*info : nullptr, &hint); });
            return PyOp(c, h, "store");
          },
          py::arg("cache"), py::arg("keys"), py::arg("block_ids"), py::arg("parent") = py::none(),
          py::kw_only(), py::arg("engine_hashes") = py::none(), py::arg("parent_hash") = py::none(),
          py::arg("token_ids") = py::none(), py::arg("block_size") = 0,
          py::arg("lora_name") = py::none(), py::arg("priority") = 0, py::arg("next_use_ms") = 0,
          py::arg("last_partial") = false,
          "As store, returning an Op to wait() for. The engine must not overwrite the blocks until "
          "then.")
      .def(
          "stats",
          [](const PyClient& self) {
            std::shared_ptr<Client> c = self.Get();
            DaemonStats s = WithoutGil([&] { return c->Stats(); });
            return StatsDict(s);
          },
          "The daemon's stats as a dict: the node's for an admin tenant, else this tenant's share.")
      .def(
          "evict",
          [](const PyClient& self, const std::string& tenant,
             const std::optional<std::string>& tier) {
            std::optional<BlockTier> t;
            if (tier) t = Must(ParseBlockTier(*tier));
            std::shared_ptr<Client> c = self.Get();
            return WithoutGil([&] { return c->Evict(tenant, t); });
          },
          py::arg("tenant") = "", py::arg("tier") = py::none(),
          "Drops unleased blocks: this tenant's, or (admin) another tenant's or everyone's ('*'); "
          "returns how many.")
      .def(
          "flush",
          [](const PyClient& self) {
            std::shared_ptr<Client> c = self.Get();
            return WithoutGil([&] { return c->Flush(); });
          },
          "Admin: starts writing every host block that is not on disk yet to the disk tier; "
          "returns "
          "how many writes were queued.");
}
