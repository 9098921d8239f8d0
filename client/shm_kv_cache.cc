#include "kvtier/shm_kv_cache.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>

#include "common/check.h"

namespace kvtier {

Result<ShmKvCache> ShmKvCache::Create(const Layout& layout, uint32_t num_blocks) {
  if (num_blocks == 0) return Err(InvalidArgument("ShmKvCache: num_blocks must be > 0"));
  uint64_t size = 0;
  if (__builtin_mul_overflow(layout.block_bytes(), uint64_t{num_blocks}, &size) ||
      size > static_cast<uint64_t>(INT64_MAX)) {
    return Err(InvalidArgument("ShmKvCache: size overflows"));
  }
  UniqueFd fd(::memfd_create("kvtier-kv-cache", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!fd) return Err(Status::FromErrno(errno, "memfd_create"));
  if (::ftruncate(fd.get(), static_cast<off_t>(size)) != 0) {
    return Err(Status::FromErrno(errno, "ftruncate of the KV cache memfd"));
  }
  // The daemon maps this memory; a shrink under its copies would crash it, so
  // it refuses memfds without this seal.
  if (::fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_SEAL) != 0) {
    return Err(Status::FromErrno(errno, "sealing the KV cache memfd"));
  }
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
