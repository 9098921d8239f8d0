#include "tools/bench_gpu.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "common/device_backend.h"
#include "common/kv_cache_layout.h"
#include "common/layout.h"
#include "common/status.h"
#include "kernels/codec.h"
#include "kernels/copy_plan.h"
#include "kernels/copy_reference.h"
#include "kernels/cuda/codec_kernels.h"
#include "kernels/cuda/copy_kernels.h"
#include "kernels/cuda/cuda_util.h"
#include "tools/bench_report.h"

namespace kvtier::bench {
namespace {

constexpr uint32_t kLayers = 32;
constexpr uint32_t kKvHeads = 8;
constexpr uint32_t kHeadDim = 128;
// One token of every layer's K and V in bf16 (128 KiB): a block is a whole
// number of tokens, 16 of them in the default 2 MiB block.
constexpr uint64_t kTokenBytes = uint64_t{kLayers} * 2 * kKvHeads * kHeadDim * 2;
// Blocks per direction compared with the CPU reference.
constexpr uint32_t kVerifyBlocks = 16;
// Seed of the permutation that scatters the copied blocks over the cache.
constexpr uint64_t kPermutationSeed = 0x6b767469657231;
// Host staging for filling the engine regions.
constexpr uint64_t kFillChunkBytes = 16 << 20;
// The fp8 codec's groups: one head's head_dim values of one token, kvtier's
// default (common/layout.h).
constexpr uint32_t kFp8GroupElems = kHeadDim;
// Informational target ratios (kvtier / contiguous cudaMemcpy).
constexpr double kTargetHostDevice = 0.9;
constexpr double kTargetDeviceDevice = 0.8;

// splitmix64's finaliser: a cheap, well-mixed word for position `x`.
uint64_t Mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9;
  x = (x ^ (x >> 27)) * 0x94d049bb133111eb;
  return x ^ (x >> 31);
}

// Fills `size_bytes` at `p` with the words of pattern `stream` starting at
// word `first_word`, so that every byte of every region or slot differs.
void FillPattern(uint8_t* p, uint64_t size_bytes, uint64_t stream, uint64_t first_word) {
  for (uint64_t w = 0; w * 8 < size_bytes; ++w) {
    const uint64_t v = Mix((stream << 44) ^ (first_word + w));
    std::memcpy(p + w * 8, &v, std::min<uint64_t>(8, size_bytes - w * 8));
  }
}

// Clears the top exponent bit of every 2-byte element, so that the bytes
// read as finite bf16 values below 2 in magnitude: what the fp8 codec
// encodes (a NaN or an Inf makes it store the block raw).
void MakeFiniteBf16(uint8_t* p, uint64_t size_bytes) {
  for (uint64_t i = 1; i < size_bytes; i += 2) p[i] &= 0xbf;
}

struct StreamDeleter {
  void operator()(cudaStream_t s) const { (void)cudaStreamDestroy(s); }
};
struct EventDeleter {
  void operator()(cudaEvent_t e) const { (void)cudaEventDestroy(e); }
};
using UniqueStream = std::unique_ptr<std::remove_pointer_t<cudaStream_t>, StreamDeleter>;
using UniqueEvent = std::unique_ptr<std::remove_pointer_t<cudaEvent_t>, EventDeleter>;

// cudaHostAlloc'd bytes (mapped and portable, as kvtier's pinned host pool),
// freed on destruction. host() and device() address the same bytes.
class PinnedBuffer {
 public:
  static Result<PinnedBuffer> Allocate(uint64_t size_bytes) {
    PinnedBuffer b;
    void* host = nullptr;
    KVTIER_CUDA_RETURN_IF_ERROR(
        cudaHostAlloc(&host, size_bytes, cudaHostAllocMapped | cudaHostAllocPortable),
        "cudaHostAlloc of " + std::to_string(size_bytes) + " bytes");
    b.host_ = static_cast<uint8_t*>(host);
    void* device = nullptr;
    KVTIER_CUDA_RETURN_IF_ERROR(cudaHostGetDevicePointer(&device, host, 0),
                                "cudaHostGetDevicePointer");
    b.device_ = static_cast<uint8_t*>(device);
    return b;
  }
  PinnedBuffer() = default;
  PinnedBuffer(PinnedBuffer&& o) noexcept
      : host_(std::exchange(o.host_, nullptr)), device_(std::exchange(o.device_, nullptr)) {}
  PinnedBuffer& operator=(PinnedBuffer&& o) noexcept {
    if (this != &o) {
      Reset();
      host_ = std::exchange(o.host_, nullptr);
      device_ = std::exchange(o.device_, nullptr);
    }
    return *this;
  }
  ~PinnedBuffer() { Reset(); }

  uint8_t* host() const { return host_; }
  uint8_t* device() const { return device_; }

 private:
  void Reset() {
    if (host_ != nullptr) (void)cudaFreeHost(host_);
    host_ = device_ = nullptr;
  }
  uint8_t* host_ = nullptr;
  uint8_t* device_ = nullptr;
};

// A gate that holds the timing stream while one repetition is queued, so its
// copies run back to back and the host's launch latency is not timed (what
// nvbench's blocking kernel does, with a host function instead). The host
// function reads these globals, never a pointer that could dangle, and gives
// up after kGateTimeout so that a copy call that unexpectedly blocks the host
// cannot deadlock the benchmark.
std::atomic<bool> g_gate_open{true};        // release by the host thread, acquire by CUDA's
std::atomic<bool> g_gate_timed_out{false};  // relaxed: read after a stream sync
constexpr auto kGateTimeout = std::chrono::seconds(5);

void CUDART_CB WaitForGate(void* /*unused*/) {
  const auto deadline = Clock::now() + kGateTimeout;
  while (!g_gate_open.load(std::memory_order_acquire)) {
    if (Clock::now() > deadline) {
      g_gate_timed_out.store(true, std::memory_order_relaxed);
      return;
    }
    std::this_thread::yield();
  }
}

// One copy of the whole batch, queued on the timing stream.
struct Op {
  std::string name;
  std::function<cudaError_t()> queue;
};

struct Medians {
  double kvtier_ms = 0;
  double baseline_ms = 0;
};

Result<Layout> ModelLayout(uint64_t block_bytes) {
  return Layout::Create({.model_id = "kvtier-bench/llama-3-8b-like",
                         .num_layers = kLayers,
                         .kv_kind = KvKind::kSeparateKv,
                         .num_kv_heads = kKvHeads,
                         .head_dim = kHeadDim,
                         .dtype = DType::kBf16,
                         .block_tokens = static_cast<uint32_t>(block_bytes / kTokenBytes),
                         .tp_rank = 0,
                         .tp_size = 1,
                         .scale_bytes_per_layer = 0});
}

Result<std::vector<Placement>> EnginePlacements(const std::string& name, const Layout& layout,
                                                uint32_t blocks) {
  if (name == "vllm-nhd") return KvCacheLayout::VllmNhd(layout, blocks);
  if (name == "vllm-hnd") return KvCacheLayout::VllmHnd(layout, blocks);
  if (name == "sglang-layer-first") return KvCacheLayout::SglangLayerFirst(layout, blocks);
  if (name == "sglang-page-first") return KvCacheLayout::SglangPageFirst(layout, blocks);
  if (name == "contiguous") return KvCacheLayout::Contiguous(layout);
  return Err(InvalidArgument("unknown --layout " + name));
}

// Up to kVerifyBlocks indices into a copy list of `n`, evenly spread, the
// first and the last included.
std::vector<uint32_t> VerifyIndices(uint32_t n) {
  std::vector<uint32_t> v;
  if (n <= kVerifyBlocks) {
    for (uint32_t i = 0; i < n; ++i) v.push_back(i);
    return v;
  }
  for (uint32_t i = 0; i < kVerifyBlocks; ++i)
    v.push_back(static_cast<uint32_t>(uint64_t{i} * (n - 1) / (kVerifyBlocks - 1)));
  return v;
}

// The engine cache, the slots and the timing stream of one run. Owned by
// Gpu(); its device must be current.
class GpuBench {
 public:
  static Result<std::unique_ptr<GpuBench>> Create(const GpuOptions& o, KvCacheLayout kv);

  // Prints the engine and plan shape.
  void PrintConfig() const;
  // Checks every direction once against the CPU reference; prints what was
  // verified. Errors: kCorruption naming the first differing byte, CUDA.
  Status Verify();
  // The timed comparisons (four copies, the fp8 encode and decode), in GB/s.
  Result<std::vector<Comparison>> Measure();

 private:
  GpuBench(const GpuOptions& o, KvCacheLayout kv) : o_(o), kv_(std::move(kv)) {}
  uint64_t block_bytes() const { return kv_.layout().block_bytes(); }
  Status FillEngine();
  Status MirrorEngine();
  Status Sync() {
    KVTIER_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_.get()), "cudaStreamSynchronize");
    return Status();
  }
  Status CompareWithReference(std::span<const BlockCopy> copies, std::string_view what);
  // Checks the fp8 encode and decode kernels against the CPU codec.
  Status VerifyCodec();
  CodecParams fp8() const { return {.kind = CodecKind::kFp8, .dtype = DType::kBf16, .group_elems = kFp8GroupElems}; }
  Result<Medians> TimePair(const Op& kvtier, const Op& baseline);

  const GpuOptions o_;
  const KvCacheLayout kv_;
  uint64_t copy_bytes_ = 0;  // blocks * block_bytes
  std::vector<cuda::DeviceBuffer> regions_;
  CopyPlan plan_;  // over regions_
  cuda::DevicePlan device_plan_;
  // Host copies of the engine regions and the plan over them (the reference).
  std::vector<std::unique_ptr<uint8_t[]>> mirror_;
  CopyPlan mirror_plan_;
  PinnedBuffer pinned_;         // blocks slots in mapped pinned host memory
  cuda::DeviceBuffer arena_;    // blocks slots in HBM
  cuda::DeviceBuffer scratch_;  // the other end of the baselines' copies
  std::vector<BlockCopy> to_pinned_, to_arena_;
  // fp8: the coded slots (pinned host, as the host tier's), the kernels'
  // flags (one per block) and the copy lists.
  cuda::Fp8Shape shape_;
  uint64_t coded_bytes_ = 0;  // per block
  PinnedBuffer coded_;
  PinnedBuffer flags_;
  std::vector<cuda::CodedBlock> to_coded_;
  UniqueStream stream_;
  UniqueEvent events_[3];
};

Result<std::unique_ptr<GpuBench>> GpuBench::Create(const GpuOptions& o, KvCacheLayout kv) {
  std::unique_ptr<GpuBench> b(new GpuBench(o, std::move(kv)));
  b->copy_bytes_ = uint64_t{o.blocks} * b->block_bytes();
  const std::vector<uint64_t>& sizes = b->kv_.region_sizes_bytes();
  std::vector<uint8_t*> bases, mirror_bases;
  for (uint64_t size : sizes) {
    KVTIER_ASSIGN_OR_RETURN(cuda::DeviceBuffer region,
                            cuda::DeviceBuffer::Allocate(o.device, std::max<uint64_t>(size, 1)));
    bases.push_back(region.data());
    b->regions_.push_back(std::move(region));
    b->mirror_.emplace_back(new uint8_t[std::max<uint64_t>(size, 1)]);
    mirror_bases.push_back(b->mirror_.back().get());
  }
  b->plan_ = CopyPlan::Build(b->kv_, MappedRegions{bases});
  b->mirror_plan_ = CopyPlan::Build(b->kv_, MappedRegions{mirror_bases});
  KVTIER_ASSIGN_OR_RETURN(b->device_plan_, cuda::DevicePlan::Upload(b->plan_, o.device));
  KVTIER_ASSIGN_OR_RETURN(b->pinned_, PinnedBuffer::Allocate(b->copy_bytes_));
  KVTIER_ASSIGN_OR_RETURN(b->arena_, cuda::DeviceBuffer::Allocate(o.device, b->copy_bytes_));
  KVTIER_ASSIGN_OR_RETURN(b->scratch_, cuda::DeviceBuffer::Allocate(o.device, b->copy_bytes_));
  b->shape_ = cuda::Fp8ShapeOf(b->block_bytes(), kFp8GroupElems, /*bf16=*/true);
  b->coded_bytes_ = uint64_t{b->shape_.groups} * 4 + b->shape_.elems;
  KVTIER_ASSIGN_OR_RETURN(b->coded_, PinnedBuffer::Allocate(uint64_t{o.blocks} * b->coded_bytes_));
  KVTIER_ASSIGN_OR_RETURN(b->flags_, PinnedBuffer::Allocate(uint64_t{o.blocks} * sizeof(uint32_t)));

  // The copied blocks, scattered over the cache as an engine's free list
  // leaves them; slot i holds the i-th.
  std::vector<uint32_t> engine_blocks(o.cache_blocks);
  std::iota(engine_blocks.begin(), engine_blocks.end(), 0u);
  std::mt19937_64 rng(kPermutationSeed);
  std::shuffle(engine_blocks.begin(), engine_blocks.end(), rng);
  for (uint32_t i = 0; i < o.blocks; ++i) {
    b->to_pinned_.push_back({engine_blocks[i], b->pinned_.device() + i * b->block_bytes()});
    b->to_arena_.push_back({engine_blocks[i], b->arena_.data() + i * b->block_bytes()});
    b->to_coded_.push_back({engine_blocks[i], b->coded_.device() + i * b->coded_bytes_});
  }

  cudaStream_t stream = nullptr;
  KVTIER_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking),
                              "cudaStreamCreateWithFlags");
  b->stream_.reset(stream);
  for (UniqueEvent& e : b->events_) {
    cudaEvent_t event = nullptr;
    KVTIER_CUDA_RETURN_IF_ERROR(cudaEventCreate(&event), "cudaEventCreate");
    e.reset(event);
  }
  KVTIER_RETURN_IF_ERROR(b->FillEngine());
  return b;
}

Status GpuBench::FillEngine() {
  KVTIER_ASSIGN_OR_RETURN(PinnedBuffer staging, PinnedBuffer::Allocate(kFillChunkBytes));
  for (size_t r = 0; r < regions_.size(); ++r) {
    const uint64_t size = kv_.region_sizes_bytes()[r];
    for (uint64_t off = 0; off < size; off += kFillChunkBytes) {
      const uint64_t n = std::min(kFillChunkBytes, size - off);
      FillPattern(staging.host(), n, r + 1, off / 8);
      MakeFiniteBf16(staging.host(), n);
      KVTIER_CUDA_RETURN_IF_ERROR(
          cudaMemcpy(regions_[r].data() + off, staging.host(), n, cudaMemcpyHostToDevice),
          "filling engine region " + std::to_string(r));
    }
  }
  return Status();
}

Status GpuBench::MirrorEngine() {
  for (size_t r = 0; r < regions_.size(); ++r) {
    KVTIER_CUDA_RETURN_IF_ERROR(cudaMemcpy(mirror_[r].get(), regions_[r].data(),
                                           kv_.region_sizes_bytes()[r], cudaMemcpyDeviceToHost),
                                "copying engine region " + std::to_string(r) + " to the host");
  }
  return Status();
}

void GpuBench::PrintConfig() const {
  uint64_t min_row = UINT64_MAX, max_row = 0;
  uint32_t min_align = 16;
  for (const CopyPiece& p : plan_.pieces()) {
    min_row = std::min(min_row, p.row_bytes);
    max_row = std::max(max_row, p.row_bytes);
    min_align = std::min(min_align, p.align);
  }
  uint64_t engine_bytes = 0;
  for (uint64_t s : kv_.region_sizes_bytes()) engine_bytes += s;
  std::printf(
      "config:   layout %s: %u blocks of %.2f MiB (%.0f MiB) per copy, scattered over a %u-block "
      "cache "
      "in %zu regions (%.2f GiB); median of %u reps (+1 warm-up)\n",
      o_.layout.c_str(), o_.blocks, static_cast<double>(block_bytes()) / (1 << 20),
      static_cast<double>(copy_bytes_) / (1 << 20), o_.cache_blocks, regions_.size(),
      static_cast<double>(engine_bytes) / (1ull << 30), o_.reps);
  std::printf("model:    %s\n", kv_.layout().ToString().c_str());
  std::printf(
      "plan:     %zu pieces per block, rows of %lu..%lu bytes, largest piece %lu bytes, alignment "
      "%u\n",
      plan_.pieces().size(), min_row, max_row, plan_.max_piece_bytes(), min_align);
}

Status GpuBench::CompareWithReference(std::span<const BlockCopy> copies, std::string_view what) {
  std::vector<uint8_t> actual(block_bytes()), expected(block_bytes());
  const std::vector<uint32_t> indices = VerifyIndices(static_cast<uint32_t>(copies.size()));
  for (uint32_t i : indices) {
    KVTIER_CUDA_RETURN_IF_ERROR(
        cudaMemcpy(actual.data(), copies[i].slot, block_bytes(), cudaMemcpyDefault),
        "reading back a slot");
    GatherBlock(mirror_plan_, copies[i].engine_block, expected.data());
    if (std::memcmp(actual.data(), expected.data(), block_bytes()) != 0) {
      const auto diff = std::mismatch(actual.begin(), actual.end(), expected.begin());
      const auto at = static_cast<uint64_t>(diff.first - actual.begin());
      return Status(StatusCode::kCorruption,
                    std::string(what) + ": slot " + std::to_string(i) + " (engine block " +
                        std::to_string(copies[i].engine_block) +
                        ") differs from the CPU reference at byte " + std::to_string(at) + " of " +
                        std::to_string(block_bytes()));
    }
  }
  std::printf("verified %zu blocks: %.*s byte-exact against the CPU reference\n", indices.size(),
              static_cast<int>(what.size()), what.data());
  return Status();
}

Status GpuBench::Verify() {
  const cuda::DevicePieces pieces = device_plan_.pieces();
  const std::vector<uint32_t> indices = VerifyIndices(o_.blocks);
  // Gathers leave the engine as filled: one mirror serves both.
  KVTIER_RETURN_IF_ERROR(MirrorEngine());
  KVTIER_CUDA_RETURN_IF_ERROR(cuda::LaunchGather(pieces, to_pinned_, stream_.get()),
                              "LaunchGather D2H");
  KVTIER_RETURN_IF_ERROR(Sync());
  KVTIER_RETURN_IF_ERROR(CompareWithReference(to_pinned_, "gather D2H"));
  KVTIER_CUDA_RETURN_IF_ERROR(cuda::LaunchGather(pieces, to_arena_, stream_.get()),
                              "LaunchGather D2D");
  KVTIER_RETURN_IF_ERROR(Sync());
  KVTIER_RETURN_IF_ERROR(CompareWithReference(to_arena_, "gather D2D"));

  // Scatters: new bytes in the verified slots, then the engine's copy of
  // those blocks must gather back to them.
  for (uint32_t i : indices) {
    FillPattern(pinned_.host() + i * block_bytes(), block_bytes(), 1001, i * block_bytes() / 8);
    MakeFiniteBf16(pinned_.host() + i * block_bytes(), block_bytes());
  }
  KVTIER_CUDA_RETURN_IF_ERROR(cuda::LaunchScatter(pieces, to_pinned_, stream_.get()),
                              "LaunchScatter H2D");
  KVTIER_RETURN_IF_ERROR(Sync());
  KVTIER_RETURN_IF_ERROR(MirrorEngine());
  KVTIER_RETURN_IF_ERROR(CompareWithReference(to_pinned_, "scatter H2D"));

  for (uint32_t i : indices) {
    uint8_t* host = pinned_.host() + i * block_bytes();
    FillPattern(host, block_bytes(), 1002, i * block_bytes() / 8);
    MakeFiniteBf16(host, block_bytes());
    KVTIER_CUDA_RETURN_IF_ERROR(
        cudaMemcpy(to_arena_[i].slot, host, block_bytes(), cudaMemcpyHostToDevice),
        "filling an HBM slot");
  }
  KVTIER_CUDA_RETURN_IF_ERROR(cuda::LaunchScatter(pieces, to_arena_, stream_.get()),
                              "LaunchScatter D2D");
  KVTIER_RETURN_IF_ERROR(Sync());
  KVTIER_RETURN_IF_ERROR(MirrorEngine());
  KVTIER_RETURN_IF_ERROR(CompareWithReference(to_arena_, "scatter D2D"));
  return VerifyCodec();
}

Status GpuBench::VerifyCodec() {
  const cuda::DevicePieces pieces = device_plan_.pieces();
  const std::vector<uint32_t> indices = VerifyIndices(o_.blocks);
  KVTIER_ASSIGN_OR_RETURN(std::unique_ptr<BlockCodec> coder, BlockCodec::Create());
  auto* flags = reinterpret_cast<uint32_t*>(flags_.host());
  // Encode (a store): every verified slot must be the CPU codec's output for
  // the engine block, byte for byte.
  KVTIER_RETURN_IF_ERROR(MirrorEngine());
  std::memset(flags, 0, uint64_t{o_.blocks} * sizeof(uint32_t));
  KVTIER_CUDA_RETURN_IF_ERROR(
      cuda::LaunchFp8Encode(pieces, shape_, to_coded_, reinterpret_cast<uint32_t*>(flags_.device()), stream_.get()),
      "LaunchFp8Encode D2H");
  KVTIER_RETURN_IF_ERROR(Sync());
  std::vector<uint8_t> expected(BlockCodec::MaxEncodedBytes(fp8(), block_bytes())), scratch, raw(block_bytes()),
      decoded(block_bytes());
  for (uint32_t i : indices) {
    if (flags[i] != 0) {
      return Status(StatusCode::kCorruption, "fp8 encode D2H: slot " + std::to_string(i) +
                                                 " flagged a NaN or an Inf in finite data");
    }
    const std::optional<size_t> n = GatherAndEncode(*coder, fp8(), mirror_plan_, to_coded_[i].engine_block,
                                                    expected, scratch);
    const uint8_t* actual = coded_.host() + i * coded_bytes_;
    if (!n || *n != coded_bytes_ || std::memcmp(actual, expected.data(), coded_bytes_) != 0) {
      return Status(StatusCode::kCorruption, "fp8 encode D2H: slot " + std::to_string(i) + " (engine block " +
                                                 std::to_string(to_coded_[i].engine_block) +
                                                 ") differs from the CPU codec's encoding");
    }
  }
  // Decode (a load): the engine's blocks must then be what the CPU codec
  // decodes from the same slots.
  flags[0] = 0;
  KVTIER_CUDA_RETURN_IF_ERROR(
      cuda::LaunchFp8Decode(pieces, shape_, to_coded_, reinterpret_cast<uint32_t*>(flags_.device()), stream_.get()),
      "LaunchFp8Decode H2D");
  KVTIER_RETURN_IF_ERROR(Sync());
  if (flags[0] != 0) return Status(StatusCode::kCorruption, "fp8 decode H2D: flagged good slots as corrupt");
  KVTIER_RETURN_IF_ERROR(MirrorEngine());
  for (uint32_t i : indices) {
    const std::span<const uint8_t> stored(coded_.host() + i * coded_bytes_, coded_bytes_);
    KVTIER_RETURN_IF_ERROR(coder->Decode(fp8(), stored, decoded));
    GatherBlock(mirror_plan_, to_coded_[i].engine_block, raw.data());
    if (raw != decoded) {
      return Status(StatusCode::kCorruption, "fp8 decode H2D: engine block " +
                                                 std::to_string(to_coded_[i].engine_block) +
                                                 " differs from the CPU codec's decoding of slot " + std::to_string(i));
    }
  }
  std::printf("verified %zu blocks: fp8 encode D2H and decode H2D byte-exact against the CPU codec (groups of %u)\n",
              indices.size(), kFp8GroupElems);
  return Status();
}

// Repetition r queues: gate, event 0, one op, event 1, the other op, event 2,
// kvtier first on even repetitions and the baseline first on odd ones, so
// neither always runs on a cold or a warm copy engine. Repetition 0 is the
// warm-up. Returns the medians in milliseconds.
Result<Medians> GpuBench::TimePair(const Op& kvtier, const Op& baseline) {
  cudaStream_t s = stream_.get();
  std::vector<double> kvtier_ms, baseline_ms;
  for (uint32_t rep = 0; rep <= o_.reps; ++rep) {
    const bool kvtier_first = rep % 2 == 0;
    const Op& first = kvtier_first ? kvtier : baseline;
    const Op& second = kvtier_first ? baseline : kvtier;
    g_gate_open.store(false, std::memory_order_relaxed);
    const Status queued = [&]() -> Status {
      KVTIER_CUDA_RETURN_IF_ERROR(cudaLaunchHostFunc(s, WaitForGate, nullptr),
                                  "cudaLaunchHostFunc");
      KVTIER_CUDA_RETURN_IF_ERROR(cudaEventRecord(events_[0].get(), s), "cudaEventRecord");
      KVTIER_CUDA_RETURN_IF_ERROR(first.queue(), first.name);
      KVTIER_CUDA_RETURN_IF_ERROR(cudaEventRecord(events_[1].get(), s), "cudaEventRecord");
      KVTIER_CUDA_RETURN_IF_ERROR(second.queue(), second.name);
      KVTIER_CUDA_RETURN_IF_ERROR(cudaEventRecord(events_[2].get(), s), "cudaEventRecord");
      return Status();
    }();
    g_gate_open.store(true, std::memory_order_release);
    KVTIER_RETURN_IF_ERROR(queued);
    KVTIER_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(events_[2].get()), "cudaEventSynchronize");
    float first_ms = 0, second_ms = 0;
    KVTIER_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&first_ms, events_[0].get(), events_[1].get()),
                                "cudaEventElapsedTime");
    KVTIER_CUDA_RETURN_IF_ERROR(
        cudaEventElapsedTime(&second_ms, events_[1].get(), events_[2].get()),
        "cudaEventElapsedTime");
    if (rep == 0) continue;
    kvtier_ms.push_back(kvtier_first ? first_ms : second_ms);
    baseline_ms.push_back(kvtier_first ? second_ms : first_ms);
  }
  return Medians{Median(kvtier_ms), Median(baseline_ms)};
}

Result<std::vector<Comparison>> GpuBench::Measure() {
  cudaStream_t s = stream_.get();
  const cuda::DevicePieces pieces = device_plan_.pieces();
  const uint64_t n = copy_bytes_;
  uint8_t* host = pinned_.host();
  uint8_t* arena = arena_.data();
  uint8_t* scratch = scratch_.data();
  auto* flags = reinterpret_cast<uint32_t*>(flags_.device());
  struct Row {
    const char* name;
    Op kvtier;
    Op baseline;
    const char* baseline_name;
    double target;
  };
  const Row rows[] = {
      {"gather D2H (engine -> pinned host)",
       {"LaunchGather D2H", [&] { return cuda::LaunchGather(pieces, to_pinned_, s); }},
       {"cudaMemcpyAsync D2H",
        [&] { return cudaMemcpyAsync(host, scratch, n, cudaMemcpyDeviceToHost, s); }},
       "one contiguous cudaMemcpyAsync HBM -> pinned host",
       kTargetHostDevice},
      {"scatter H2D (pinned host -> engine)",
       {"LaunchScatter H2D", [&] { return cuda::LaunchScatter(pieces, to_pinned_, s); }},
       {"cudaMemcpyAsync H2D",
        [&] { return cudaMemcpyAsync(scratch, host, n, cudaMemcpyHostToDevice, s); }},
       "one contiguous cudaMemcpyAsync pinned host -> HBM",
       kTargetHostDevice},
      {"gather D2D (engine -> hbm slots)",
       {"LaunchGather D2D", [&] { return cuda::LaunchGather(pieces, to_arena_, s); }},
       {"cudaMemcpyAsync D2D",
        [&] { return cudaMemcpyAsync(arena, scratch, n, cudaMemcpyDeviceToDevice, s); }},
       "one contiguous cudaMemcpyAsync HBM -> HBM",
       kTargetDeviceDevice},
      {"scatter D2D (hbm slots -> engine)",
       {"LaunchScatter D2D", [&] { return cuda::LaunchScatter(pieces, to_arena_, s); }},
       {"cudaMemcpyAsync D2D",
        [&] { return cudaMemcpyAsync(scratch, arena, n, cudaMemcpyDeviceToDevice, s); }},
       "one contiguous cudaMemcpyAsync HBM -> HBM",
       kTargetDeviceDevice},
      // The codec rows count the block's raw bytes: what the engine stores
      // or loads, against a plain copy of those raw bytes.
      {"fp8 encode D2H (engine -> coded host)",
       {"LaunchFp8Encode D2H", [&] { return cuda::LaunchFp8Encode(pieces, shape_, to_coded_, flags, s); }},
       {"cudaMemcpyAsync D2H",
        [&] { return cudaMemcpyAsync(host, scratch, n, cudaMemcpyDeviceToHost, s); }},
       "one contiguous cudaMemcpyAsync of the raw bytes HBM -> pinned host",
       kTargetHostDevice},
      {"fp8 decode H2D (coded host -> engine)",
       {"LaunchFp8Decode H2D", [&] { return cuda::LaunchFp8Decode(pieces, shape_, to_coded_, flags, s); }},
       {"cudaMemcpyAsync H2D",
        [&] { return cudaMemcpyAsync(scratch, host, n, cudaMemcpyHostToDevice, s); }},
       "one contiguous cudaMemcpyAsync of the raw bytes pinned host -> HBM",
       kTargetHostDevice},
  };
  std::vector<Comparison> cs;
  for (const Row& row : rows) {
    KVTIER_ASSIGN_OR_RETURN(const Medians m, TimePair(row.kvtier, row.baseline));
    const auto gbps = [&](double ms) { return ms > 0 ? static_cast<double>(n) / (ms * 1e6) : 0.0; };
    cs.push_back({row.name, gbps(m.kvtier_ms), gbps(m.baseline_ms), row.baseline_name, "GB/s",
                  /*lower_is_better=*/false, row.target});
  }
  KVTIER_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  return cs;
}

void PrintTable(const std::vector<Comparison>& cs) {
  std::printf("\n%-38s %12s %14s %8s %7s  %s\n", "comparison", "kvtier GB/s", "baseline GB/s",
              "ratio", "target", "verdict");
  for (const Comparison& c : cs) {
    std::printf("%-38s %12.1f %14.1f %7.2fx %7.2f  %s\n", c.name.c_str(), c.kvtier, c.baseline,
                c.ratio(), c.target, c.ratio() >= c.target ? "PASS" : "BELOW TARGET");
  }
  std::printf(
      "baselines: one contiguous cudaMemcpyAsync of the same bytes on the same stream; targets are "
      "informational\n");
  if (g_gate_timed_out.load(std::memory_order_relaxed)) {
    std::printf(
        "warning: a stream gate timed out, so some timings include the host's launch latency\n");
  }
}

std::string CudaRuntimeVersion() {
  int v = 0;
  if (cudaRuntimeGetVersion(&v) != cudaSuccess) return "unknown";
  return std::to_string(v / 1000) + "." + std::to_string((v % 1000) / 10);
}

Status Run(const GpuOptions& o) {
  KVTIER_CUDA_RETURN_IF_ERROR(cudaSetDevice(o.device),
                              "cudaSetDevice(" + std::to_string(o.device) + ")");
  KVTIER_ASSIGN_OR_RETURN(const std::string gpu, cuda::DescribeDevice(o.device));
  const std::string driver = cuda::DriverVersion(), runtime = CudaRuntimeVersion();
  std::printf("gpu:      %s, device %d, driver %s, runtime %s\n", gpu.c_str(), o.device,
              driver.c_str(), runtime.c_str());

  KVTIER_ASSIGN_OR_RETURN(const Layout layout, ModelLayout(o.block_bytes));
  KVTIER_ASSIGN_OR_RETURN(std::vector<Placement> placements,
                          EnginePlacements(o.layout, layout, o.cache_blocks));
  std::vector<uint64_t> sizes = KvCacheLayout::MinRegionSizes(layout, o.cache_blocks, placements);
  KVTIER_ASSIGN_OR_RETURN(
      KvCacheLayout kv,
      KvCacheLayout::Create(layout, o.cache_blocks, std::move(placements), std::move(sizes)));
  KVTIER_ASSIGN_OR_RETURN(std::unique_ptr<GpuBench> bench, GpuBench::Create(o, std::move(kv)));
  bench->PrintConfig();
  std::fflush(stdout);
  KVTIER_RETURN_IF_ERROR(bench->Verify());
  KVTIER_ASSIGN_OR_RETURN(const std::vector<Comparison> cs, bench->Measure());
  PrintTable(cs);
  if (!o.json.empty() &&
      !WriteJson(o.json,
                 {{"workload", "gpu"},
                  {"layout", o.layout},
                  {"device", std::to_string(o.device)},
                  {"blocks", std::to_string(o.blocks)},
                  {"cache_blocks", std::to_string(o.cache_blocks)},
                  {"block_bytes", std::to_string(o.block_bytes)},
                  {"reps", std::to_string(o.reps)}},
                 cs, {{"gpu", gpu}, {"driver", driver}, {"cuda_runtime", runtime}})) {
    return Status::FromErrno(errno, "writing " + o.json);
  }
  return Status();
}

}  // namespace

int Gpu(const GpuOptions& options) {
  // Line by line, so the log of a piped run keeps stdout and stderr in order.
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  GpuOptions o = options;
  if (o.cache_blocks == 0) o.cache_blocks = 2 * o.blocks;
  if (o.block_bytes == 0 || o.block_bytes % kTokenBytes != 0) {
    std::fprintf(
        stderr,
        "kvtier-bench gpu: --block-bytes must be a multiple of %lu (one token of the model)\n",
        kTokenBytes);
    return 2;
  }
  if (o.cache_blocks < o.blocks) {
    std::fprintf(stderr, "kvtier-bench gpu: --cache-blocks (%u) must be at least --blocks (%u)\n",
                 o.cache_blocks, o.blocks);
    return 2;
  }
  PrintMachine();
  Result<int> count = cuda::DeviceCount();
  if (!count) {
    std::fprintf(stderr, "no CUDA device: %s\n", count.error().message().c_str());
    return 3;
  }
  if (o.device < 0 || o.device >= *count) {
    std::fprintf(stderr, "no CUDA device: device %d requested, %d visible\n", o.device, *count);
    return 3;
  }
  const Status status = Run(o);
  if (!status.ok()) {
    std::fflush(stdout);
    std::fprintf(stderr, "kvtier-bench gpu: %s\n", status.ToString().c_str());
    return 1;
  }
  return 0;
}

}  // namespace kvtier::bench
