// ShmKvCache: a KV cache in memfd shared memory, for CPU inference engines and
// tests. Blocks are contiguous and in kvtier's canonical order
// (KvCacheLayout::Contiguous), and the memfd is sealed against shrinking, as
// the daemon requires before it maps the memory.
//
// Move-only; the memory is unmapped and the memfd closed on destruction.
// Thread-compatible (the bytes are the engine's to synchronise).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "common/kv_cache_layout.h"
#include "common/layout.h"
#include "common/memory_mapping.h"
#include "common/status.h"
#include "common/unique_fd.h"

namespace kvtier {

class ShmKvCache {
 public:
  // Errors: kInvalidArgument for zero blocks or a size that overflows; the
  // memfd_create/ftruncate/mmap errno otherwise.
  static Result<ShmKvCache> Create(const Layout& layout, uint32_t num_blocks);

  ShmKvCache(ShmKvCache&&) noexcept = default;
  ShmKvCache& operator=(ShmKvCache&&) noexcept = default;

  const Layout& layout() const { return layout_; }
  uint32_t num_blocks() const { return num_blocks_; }
  uint64_t block_bytes() const { return layout_.block_bytes(); }
  // REQUIRES: id < num_blocks(). Valid while this object lives.
  std::span<uint8_t> block(uint32_t id) const;
  int fd() const { return fd_.get(); }
  uint64_t size_bytes() const { return mapping_.size_bytes(); }
  std::vector<Placement> placements() const { return KvCacheLayout::Contiguous(layout_); }

 private:
  ShmKvCache(Layout layout, uint32_t num_blocks, UniqueFd fd, MemoryMapping mapping)
      : layout_(std::move(layout)), num_blocks_(num_blocks), fd_(std::move(fd)), mapping_(std::move(mapping)) {}

  Layout layout_;
  uint32_t num_blocks_;
  UniqueFd fd_;
  MemoryMapping mapping_;
};

}  // namespace kvtier
