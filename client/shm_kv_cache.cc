#include "kvtier/shm_kv_cache.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>

#include "client/sealed_memfd.h"
#include "common/check.h"

namespace kvtier {

Result<ShmKvCache> ShmKvCache::Create(const Layout& layout, uint32_t num_blocks) {
  if (num_blocks == 0) return Err(InvalidArgument("ShmKvCache: num_blocks must be > 0"));
  uint64_t size = 0;
  if (__builtin_mul_overflow(layout.block_bytes(), uint64_t{num_blocks}, &size) ||
      size > static_cast<uint64_t>(INT64_MAX)) {
    return Err(InvalidArgument("ShmKvCache: size overflows"));
  }
  KVTIER_ASSIGN_OR_RETURN(UniqueFd fd, NewSealedMemfd("kvtier-kv-cache", size));
  KVTIER_ASSIGN_OR_RETURN(
      MemoryMapping mapping,
      MemoryMapping::Map({.size_bytes = size, .prot = PROT_READ | PROT_WRITE, .flags = MAP_SHARED, .fd = fd.get()}));
  return ShmKvCache(layout, num_blocks, std::move(fd), std::move(mapping));
}

std::span<uint8_t> ShmKvCache::block(uint32_t id) const {
  KVTIER_CHECK(id < num_blocks_);
  return mapping_.bytes().subspan(uint64_t{id} * block_bytes(), block_bytes());
}

}  // namespace kvtier
