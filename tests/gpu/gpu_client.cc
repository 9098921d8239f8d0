// gpu_client: a real engine process for the `gpu` tests. It keeps a vLLM-like
// KV cache (per-layer [2, num_blocks, tokens, heads, head_dim] bf16 tensors)
// in GPU memory, sub-allocated from one cudaMalloc as PyTorch's caching
// allocator does, registers it with kvtierd through CUDA IPC, and stores or
// loads blocks ordered against its own CUDA stream.
//
//   gpu_client store SOCKET SEED BLOCKS   fill BLOCKS blocks from their keys and store
//                                         them; the writes are queued behind 100 ms
//                                         of other work on the engine's stream, so a
//                                         store that did not wait for them stores junk
//   gpu_client load  SOCKET SEED BLOCKS   load them into other engine blocks; the
//                                         check is queued on the stream right after
//                                         LoadAsync, before any Wait
//   gpu_client load-layers SOCKET SEED BLOCKS
//                                         load them by layer, the engine's stream
//                                         waiting on the GPU for each layer
//                                         (StreamWaitLayers) and reading it back
//   gpu_client hold  SOCKET SEED BLOCKS   store, then load and store again (the same
//                                         events, recorded by both sides) until killed
//   gpu_client store-fp8 / load-fp8 ...   the same with a cache registered with the
//                                         fp8 codec and blocks of bf16 N(0,1) values
//                                         (random bytes would hold NaNs, stored raw),
//                                         one with a NaN; a load must give exactly
//                                         what the CPU codec decodes of what it
//                                         encodes (that one: itself)
//
// Exit codes: 0 ok, 2 usage, 3 no GPU, 10+ a failed step (printed).
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <random>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "common/block_pattern.h"
#include "kernels/codec.h"
#include "kernels/copy_reference.h"
#include "kernels/cuda/cuda_util.h"
#include "kernels/fp8_e4m3.h"
#include "kvtier/client.h"
#include "tests/gpu/spin_kernel.h"

namespace kvtier {
namespace {

constexpr uint64_t kAllocatorHeadBytes = 4096;  // tensors start inside the allocation

int Fail(int code, const std::string& what) {
  std::fprintf(stderr, "gpu_client: %s\n", what.c_str());
  return code;
}

#define CUDA_OR_FAIL(expr)                                                  \
  do {                                                                      \
    if (const cudaError_t cuda_err_ = (expr); cuda_err_ != cudaSuccess) {   \
      return Fail(20, #expr ": " + std::string(cudaGetErrorName(cuda_err_))); \
    }                                                                       \
  } while (0)

struct Engine {
  Layout layout;
  uint32_t num_blocks = 0;
  std::vector<Placement> placements;
  std::vector<uint64_t> sizes;
  void* allocation = nullptr;
  std::vector<uint8_t*> device_bases;
  // A pinned host image of the regions, for filling and checking with the
  // CPU reference (pinned, so that copies to and from it are asynchronous).
  std::vector<uint8_t*> host_bases;
};

// Block `i` of an fp8 run: bf16 N(0,1) values from (seed, i); block
// kNanBlock holds a NaN too (the store's kernel does not code it: the block
// is stored as it is).
constexpr uint32_t kNanBlock = 5;
void FillNormal(uint64_t seed, uint32_t i, std::span<uint8_t> slot) {
  std::mt19937_64 rng(seed * 1'000'003 + i);
  std::normal_distribution<float> normal;
  for (size_t k = 0; k + 1 < slot.size(); k += 2) {
    const uint16_t v = fp8::FloatToBf16(normal(rng));
    std::memcpy(&slot[k], &v, 2);
  }
  if (i == kNanBlock) {
    const uint16_t nan = 0x7fc0;
    std::memcpy(&slot[1000], &nan, 2);
  }
}

int Run(std::string mode, const std::string& socket, uint64_t seed, uint32_t blocks, const std::string& token) {
  const bool fp8 = mode.ends_with("-fp8");
  if (fp8) mode.resize(mode.size() - 4);
  const CodecParams fp8_params{.kind = CodecKind::kFp8, .dtype = DType::kBf16, .group_elems = 128};
  Result<std::unique_ptr<BlockCodec>> coder = BlockCodec::Create();
  if (!coder) return Fail(10, coder.error().ToString());
  if (Result<int> n = cuda::DeviceCount(); !n) return Fail(3, "no CUDA device: " + n.error().ToString());
  Result<Layout> layout = Layout::Create(LayoutSpec{.model_id = "test/gpu-ipc",
                                                    .num_layers = 4,
                                                    .kv_kind = KvKind::kSeparateKv,
                                                    .num_kv_heads = 8,
                                                    .head_dim = 128,
                                                    .dtype = DType::kBf16,
                                                    .block_tokens = 16});
  if (!layout) return Fail(10, layout.error().ToString());
  Engine e{.layout = *layout, .num_blocks = 2 * blocks, .placements = {}, .sizes = {}, .device_bases = {},
           .host_bases = {}};
  e.placements = KvCacheLayout::VllmNhd(e.layout, e.num_blocks);
  e.sizes = KvCacheLayout::MinRegionSizes(e.layout, e.num_blocks, e.placements);
  uint64_t total = kAllocatorHeadBytes;
  for (uint64_t s : e.sizes) total += s;
  CUDA_OR_FAIL(cudaMalloc(&e.allocation, total));
  CUDA_OR_FAIL(cudaMemset(e.allocation, 0xEE, total));
  uint64_t offset = kAllocatorHeadBytes;
  for (uint64_t s : e.sizes) {
    e.device_bases.push_back(static_cast<uint8_t*>(e.allocation) + offset);
    void* h = nullptr;
    CUDA_OR_FAIL(cudaMallocHost(&h, s));
    std::memset(h, 0xEE, s);
    e.host_bases.push_back(static_cast<uint8_t*>(h));
    offset += s;
  }
  Result<KvCacheLayout> kv = KvCacheLayout::Create(e.layout, e.num_blocks, e.placements, e.sizes);
  if (!kv) return Fail(10, kv.error().ToString());
  const CopyPlan host_plan = CopyPlan::Build(*kv, MappedRegions{e.host_bases});

  Result<std::unique_ptr<Client>> client =
      Client::Connect({.socket_path = socket, .client_name = "gpu_client-" + mode});
  if (!client) return Fail(11, client.error().ToString());
  std::vector<CudaKvRegion> regions;
  for (size_t i = 0; i < e.sizes.size(); ++i) regions.push_back(CudaKvRegion{e.device_bases[i], e.sizes[i]});
  const CodecChoice codec{.kind = fp8 ? CodecKind::kFp8 : CodecKind::kNone, .fp8_group = fp8 ? 128u : 0u};
  Result<CacheId> cache = (*client)->RegisterCudaKvCache(e.layout, e.num_blocks, e.placements, regions, codec);
  if (!cache) return Fail(12, "RegisterCudaKvCache: " + cache.error().ToString());
  Result<std::vector<BlockKey>> keys =
      (*client)->ComputeKeys(*cache, PseudoTokens(seed, uint64_t{blocks} * e.layout.spec().block_tokens));
  if (!keys || keys->size() != blocks) return Fail(13, "ComputeKeys");
  cudaStream_t stream = nullptr;
  CUDA_OR_FAIL(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const uint64_t block_bytes = e.layout.block_bytes();
  std::vector<uint8_t> slot(block_bytes);

  auto store = [&](const std::vector<BlockKey>& ks) -> int {
    std::vector<uint32_t> ids;
    for (uint32_t i = 0; i < blocks; ++i) {
      if (fp8) {
        FillNormal(seed, i, slot);
      } else {
        FillFromKey(ks[i], slot);
      }
      ScatterBlock(host_plan, i, slot.data());
      ids.push_back(i);
    }
    // Written on the engine's stream behind 100 ms of other work, not
    // synchronised: the store must wait for these copies (its event), or it
    // reads what the blocks held before.
    CUDA_OR_FAIL(gpu_testing::LaunchSpin(stream, 100'000'000));
    for (size_t r = 0; r < e.sizes.size(); ++r) {
      CUDA_OR_FAIL(cudaMemcpyAsync(e.device_bases[r], e.host_bases[r], e.sizes[r], cudaMemcpyHostToDevice, stream));
    }
    Result<OpHandle> op = (*client)->StoreAsync(*cache, ks, ids, std::nullopt, stream);
    if (!op) return Fail(14, "StoreAsync: " + op.error().ToString());
    // Its completion event fires once the store is over, so the result is
    // ready by then.
    if (op->event == nullptr) return Fail(15, "no completion event for a store with free events");
    CUDA_OR_FAIL(cudaEventSynchronize(static_cast<cudaEvent_t>(op->event)));
    Result<OpResult> r = (*client)->Wait(*op, std::chrono::milliseconds(2000));
    if (!r || r->blocks + r->already != blocks) return Fail(16, "store Wait: " + (r ? std::to_string(r->blocks) : r.error().ToString()));
    return 0;
  };

  auto load = [&](const std::vector<BlockKey>& ks) -> int {
    Result<LookupResult> hit = (*client)->Lookup(*cache, ks);
    if (!hit || hit->hits != blocks) return Fail(17, "Lookup: " + (hit ? std::to_string(hit->hits) : hit.error().ToString()));
    // Into the other half of the cache, reversed.
    std::vector<uint32_t> ids;
    for (uint32_t i = 0; i < blocks; ++i) ids.push_back(e.num_blocks - 1 - i);
    Result<OpHandle> op = (*client)->LoadAsync(*cache, ks, ids, stream);
    if (!op) return Fail(18, "LoadAsync: " + op.error().ToString());
    if (op->event == nullptr || op->event_blocks != blocks) return Fail(19, "the load was not queued with an event");
    // Read back on the same stream with no Wait: the stream waits for the
    // daemon's copies on the GPU.
    for (size_t r = 0; r < e.sizes.size(); ++r) {
      CUDA_OR_FAIL(cudaMemcpyAsync(e.host_bases[r], e.device_bases[r], e.sizes[r], cudaMemcpyDeviceToHost, stream));
    }
    CUDA_OR_FAIL(cudaStreamSynchronize(stream));
    std::vector<uint8_t> want(block_bytes);
    std::vector<uint8_t> coded(BlockCodec::MaxEncodedBytes(fp8_params, block_bytes));
    for (uint32_t i = 0; i < blocks; ++i) {
      GatherBlock(host_plan, ids[i], slot.data());
      if (!fp8) {
        if (!MatchesKey(ks[i], slot)) return Fail(21, "loaded block " + std::to_string(i) + " differs from its key");
        continue;
      }
      FillNormal(seed, i, want);
      const std::optional<size_t> n = (*coder)->Encode(fp8_params, want, coded);
      if (n.has_value() == (i == kNanBlock)) return Fail(23, "the CPU codec coded block " + std::to_string(i) + " wrong");
      if (n && !(*coder)->Decode(fp8_params, std::span(coded.data(), *n), want).ok()) {
        return Fail(23, "the CPU codec did not decode block " + std::to_string(i));
      }
      if (slot != want) return Fail(21, "loaded fp8 block " + std::to_string(i) + " differs from the CPU codec's");
    }
    Result<OpResult> r = (*client)->Wait(*op);
    if (!r || r->blocks != blocks) return Fail(22, "load Wait");
    return 0;
  };

  // A load by layer, waited for on the engine's stream layer by layer
  // (StreamWaitLayers): each layer's tensor (region l: vLLM's layout) is
  // read back on the stream right after its wait, before the later layers'
  // waits and before any Wait, so a wait that did not hold the stream until
  // its layer was in place reads a layer not yet (or not wholly) loaded.
  auto load_layers = [&](const std::vector<BlockKey>& ks) -> int {
    std::vector<uint32_t> ids;
    for (uint32_t i = 0; i < blocks; ++i) ids.push_back(e.num_blocks - 1 - i);
    Result<OpHandle> op = (*client)->LoadLayersAsync(*cache, ks, ids);
    if (!op) return Fail(18, "LoadLayersAsync: " + op.error().ToString());
    const uint32_t layers = e.layout.spec().num_layers;
    for (uint32_t l = 0; l < layers; ++l) {
      if (Status st = (*client)->StreamWaitLayers(*op, l + 1, stream); !st.ok()) {
        return Fail(26, "StreamWaitLayers(" + std::to_string(l + 1) + "): " + st.ToString());
      }
      CUDA_OR_FAIL(cudaMemcpyAsync(e.host_bases[l], e.device_bases[l], e.sizes[l], cudaMemcpyDeviceToHost, stream));
    }
    CUDA_OR_FAIL(cudaStreamSynchronize(stream));
    Result<OpResult> r = (*client)->Wait(*op);
    if (!r || r->blocks != blocks) return Fail(22, "load Wait");
    for (uint32_t i = 0; i < blocks; ++i) {
      GatherBlock(host_plan, ids[i], slot.data());
      if (!MatchesKey(ks[i], slot)) {
        return Fail(21, "block " + std::to_string(i) + " read back after each layer's wait differs from its key");
      }
    }
    // Over: its progress word has no op any more.
    if (Status st = (*client)->StreamWaitLayers(*op, 1, stream); st.code() != StatusCode::kInvalidArgument) {
      return Fail(27, "StreamWaitLayers of an op whose result was collected: " + st.ToString());
    }
    return 0;
  };

  if (mode == "store") return store(*keys);
  if (mode == "load") return load(*keys);
  if (mode == "load-layers") return load_layers(*keys);
  if (fp8) return Fail(2, "no fp8 variant of " + mode);
  if (mode == "steal") {
    // Another tenant (`token`) presents the same allocation's IPC handle
    // (the same bytes: the same memory): the daemon must refuse it, not
    // share the first tenant's opened handle with it.
    Result<std::unique_ptr<Client>> other =
        Client::Connect({.socket_path = socket, .token = token, .client_name = "gpu_client-steal"});
    if (!other) return Fail(11, "the other tenant's Connect: " + other.error().ToString());
    Result<CacheId> stolen = (*other)->RegisterCudaKvCache(e.layout, e.num_blocks, e.placements, regions, codec);
    if (stolen) return Fail(24, "another tenant registered the memory this tenant had registered");
    if (stolen.error().code() != StatusCode::kPermissionDenied) {
      return Fail(25, "the other tenant's registration: " + stolen.error().ToString());
    }
    // The owner's registration is untouched.
    if (int rc = store(*keys); rc != 0) return rc;
    return load(*keys);
  }
  if (mode == "hold") {
    if (int rc = store(*keys); rc != 0) return rc;
    for (uint64_t round = 1;; ++round) {
      if (int rc = load(*keys); rc != 0) return rc;
      // New keys each round, so that every store copies.
      Result<std::vector<BlockKey>> more = (*client)->ComputeKeys(
          *cache, PseudoTokens(seed * 1000 + round, uint64_t{blocks} * e.layout.spec().block_tokens));
      if (!more) return Fail(13, "ComputeKeys");
      if (int rc = store(*more); rc != 0) return rc;
      if (int rc = load(*more); rc != 0) return rc;
    }
  }
  return Fail(2, "unknown mode " + mode);
}

}  // namespace
}  // namespace kvtier

int main(int argc, char** argv) {
  if (argc != 5 && argc != 6) {
    std::fprintf(stderr,
                 "usage: gpu_client store|load|load-layers|hold|store-fp8|load-fp8|steal SOCKET SEED BLOCKS "
                 "[OTHER_TENANT_TOKEN]\n");
    return 2;
  }
  return kvtier::Run(argv[1], argv[2], std::strtoull(argv[3], nullptr, 10),
                     static_cast<uint32_t>(std::strtoul(argv[4], nullptr, 10)), argc == 6 ? argv[5] : "");
}
