// AdoptedHostMemory: lets kvtierd reach a CPU KV cache that the engine
// allocated itself (torch.zeros, malloc, a NumPy array) without moving it.
// The daemon only maps memfds (docs/protocol.md), so the pages spanning
// [data, data + size) are copied into a new memfd, sealed against shrinking,
// and that memfd is mapped over them at the same address, 64 MiB at a time
// (so memory use grows by 64 MiB, not by the cache's size). Pages that hold
// only zeros are not copied but left as holes of the memfd, which take memory
// once touched: an engine's fresh cache costs a read of its bytes, less than
// a memcpy. Pages with data are written with pwrite, which fills shmem pages
// without zeroing them first (kvtier-bench register measures both). The engine keeps its pointer
// and its bytes; from then on its pages and the daemon's mapping are the same memory, and no copy
// goes through the client again.
//
// Checked: the range lies in this process's anonymous private read-write
// memory (/proc/self/maps), so file mappings and shared memory are refused,
// and so is memory a live AdoptedHostMemory holds. Memory adopted by one
// since destroyed stays a shared mapping of its memfd; once the engine has
// freed it, its allocator hands it out again, and it may be adopted again. The caller's to ensure:
// no thread writes the range while Adopt runs (register at start-up, before the cache is used), and
// nothing else in its first and last pages (an allocator's header, or a neighbouring small
// allocation) is written meanwhile either: those two pages are copied last, just before the move.
// Afterwards the pages are shared memory: a child forked later shares them instead of copying them.
//
// Move-only. Destroying it closes the memfds; the mappings stay, since the
// pages belong to the engine's allocations, which free them as they would
// (keep it as long as the daemon may use the memory: as long as the KvCache).
// Thread-compatible.
#pragma once

#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "common/kv_cache_layout.h"
#include "common/status.h"
#include "common/unique_fd.h"
#include "kvtier/client.h"

namespace kvtier {

// One range of engine memory, e.g. one layer's KV tensor.
struct HostRange {
  void* data = nullptr;
  uint64_t size_bytes = 0;
};

class AdoptedHostMemory {
 public:
  // Adopts the pages spanning every range. Ranges whose pages overlap (two
  // small tensors in one page, views of one storage) share one memfd: adopted
  // one at a time, the second would find its first page adopted already.
  // Errors: kInvalidArgument for no range, a null or empty one, or one that
  // is not anonymous private read-write memory of this process (the message
  // names the mapping found); the errno of memfd_create, ftruncate or mmap
  // otherwise. Nothing moves before every range is checked; a system call
  // that fails after that leaves the windows adopted before it adopted (the
  // same bytes at the same addresses, only shared), and a failed mmap over
  // the engine's pages, which Linux does only for lack of memory, may leave
  // them unmapped.
  static Result<AdoptedHostMemory> Adopt(std::span<const HostRange> ranges);

  AdoptedHostMemory(AdoptedHostMemory&&) noexcept = default;
  AdoptedHostMemory& operator=(AdoptedHostMemory&&) noexcept = default;

  // The memfds (borrowed: valid while this object lives) and their sizes,
  // one per group of overlapping ranges, for RegisterKvCache.
  std::vector<KvRegion> regions() const;
  // Placements written over the ranges (region = the range's index in
  // Adopt's argument), rewritten over regions(). Errors: kInvalidArgument
  // for a region index that names no range.
  Result<std::vector<Placement>> Rebase(std::vector<Placement> placements) const;

 private:
  // Marks [start, end) adopted for as long as it lives (host_memory.cc).
  class LiveSpan {
   public:
    LiveSpan(uintptr_t start, uintptr_t end);
    LiveSpan(LiveSpan&& other) noexcept : start_(std::exchange(other.start_, 0)) {}
    LiveSpan& operator=(LiveSpan&& other) noexcept {
      if (this != &other) {
        Release();
        start_ = std::exchange(other.start_, 0);
      }
      return *this;
    }
    ~LiveSpan() { Release(); }

   private:
    void Release() noexcept;
    uintptr_t start_ = 0;
  };
  struct Span {
    UniqueFd fd;
    uint64_t size_bytes = 0;
    LiveSpan live;
  };
  struct Where {
    uint32_t span = 0;
    uint64_t offset_bytes = 0;
  };
  AdoptedHostMemory() = default;

  std::vector<Span> spans_;
  std::vector<Where> ranges_;  // by the range's index in Adopt's argument
};

}  // namespace kvtier
