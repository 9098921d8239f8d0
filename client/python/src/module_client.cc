// The binding's kvtier.Client: connecting, registering KV caches (CPU memory,
// engines' tensors in place, CUDA tensors through CUDA IPC), keys, lookups,
// hints, loads and stores, and the operator's calls.
#include <cmath>

#include "binding.h"

namespace kvtier::python {
namespace {

void CheckPrefillRate(double tokens_per_s) {
  if (!std::isfinite(tokens_per_s) || tokens_per_s < 0) {
    RaiseInvalid("prefill_tokens_per_s must be >= 0 and finite (0: every hit)");
  }
}

}  // namespace

void BindClient(py::module_& m) {
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
      .def_property_readonly(
          "max_keys_per_request", [](const PyClient& c) { return c.Get()->max_keys_per_request(); },
          "The most keys kvtierd takes in one request (its Welcome's limits.max_keys_per_request). "
          "lookup, prefetch and hint split longer lists themselves; load and store (and their "
          "async forms) of more keys raise InvalidArgumentError: split those into ops of at most "
          "this many keys.")
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
                                                     .adopted = nullptr,
                                                     .adopted_regions = {},
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
             const std::string& codec, uint32_t fp8_group, const KvCache* same_memory_as) {
            const CodecChoice choice = Codec(codec, fp8_group);
            std::vector<std::pair<uintptr_t, uint64_t>> regions = Regions(regions_arg);
            std::vector<Placement> placements = PlacementsArg(layout, num_blocks, placements_arg);
            std::shared_ptr<Client> c = self.Get();
            // What the daemon would refuse is refused before any memory moves:
            // adopted memory cannot be adopted again.
            std::vector<uint64_t> sizes;
            for (const auto& r : regions) sizes.push_back(r.second);
            Must(KvCacheLayout::Create(layout, num_blocks, placements, sizes));
            std::shared_ptr<const AdoptedHostMemory> adopted;
            if (same_memory_as != nullptr) {
              self.Check(*same_memory_as);
              if (same_memory_as->adopted == nullptr || same_memory_as->adopted_regions != regions) {
                RaiseInvalid(
                    "same_memory_as: a host KV cache registered over the same regions, in the same "
                    "order, is needed");
              }
              adopted = same_memory_as->adopted;
            } else {
              std::vector<HostRange> ranges;
              for (const auto& [ptr, size] : regions)
                ranges.push_back(HostRange{reinterpret_cast<void*>(ptr), size});
              adopted = std::make_shared<const AdoptedHostMemory>(Must(AdoptedHostMemory::Adopt(ranges)));
            }
            placements = Must(adopted->Rebase(std::move(placements)));
            std::vector<KvRegion> kv_regions = adopted->regions();
            CacheId id = WithoutGil([&] {
              return c->RegisterKvCache(layout, num_blocks, std::move(placements),
                                        std::move(kv_regions), choice);
            });
            return std::make_shared<KvCache>(KvCache{.id = id,
                                                     .layout = layout,
                                                     .num_blocks = num_blocks,
                                                     .kind = "host",
                                                     .keep_alive = py::none(),
                                                     .adopted = std::move(adopted),
                                                     .adopted_regions = std::move(regions),
                                                     .client_serial = self.serial()});
          },
          py::arg("layout"), py::arg("num_blocks"), py::arg("regions"), py::arg("placements"),
          py::kw_only(), py::arg("codec") = "none", py::arg("fp8_group") = 0,
          py::arg("same_memory_as") = nullptr,
          "Registers CPU memory the engine allocated (regions: (pointer, size) pairs, e.g. of "
          "torch tensors) "
          "without moving it: see kvtier/host_memory.h. placements: a scheme name or a list of "
          "Placement. same_memory_as: a host KvCache of this client registered over the same "
          "regions; this cache shares its memory (another view of it: vLLM's hybrid KV cache "
          "groups, whose layers share tensors) instead of adopting it again, which is refused.")
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
                                                     .adopted = nullptr,
                                                     .adopted_regions = {},
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
          [](const PyClient& self, const KvCache& cache, const py::object& keys, double prefill_tokens_per_s) {
            self.Check(cache);
            CheckPrefillRate(prefill_tokens_per_s);
            std::vector<BlockKey> k = Keys(keys);
            std::shared_ptr<Client> c = self.Get();
            return WithoutGil([&] { return c->Lookup(cache.id, k, prefill_tokens_per_s); });
          },
          py::arg("cache"), py::arg("keys"), py::kw_only(), py::arg("prefill_tokens_per_s") = 0.0,
          "How many leading keys are cached, and where. Pins nothing. prefill_tokens_per_s (the "
          "engine's prefill rate, as it measures it): hits kvtierd expects to load slower than the "
          "engine computes them are left out (LookupResult.recompute counts them).")
      .def(
          "prefetch",
          [](const PyClient& self, const KvCache& cache, const py::object& keys, double prefill_tokens_per_s) {
            self.Check(cache);
            CheckPrefillRate(prefill_tokens_per_s);
            std::vector<BlockKey> k = Keys(keys);
            std::shared_ptr<Client> c = self.Get();
            return WithoutGil([&] { return c->Prefetch(cache.id, k, prefill_tokens_per_s); });
          },
          py::arg("cache"), py::arg("keys"), py::kw_only(), py::arg("prefill_tokens_per_s") = 0.0,
          "Starts moving the cached blocks of keys to faster tiers; returns how many leading keys "
          "are cached (with prefill_tokens_per_s, as lookup: worth loading, and only those move).")
      .def(
          "load",
          [](const PyClient& self, const KvCache& cache, const py::object& keys,
             const py::object& block_ids, bool engine_holds) {
            self.Check(cache);
            auto [k, ids] = KeysAndIds(cache, keys, block_ids);
            std::shared_ptr<Client> c = self.Get();
            const BlockHint hint = MakeHint(0, 0, false, false, engine_holds);
            return WithoutGil([&] { return c->Load(cache.id, k, ids, &hint); });
          },
          py::arg("cache"), py::arg("keys"), py::arg("block_ids"), py::kw_only(), py::arg("engine_holds") = false,
          "Copies the cached prefix of keys into the engine blocks block_ids; OpResult.blocks says "
          "how many.")
      .def(
          "store",
          [](const PyClient& self, const KvCache& cache, const py::object& keys,
             const py::object& block_ids, const py::object& parent, const py::object& engine_hashes,
             const py::object& parent_hash, const py::object& token_ids, uint32_t block_size,
             const py::object& lora_name, int priority, uint32_t next_use_ms, bool last_partial, bool engine_holds) {
            self.Check(cache);
            const BlockHint hint = MakeHint(priority, next_use_ms, false, last_partial, engine_holds);
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
          py::arg("last_partial") = false, py::arg("engine_holds") = false,
          "Copies engine blocks block_ids out under keys (parent: the key of the block before the "
          "first). For KV events (docs/kv-events.md), optionally: the engine's hash of each block "
          "(bytes, or an int sent as its low 64 bits), of the block before the first, the blocks' "
          "token ids (block_size per key, flat) and the LoRA adapter's name. A retention hint "
          "(docs/policy.md), optionally: priority -1 (evict first), 0 or 1 (keep over unhinted "
          "blocks); next_use_ms, when the engine expects to use them again (kept until then, at "
          "most twice as long); last_partial, the last key's block is partial (not stored); "
          "engine_holds, the engine keeps a copy in its own cache (evicted first until a hit or "
          "hint(engine_dropped=True)).")
      .def(
          "hint",
          [](const PyClient& self, const KvCache& cache, const py::object& keys, int priority,
             uint32_t next_use_ms, bool session_over, bool engine_dropped) {
            self.Check(cache);
            const BlockHint hint = MakeHint(priority, next_use_ms, session_over, false, false, engine_dropped);
            std::vector<BlockKey> k = Keys(keys);
            std::shared_ptr<Client> c = self.Get();
            HintResult r = WithoutGil([&] { return c->Hint(cache.id, k, hint); });
            py::dict d;
            d["hinted"] = r.hinted;
            d["refused"] = r.refused;
            return d;
          },
          py::arg("cache"), py::arg("keys"), py::kw_only(), py::arg("priority") = 0,
          py::arg("next_use_ms") = 0, py::arg("session_over") = false, py::arg("engine_dropped") = false,
          "A retention hint for the cached blocks of keys (a request's, or a finished session's: "
          "session_over=True), replacing theirs; or engine_dropped=True: the engine let go of its own "
          "copies, and those stored with engine_holds are kvtier's only ones now. Returns {'hinted': blocks that took it, "
          "'refused': of which hinted to be kept past the tier's share}.")
      .def(
          "load_async",
          [](const PyClient& self, const KvCache& cache, const py::object& keys,
             const py::object& block_ids, bool by_layer, bool engine_holds) {
            self.Check(cache);
            auto [k, ids] = KeysAndIds(cache, keys, block_ids);
            std::shared_ptr<Client> c = self.Get();
            const BlockHint hint = MakeHint(0, 0, false, false, engine_holds);
            OpHandle h = WithoutGil([&] {
              return by_layer ? c->LoadLayersAsync(cache.id, k, ids, &hint) : c->LoadAsync(cache.id, k, ids, &hint);
            });
            return PyOp(c, h, "load");
          },
          py::arg("cache"), py::arg("keys"), py::arg("block_ids"), py::kw_only(), py::arg("by_layer") = false,
          py::arg("engine_holds") = false,
          "As load, returning an Op to wait() for. by_layer: copied layer by layer (every block's "
          "layer l before any block's layer l + 1); Op.wait_layers(n) returns once the first n "
          "layers are in place, so the engine computes them while the rest is copied. engine_holds "
          "(also load's): the engine keeps the blocks it loads in its own cache; after this use "
          "they are evicted first, as a store's engine_holds blocks.")
      .def(
          "store_async",
          [](const PyClient& self, const KvCache& cache, const py::object& keys,
             const py::object& block_ids, const py::object& parent, const py::object& engine_hashes,
             const py::object& parent_hash, const py::object& token_ids, uint32_t block_size,
             const py::object& lora_name, int priority, uint32_t next_use_ms, bool last_partial, bool by_layer,
             bool engine_holds) {
            self.Check(cache);
            const BlockHint hint = MakeHint(priority, next_use_ms, false, last_partial, engine_holds);
            auto [k, ids] = KeysAndIds(cache, keys, block_ids);
            std::optional<BlockKey> p = OptionalKey(parent);
            std::optional<PyBlockEvents> ev = BlockEvents(engine_hashes, parent_hash, token_ids, block_size, lora_name);
            std::shared_ptr<Client> c = self.Get();
            const std::optional<BlockEventInfo> info = ev ? std::optional(ev->info()) : std::nullopt;
            OpHandle h = WithoutGil([&] {
              return by_layer ? c->StoreLayersAsync(cache.id, k, ids, p, info ? &*info : nullptr, &hint)
                              : c->StoreAsync(cache.id, k, ids, p, info ? &*info : nullptr, &hint);
            });
            return PyOp(c, h, "store");
          },
          py::arg("cache"), py::arg("keys"), py::arg("block_ids"), py::arg("parent") = py::none(),
          py::kw_only(), py::arg("engine_hashes") = py::none(), py::arg("parent_hash") = py::none(),
          py::arg("token_ids") = py::none(), py::arg("block_size") = 0,
          py::arg("lora_name") = py::none(), py::arg("priority") = 0, py::arg("next_use_ms") = 0,
          py::arg("last_partial") = false, py::arg("by_layer") = false, py::arg("engine_holds") = false,
          "As store, returning an Op to wait() for. The engine must not overwrite the blocks until "
          "then. by_layer: the engine is still writing them, layer after layer; each layer is "
          "copied once Op.layers_written(n) says it is written (CPU caches; UnimplementedError from "
          "a kvtierd that copies stores whole).")
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

}  // namespace kvtier::python
