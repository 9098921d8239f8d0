// AdoptedHostMemory: lets kvtierd reach a CPU KV cache that the engine
// allocated itself (torch.zeros, malloc, a NumPy array) without moving it.
// The daemon only maps memfds (docs/protocol.md), so the pages spanning
// [data, data + size) are copied into a new memfd, sealed against shrinking,
// and that memfd is moved over them at the same address (mremap). The engine
// keeps its pointer and its bytes; from then on its pages and the daemon's
// mapping are the same memory, and no copy goes through the client again.
//
// Checked: the range lies in this process's anonymous private read-write
// memory (/proc/self/maps), so file mappings, shared memory and memory
// adopted before are refused. The caller's to ensure: no thread writes the
// range while Adopt runs (register at start-up, before the cache is used),
// and nothing else in its first and last pages (an allocator's header, or a
// neighbouring small allocation) is written meanwhile either: those two pages
// are copied last, just before the move. Afterwards the pages are shared
// memory: a child forked later shares them instead of copying them.
//
// Move-only. Destroying it closes the memfd; the mapping stays, since the
// pages belong to the engine's allocation, which frees them as it would.
// Thread-compatible.
#pragma once

#include <cstdint>

#include "common/status.h"
#include "common/unique_fd.h"
#include "kvtier/client.h"

namespace kvtier {

class AdoptedHostMemory {
 public:
  // Errors: kInvalidArgument for a null or empty range, or one that is not
  // anonymous private read-write memory of this process (the message names
  // the mapping found); the errno of memfd_create, ftruncate, mmap or mremap
  // otherwise (the range is unchanged unless the final mremap failed, which
  // Linux does only for lack of memory).
  static Result<AdoptedHostMemory> Adopt(void* data, uint64_t size_bytes);

  AdoptedHostMemory(AdoptedHostMemory&&) noexcept = default;
  AdoptedHostMemory& operator=(AdoptedHostMemory&&) noexcept = default;

  // The memfd (borrowed: valid while this object lives) and its size: the
  // whole pages spanning the adopted range, for RegisterKvCache.
  KvRegion region() const { return {fd_.get(), size_bytes_}; }
  // Where the adopted range starts in region(): add it to placement offsets.
  uint64_t offset_bytes() const { return offset_bytes_; }

 private:
  AdoptedHostMemory(UniqueFd fd, uint64_t size_bytes, uint64_t offset_bytes)
      : fd_(std::move(fd)), size_bytes_(size_bytes), offset_bytes_(offset_bytes) {}

  UniqueFd fd_;
  uint64_t size_bytes_ = 0;
  uint64_t offset_bytes_ = 0;
};

}  // namespace kvtier
