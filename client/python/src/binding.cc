// The Python binding's converters and helpers (binding.h).
#include "binding.h"

#include <pybind11/numpy.h>

namespace kvtier::python {

[[noreturn]] void Raise(const Status& status) {
  py::object errors = py::module_::import("kvtier._errors");
  py::object cls = errors.attr("error_class")(std::string(StatusCodeName(status.code())));
  PyErr_SetObject(
      cls.ptr(),
      py::make_tuple(status.message(), std::string(StatusCodeName(status.code()))).ptr());
  throw py::error_already_set();
}

[[noreturn]] void RaiseInvalid(const std::string& message) { Raise(InvalidArgument(message)); }

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

CodecChoice Codec(const std::string& name, uint32_t fp8_group) {
  return CodecChoice{.kind = Must(ParseCodec(name)), .fp8_group = fp8_group};
}

bool IsNumpyArray(const py::handle& obj) {
  PyObject* numpy = PyDict_GetItemString(PyImport_GetModuleDict(), "numpy");  // borrowed
  return numpy != nullptr && numpy != Py_None && py::isinstance<py::array>(obj);
}

std::vector<uint32_t> UInt32s(const py::handle& obj, const char* what, uint64_t max) {
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

uint64_t NextSerial() {
  static uint64_t serial = 0;
  return ++serial;
}

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

BlockHint MakeHint(int priority, uint32_t next_use_ms, bool session_over, bool last_partial, bool engine_holds,
                   bool engine_dropped) {
  return BlockHint{.priority = priority,
                   .next_use_ms = next_use_ms,
                   .session_over = session_over,
                   .last_partial = last_partial,
                   .engine_holds = engine_holds,
                   .engine_dropped = engine_dropped};
}

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

}  // namespace kvtier::python
