// Test helpers for tiers/: a gate that occupies a backend worker; a backend
// that holds back loads' completions; an
// engine's KV cache in a sealed memfd, registered with a DeviceBackend the way
// a CPU engine registers it (one contiguous region, KvCacheLayout::Contiguous);
// and a deterministic byte pattern per stored key, so that any block can be
// checked byte for byte.
//
// The test writes and reads engine blocks through its own mapping of the
// memfd, as the engine would; the backend copies through the mapping it made
// in MapClientMemory. Thread-compatible.
#pragma once

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <deque>
#include <functional>
#include <cstdint>
#include <cstring>
#include <latch>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "common/device_backend.h"
#include "common/key128.h"
#include "common/kv_cache_layout.h"
#include "common/layout.h"
#include "common/memory_mapping.h"
#include "common/mutex.h"
#include "common/op_fence.h"
#include "common/status.h"
#include "common/unique_fd.h"
#include "kernels/codec.h"
#include "kernels/copy_reference.h"
#include "tests/tiers/forwarding_backend.h"

namespace kvtier::tiers_test {

// Occupies one worker: a slot-to-slot batch of one small copy whose `done`
// (run on the worker) blocks until Release(). The state is shared with the
// worker, which may still be leaving `done` when the gate is destroyed.
class WorkerGate {
 public:
  explicit WorkerGate(DeviceBackend& backend) : state_(std::make_shared<State>()) {
    CopyBatch batch{.direction = CopyDirection::kSlotToSlot,
                    .priority = CopyPriority::kBackground,
                    .slot_copies = {SlotCopy{state_->src, state_->dst, sizeof(state_->src)}}};
    backend.Submit(std::move(batch), [state = state_](CopyResult) {
      state->entered.count_down();
      state->release.wait();
    });
    state_->entered.wait();  // the worker is now inside done
  }
  ~WorkerGate() { Release(); }
  WorkerGate(const WorkerGate&) = delete;
  WorkerGate& operator=(const WorkerGate&) = delete;
  void Release() {
    if (!released_) state_->release.count_down();
    released_ = true;
  }

 private:
  struct State {
    uint8_t src[64] = {};
    uint8_t dst[64] = {};
    std::latch entered{1};
    std::latch release{1};
  };
  std::shared_ptr<State> state_;
  bool released_ = false;
};

// What a HoldingBackend says it does besides its inner backend's copies.
struct HoldingBackendOptions {
  bool decodes_on_load = true;  // as the inner backend does; else only kNone
  // Codes fp8 stores on their way, as the cuda backend's kernels do: on the
  // CPU (GatherAndEncode), inline, into slots of the coded size; a block
  // with a NaN or an Inf is reported not coded.
  bool encodes_on_store = false;
};

// Wraps a real backend (the host one) and, while told to, keeps back the
// completions of loads (slot -> engine copies) until the test passes them on.
// Lets a test decide that a load finishes after some background move, which
// worker timing alone does not. It may also say it decodes no codec on
// load, as a backend without a decode kernel would, or code fp8 stores on
// their way, as the cuda backend's kernels do (Options). Thread-safe.
class HoldingBackend final : public ForwardingBackend {
 public:
  using Options = HoldingBackendOptions;
  explicit HoldingBackend(DeviceBackend* inner, Options options = {}) : ForwardingBackend(inner), options_(options) {}

  bool DecodesOnLoad(CodecKind kind) const override {
    return options_.decodes_on_load ? inner().DecodesOnLoad(kind) : kind == CodecKind::kNone;
  }
  bool EncodesOnStore(CodecKind kind) const override {
    return options_.encodes_on_store && kind == CodecKind::kFp8;
  }

  bool Submit(CopyBatch batch, CopyDone done) override {
    if (batch.direction == CopyDirection::kEngineToSlot &&
        std::ranges::any_of(batch.blocks, [](const BlockCopy& b) { return b.coded_bytes != 0; })) {
      done(StoreCoded(batch));
      return true;
    }
    const bool hold = batch.direction == CopyDirection::kSlotToEngine && hold_loads_.load();
    return inner().Submit(std::move(batch), [this, hold, done = std::move(done)](CopyResult r) mutable {
      if (!hold) {
        done(std::move(r));
        return;
      }
      MutexLock lock(&mu_);
      held_.push_back([done = std::move(done), r = std::move(r)]() mutable { done(std::move(r)); });
      cv_.SignalAll();
    });
  }

  // Store batches coded on their way so far.
  uint64_t coded_stores() {
    MutexLock lock(&mu_);
    return coded_stores_;
  }
  // Loads submitted from now on are held (seq_cst; only the test thread sets it).
  void HoldLoads(bool hold) { hold_loads_.store(hold); }
  // Waits until `n` completions are held; false after 30 s.
  bool WaitHeld(size_t n) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    MutexLock lock(&mu_);
    while (held_.size() < n) {
      const auto now = std::chrono::steady_clock::now();
      if (now >= deadline) return false;
      (void)cv_.WaitFor(&mu_, deadline - now);
    }
    return true;
  }
  // Passes on the most recently held completion.
  void ReleaseNewest() {
    std::function<void()> f;
    {
      MutexLock lock(&mu_);
      if (held_.empty()) return;
      f = std::move(held_.back());
      held_.pop_back();
    }
    f();
  }
  // Passes on every held completion, oldest first.
  void ReleaseAll() {
    std::deque<std::function<void()>> held;
    {
      MutexLock lock(&mu_);
      held.swap(held_);
    }
    for (auto& f : held) f();
  }

 private:
  CopyResult StoreCoded(const CopyBatch& batch) {
    EXPECT_TRUE(EncodesOnStore(batch.codec.kind)) << "a coded store the backend did not offer";
    MutexLock lock(&mu_);
    if (coder_ == nullptr) coder_ = BlockCodec::Create().value();
    const CopyPlan plan = CopyPlan::Build(*batch.layout, MappedRegions{batch.mapping->region_bases()});
    CopyResult r;
    for (uint32_t i = 0; i < batch.blocks.size(); ++i) {
      const BlockCopy& b = batch.blocks[i];
      uint64_t& checksum = r.checksums.emplace_back();
      if (b.coded_bytes == 0) {
        GatherBlock(plan, b.engine_block, b.slot, &checksum);
        continue;
      }
      const std::optional<size_t> n =
          GatherAndEncode(*coder_, batch.codec, plan, b.engine_block, std::span(b.slot, b.coded_bytes), scratch_);
      if (n != b.coded_bytes) {
        r.not_coded.push_back(i);
      } else {
        checksum = ChecksumOf(b.slot, *n);
      }
    }
    ++coded_stores_;
    return r;
  }

  const Options options_;
  std::unique_ptr<BlockCodec> coder_ KVTIER_GUARDED_BY(mu_);
  std::vector<uint8_t> scratch_ KVTIER_GUARDED_BY(mu_);
  std::atomic<bool> hold_loads_{false};
  Mutex mu_;
  CondVar cv_;
  std::deque<std::function<void()>> held_ KVTIER_GUARDED_BY(mu_);
  uint64_t coded_stores_ KVTIER_GUARDED_BY(mu_) = 0;
};

// A small separate-K/V fp16 layout: num_layers * 2048 bytes per block (4
// tokens, 2 heads, head_dim 64). Three layers give 6144-byte blocks, which
// are not a multiple of the 4 KiB slot alignment, so slot strides (8192)
// and block bytes differ.
inline LayoutSpec SmallSpec(uint32_t num_layers = 3) {
  return LayoutSpec{.model_id = "test/tiers",
                    .num_layers = num_layers,
                    .kv_kind = KvKind::kSeparateKv,
                    .num_kv_heads = 2,
                    .head_dim = 64,
                    .dtype = DType::kFp16,
                    .block_tokens = 4};
}

// A memfd of `size_bytes`, sealed against shrinking when `seal_shrink`.
inline Result<UniqueFd> MakeMemfd(uint64_t size_bytes, bool allow_sealing, bool seal_shrink) {
  UniqueFd fd(
      ::memfd_create("kvtier-tiers-test", MFD_CLOEXEC | (allow_sealing ? MFD_ALLOW_SEALING : 0u)));
  if (!fd) return Err(Status::FromErrno(errno, "memfd_create"));
  if (::ftruncate(fd.get(), static_cast<off_t>(size_bytes)) != 0) {
    return Err(Status::FromErrno(errno, "ftruncate"));
  }
  if (seal_shrink && ::fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK) != 0) {
    return Err(Status::FromErrno(errno, "F_ADD_SEALS"));
  }
  return fd;
}

inline ClientRegionHandle MemfdHandle(UniqueFd fd, uint64_t size_bytes) {
  ClientRegionHandle h;
  h.kind = ClientMemoryKind::kHostMemfd;
  h.size_bytes = size_bytes;
  h.memfd = std::move(fd);
  return h;
}

// The bytes stored under `key`: a splitmix64 stream seeded by the key, so
// different keys (and different offsets) give different bytes.
inline void PatternFor(const StoredKey& key, std::span<uint8_t> out) {
  uint64_t hi = 0;
  for (size_t i = 0; i < 8; ++i) hi = (hi << 8) | key.bytes[i];
  uint64_t state = hi ^ (key.Low64() * 0x9e3779b97f4a7c15ull);
  for (size_t off = 0; off < out.size(); off += 8) {
    state += 0x9e3779b97f4a7c15ull;
    uint64_t z = state;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    std::memcpy(out.data() + off, &z, std::min<size_t>(8, out.size() - off));
  }
}

class EngineMemory {
 public:
  // An engine cache of `num_blocks` blocks of `spec`, registered with
  // `backend`: one region of num_blocks * block_bytes, engine block b in
  // bytes [b * block_bytes, (b + 1) * block_bytes), laid out inside that
  // range by `placements` (KvCacheLayout::Contiguous when empty).
  static Result<std::unique_ptr<EngineMemory>> Create(DeviceBackend& backend,
                                                      const LayoutSpec& spec, uint32_t num_blocks,
                                                      std::vector<Placement> placements = {}) {
    KVTIER_ASSIGN_OR_RETURN(Layout layout, Layout::Create(spec));
    const uint64_t size = layout.block_bytes() * num_blocks;
    if (placements.empty()) placements = KvCacheLayout::Contiguous(layout);
    KVTIER_ASSIGN_OR_RETURN(
        KvCacheLayout kv, KvCacheLayout::Create(layout, num_blocks, std::move(placements), {size}));
    KVTIER_ASSIGN_OR_RETURN(UniqueFd fd,
                            MakeMemfd(size, /*allow_sealing=*/true, /*seal_shrink=*/true));
    KVTIER_ASSIGN_OR_RETURN(
        MemoryMapping own, MemoryMapping::Map(MemoryMapping::Options{.size_bytes = size,
                                                                     .prot = PROT_READ | PROT_WRITE,
                                                                     .flags = MAP_SHARED,
                                                                     .fd = fd.get()}));
    std::vector<ClientRegionHandle> regions;
    regions.push_back(MemfdHandle(std::move(fd), size));
    KVTIER_ASSIGN_OR_RETURN(std::shared_ptr<ClientMapping> mapping,
                            backend.MapClientMemory(std::move(regions), {}));
    return std::unique_ptr<EngineMemory>(new EngineMemory(
        std::make_shared<const KvCacheLayout>(std::move(kv)), std::move(mapping), std::move(own)));
  }

  const std::shared_ptr<const KvCacheLayout>& layout() const { return layout_; }
  const std::shared_ptr<ClientMapping>& mapping() const { return mapping_; }
  // Drops this object's reference to the backend's mapping.
  void DropMapping() { mapping_.reset(); }

  uint64_t block_bytes() const { return layout_->layout().block_bytes(); }
  uint32_t num_blocks() const { return layout_->num_blocks(); }
  std::span<uint8_t> block(uint32_t b) {
    return own_.bytes().subspan(uint64_t{b} * block_bytes(), block_bytes());
  }

  void Fill(uint32_t b, const StoredKey& key) { PatternFor(key, block(b)); }
  void Zero(uint32_t b) { std::memset(block(b).data(), 0, block_bytes()); }
  void ZeroAll() { std::memset(own_.data(), 0, own_.size_bytes()); }

  // Whether engine block `b` holds `key`'s bytes; names the first mismatch.
  ::testing::AssertionResult Holds(uint32_t b, const StoredKey& key) {
    std::vector<uint8_t> want(block_bytes());
    PatternFor(key, want);
    const std::span<uint8_t> got = block(b);
    for (size_t i = 0; i < want.size(); ++i) {
      if (got[i] != want[i]) {
        return ::testing::AssertionFailure()
               << "engine block " << b << " differs from key " << key.ToHex() << " at byte " << i
               << " (" << int{got[i]} << " != " << int{want[i]} << ")";
      }
    }
    return ::testing::AssertionSuccess();
  }
  ::testing::AssertionResult IsZero(uint32_t b) {
    for (size_t i = 0; i < block_bytes(); ++i) {
      if (block(b)[i] != 0) {
        return ::testing::AssertionFailure()
               << "engine block " << b << " byte " << i << " is not 0";
      }
    }
    return ::testing::AssertionSuccess();
  }

 private:
  EngineMemory(std::shared_ptr<const KvCacheLayout> layout, std::shared_ptr<ClientMapping> mapping,
               MemoryMapping own)
      : layout_(std::move(layout)), mapping_(std::move(mapping)), own_(std::move(own)) {}

  std::shared_ptr<const KvCacheLayout> layout_;
  std::shared_ptr<ClientMapping> mapping_;
  MemoryMapping own_;
};

// Watches a load by layer's progress word (FencePage slot `slot`,
// generation `generation`) into `engine` on a thread of its own, until every
// layer is reported or Finish() says the load is over. Each new count of
// layers is kept in seen(), and checked as it is seen: engine block b holds
// the first count layers of want[b] (only their bytes are read: later layers
// are being written meanwhile); the first block that does not is named in
// wrong() ("" while none). Read seen() and wrong() after Finish().
class LayerProgressWatcher {
 public:
  // REQUIRES: want.size() <= the engine's blocks, each want[b] a block's bytes.
  LayerProgressWatcher(std::shared_ptr<FencePage> page, uint32_t slot, uint64_t generation, EngineMemory& engine,
                       std::vector<const uint8_t*> want)
      : thread_([this, page = std::move(page), slot, generation, &engine, want = std::move(want)] {
          const Layout& layout = engine.layout()->layout();
          const uint32_t layers = layout.spec().num_layers;
          uint32_t checked = 0;
          while (checked < layers) {
            const bool last_look = finished_.load();
            const uint64_t v = page->ProgressOf(slot, generation).value();
            const auto now = static_cast<uint32_t>(v & FencePage::kLayersMask);
            if (now == checked) {
              if (last_look) break;  // the load is over: no layer comes any more
              page->SleepOnProgress(slot, v, std::chrono::milliseconds(100));
              continue;
            }
            seen_.push_back(now);
            for (uint32_t b = 0; b < want.size() && wrong_.empty(); ++b) {
              if (std::memcmp(engine.block(b).data(), want[b], now * layout.layer_bytes()) != 0) {
                wrong_ = "engine block " + std::to_string(b) + " lacks a layer below " + std::to_string(now);
              }
            }
            checked = now;
          }
        }) {}
  LayerProgressWatcher(const LayerProgressWatcher&) = delete;
  LayerProgressWatcher& operator=(const LayerProgressWatcher&) = delete;
  ~LayerProgressWatcher() { Finish(); }

  // The load is over (its completion ran): the watcher looks once more and
  // stops.
  void Finish() {
    finished_ = true;
    if (thread_.joinable()) thread_.join();
  }
  const std::vector<uint32_t>& seen() const { return seen_; }
  const std::string& wrong() const { return wrong_; }

 private:
  std::atomic<bool> finished_{false};
  std::vector<uint32_t> seen_;
  std::string wrong_;
  std::thread thread_;  // last: started once the rest is there
};

}  // namespace kvtier::tiers_test
