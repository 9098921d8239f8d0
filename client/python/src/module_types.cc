// The binding's value types: Layout, Placement and placements(), CpuKvCache
// (ShmKvCache), KvCache, LookupResult, OpResult and Op.
#include "binding.h"

namespace kvtier::python {

void BindTypes(py::module_& m) {

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
  m.def("default_socket", &ClientDefaultSocket,
        "The socket to connect to when none is named: $KVTIER_SOCKET, else the first of "
        "default_socket_candidates() where a kvtierd listens, else /run/kvtier/kvtierd.sock. "
        "kvtierd started without socket.path resolves its own the same way.");
  m.def("default_socket_candidates", &DefaultSocketCandidates,
        "Where default_socket() looks, in order: $KVTIER_SOCKET alone when set, else "
        "/run/kvtier/kvtierd.sock, $XDG_RUNTIME_DIR/kvtier/kvtierd.sock (when set), "
        "./var/kvtier/kvtierd.sock.");

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
      .def_readonly("recompute", &LookupResult::recompute,
                    "With prefill_tokens_per_s: keys cached past `hits`, left out as slower to load than to "
                    "compute.")
      .def("__repr__", [](const LookupResult& r) {
        return "kvtier.LookupResult(hits=" + std::to_string(r.hits) + ", recompute=" + std::to_string(r.recompute) +
               ")";
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
      .def("wait_layers", &PyOp::WaitLayers, py::arg("layers"), py::arg("timeout") = py::none(),
           "A load_async(by_layer=True): waits until the first `layers` layers of every block it "
           "loads are in place (True), with no round trip to kvtierd. False once the op is over "
           "without them (wait() gives its result: an error, or fewer blocks). Raises "
           "DeadlineExceededError after the timeout (seconds; None = no limit).")
      .def("stream_wait_layers", &PyOp::StreamWaitLayers, py::arg("layers"), py::arg("stream"),
           "A load_async(by_layer=True) into a GPU engine: the CUDA stream `stream` (its handle, "
           "e.g. torch.cuda.current_stream().cuda_stream) waits on the GPU until the first `layers` "
           "layers of every block it loads are in place, or the op is over (wait() then says how many "
           "blocks it loaded: what the stream computed from the others is to be thrown away). Returns "
           "at once; no thread waits. Raises UnavailableError where the GPU cannot (no 64-bit stream "
           "memory operations: use wait_layers).")
      .def("layers_written", &PyOp::LayersWritten, py::arg("layers"),
           "A store_async(by_layer=True): the first `layers` layers of its blocks are written "
           "(more than the model has: all). One message to kvtierd, no reply awaited; nothing for an "
           "op that is over or cancelled. Raises DeadlineExceededError when kvtierd is not reading "
           "(the store is then given up by kvtierd).")
      .def_property_readonly("done", &PyOp::waited, "Whether wait() or cancel() has returned.");
}

}  // namespace kvtier::python
