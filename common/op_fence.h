// Op fences: how a client stops the daemon's copies into and out of its KV
// cache without the daemon's help, so that an engine that gives up on a hung
// or slow kvtierd may reuse its blocks at once (docs/protocol.md, "Cancelling
// an op").
//
// The fence page is a 4 KiB memfd the client makes and registers with its
// caches (RegisterKvCache.fence_fd_index); both sides map it. Each of its
// kSlots 64-bit words serves one op at a time:
//
//   bit 63      cancelled (set by the client)
//   bits 48-62  copies of the op in progress (the daemon's)
//   bits 0-47   the op's generation, never 0 (the client's)
//
// The client opens a slot for an op by writing a new generation, and names
// slot and generation in the Load or Store. Before a copy touches the
// engine's memory the daemon enters the word (count + 1), only while it holds
// the op's generation and is not cancelled; after the copy it leaves (count
// - 1, only while the generation is the op's). The client cancels by setting
// bit 63 and waiting for the count to reach zero: every change to the word is
// one compare-and-swap, so from then on no copy of the op touches its memory.
// A slot the client has reopened for another op keeps stale copies out by
// its generation.
//
// The daemon never waits on a fence, and a client writing nonsense into its
// own page can only fail its own ops.
//
// Layer progress (a Load with by_layer, docs/protocol.md "Layer-by-layer
// loads"): the page's second 4 KiB hold one 64-bit word per slot,
//
//   bits 32-63  the low 32 bits of the op's generation (the client's, at Open)
//   bit 31      over: the op finished, done or failed (the daemon's)
//   bits 0-30   layers in place in every block the op loads (the daemon's,
//               only ever raised)
//
// Its low half is a futex word: a client waiting for a layer sleeps on it,
// and the daemon wakes it at each change. The daemon changes a word only
// while it holds the op's generation, so a stale op's copies never speak for
// the slot's next op. A page of only kFenceBytes (a client from before layer
// progress) has no such words: by_layer loads are refused for it.
//
// FencePage and OpFence are thread-safe (atomic accesses to shared memory).
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <utility>

#include "common/memory_mapping.h"

namespace kvtier {

class FencePage {
 public:
  static constexpr size_t kFenceBytes = 4096;
  static constexpr size_t kBytes = 2 * kFenceBytes;  // fence words, then progress words
  static constexpr uint32_t kSlots = kFenceBytes / sizeof(uint64_t);
  static constexpr uint64_t kOver = uint64_t{1} << 31;
  static constexpr uint64_t kLayersMask = kOver - 1;
  static constexpr uint64_t kCancelled = uint64_t{1} << 63;
  static constexpr uint64_t kOneCopy = uint64_t{1} << 48;
  static constexpr uint64_t kCopiesMask = (kCancelled - 1) & ~(kOneCopy - 1);
  static constexpr uint64_t kGenerationMask = kOneCopy - 1;

  // REQUIRES: `mapping` is at least kBytes, shared with the other side.
  explicit FencePage(MemoryMapping mapping) : mapping_(std::move(mapping)) {}

  // The daemon's side. Whether a copy of op (slot, generation) may start;
  // if so, it is counted until Leave. REQUIRES: slot < kSlots.
  bool Enter(uint32_t slot, uint64_t generation) {
    std::atomic_ref<uint64_t> w = word(slot);
    uint64_t v = w.load(std::memory_order_acquire);
    while (true) {
      if ((v & kGenerationMask) != generation || (v & kCancelled) != 0 || (v & kCopiesMask) == kCopiesMask) {
        return false;
      }
      if (w.compare_exchange_weak(v, v + kOneCopy, std::memory_order_acq_rel, std::memory_order_acquire)) return true;
    }
  }
  // After the copy's last access to the engine's memory (release: the
  // client that sees the count fall sees the copy over).
  void Leave(uint32_t slot, uint64_t generation) {
    std::atomic_ref<uint64_t> w = word(slot);
    uint64_t v = w.load(std::memory_order_acquire);
    while ((v & kGenerationMask) == generation && (v & kCopiesMask) != 0) {
      if (w.compare_exchange_weak(v, v - kOneCopy, std::memory_order_acq_rel, std::memory_order_acquire)) return;
    }
  }

  // Whether the page has layer progress words (kBytes mapped, not only
  // kFenceBytes).
  bool has_progress() const { return mapping_.size_bytes() >= kBytes; }

  // The daemon's side, for an op of a page with progress: its first
  // `layers` layers are in place (release: a client that reads them sees the
  // copies' writes), and with `over`, the op is finished. Raises only; wakes
  // the client's waiters. The client calls it with `over` too, for an op it
  // gave up on or whose daemon is gone: what waits for its layers ends.
  // REQUIRES: has_progress(), slot < kSlots.
  void Progress(uint32_t slot, uint64_t generation, uint32_t layers, bool over);

  // The client's side. Opens `slot` for a new op (no copies, not cancelled,
  // no layer in place). REQUIRES: 0 < generation <= kGenerationMask.
  void Open(uint32_t slot, uint64_t generation) {
    if (has_progress()) progress(slot).store(ProgressTag(generation), std::memory_order_release);
    word(slot).store(generation, std::memory_order_release);
  }
  // The op's progress word (acquire), or nullopt once the slot serves
  // another op. REQUIRES: has_progress().
  std::optional<uint64_t> ProgressOf(uint32_t slot, uint64_t generation) {
    const uint64_t v = progress(slot).load(std::memory_order_acquire);
    if ((v & ~(kOver | kLayersMask)) != ProgressTag(generation)) return std::nullopt;
    return v;
  }
  // For a GPU stream that waits for an op's layers in shared memory
  // (cuStreamWaitValue64, GEQ, a wrapping compare of the whole word): the
  // progress words, one per slot (the page-aligned half of the page from
  // kFenceBytes on), and the value slot's word reaches once `layers` layers
  // of the op of `generation` are in place. The word passes it too once the
  // op is over (kOver is above any layer count) or the slot serves a later
  // op (a larger tag, wrapping included), so such a wait ends whenever the
  // op does. REQUIRES: has_progress().
  const uint64_t* progress_words() { return progress_word(0); }
  static uint64_t ProgressTarget(uint64_t generation, uint32_t layers) {
    return ProgressTag(generation) | std::min<uint64_t>(layers, kLayersMask);
  }
  // Sleeps until the progress word of `slot` may no longer be `seen`, at
  // most `timeout` (spurious wakeups allowed).
  void SleepOnProgress(uint32_t slot, uint64_t seen, std::chrono::nanoseconds timeout);
  // Marks the op cancelled: no copy of it starts from now on. Returns
  // whether none is in progress (then none ever touches the op's memory
  // again); false: wait for Quiet.
  bool Cancel(uint32_t slot, uint64_t generation) {
    std::atomic_ref<uint64_t> w = word(slot);
    uint64_t v = w.load(std::memory_order_acquire);
    while ((v & kGenerationMask) == generation && (v & kCancelled) == 0) {
      if (w.compare_exchange_weak(v, v | kCancelled, std::memory_order_acq_rel, std::memory_order_acquire)) break;
    }
    return Quiet(slot, generation);
  }
  // Whether no copy of the op is in progress (acquire: its writes are seen).
  bool Quiet(uint32_t slot, uint64_t generation) {
    const uint64_t v = word(slot).load(std::memory_order_acquire);
    return (v & kGenerationMask) != generation || (v & kCopiesMask) == 0;
  }

 private:
  static uint64_t ProgressTag(uint64_t generation) { return generation << 32; }
  std::atomic_ref<uint64_t> word(uint32_t slot) {
    return std::atomic_ref<uint64_t>(reinterpret_cast<uint64_t*>(mapping_.data())[slot]);
  }
  uint64_t* progress_word(uint32_t slot) { return reinterpret_cast<uint64_t*>(mapping_.data()) + kSlots + slot; }
  std::atomic_ref<uint64_t> progress(uint32_t slot) { return std::atomic_ref<uint64_t>(*progress_word(slot)); }

  MemoryMapping mapping_;
};

// One op's fence, as the daemon's copies carry it (CopyBatch::fence). Empty:
// the op has none, and its copies always run. Copyable.
class OpFence {
 public:
  OpFence() = default;
  // REQUIRES: page != nullptr, slot < FencePage::kSlots.
  OpFence(std::shared_ptr<FencePage> page, uint32_t slot, uint64_t generation)
      : page_(std::move(page)), slot_(slot), generation_(generation) {}

  // A copy in progress, from a successful Enter until destruction. Move-only.
  class Entry {
   public:
    Entry() = default;
    ~Entry() { Release(); }
    Entry(Entry&& other) noexcept
        : page_(std::move(other.page_)), slot_(other.slot_), generation_(other.generation_) {}
    Entry& operator=(Entry&& other) noexcept {
      if (this != &other) {
        Release();
        page_ = std::move(other.page_);
        slot_ = other.slot_;
        generation_ = other.generation_;
      }
      return *this;
    }
    Entry(const Entry&) = delete;
    Entry& operator=(const Entry&) = delete;

   private:
    friend class OpFence;
    Entry(std::shared_ptr<FencePage> page, uint32_t slot, uint64_t generation)
        : page_(std::move(page)), slot_(slot), generation_(generation) {}
    void Release() {
      if (page_ != nullptr) page_->Leave(slot_, generation_);
      page_ = nullptr;
    }
    std::shared_ptr<FencePage> page_;
    uint32_t slot_ = 0;
    uint64_t generation_ = 0;
  };

  // Layer progress of a by_layer load (FencePage::Progress); nothing for an
  // empty fence or a page without progress words.
  void Progress(uint32_t layers, bool over) const {
    if (page_ != nullptr && page_->has_progress()) page_->Progress(slot_, generation_, layers, over);
  }

  // Whether the op's copies may touch the engine's memory now; `entry` then
  // holds the fence until they are over. Always true for an empty fence.
  bool Enter(Entry& entry) const {
    if (page_ == nullptr) return true;
    if (!page_->Enter(slot_, generation_)) return false;
    entry = Entry(page_, slot_, generation_);
    return true;
  }

 private:
  std::shared_ptr<FencePage> page_;
  uint32_t slot_ = 0;
  uint64_t generation_ = 0;
};

}  // namespace kvtier
