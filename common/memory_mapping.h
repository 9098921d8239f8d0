// MemoryMapping: owns one mmap()ed region and unmaps it on destruction.
//
// Move-only. Thread-compatible: the object has one owner; the bytes it maps
// may be shared as the mapping flags say, and their synchronisation is the
// caller's.
#pragma once

#include <sys/mman.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>

#include "common/status.h"

namespace kvtier {

class MemoryMapping {
 public:
  struct Options {
    size_t size_bytes = 0;                   // REQUIRED: > 0
    int prot = PROT_READ | PROT_WRITE;
    int flags = MAP_PRIVATE | MAP_ANONYMOUS;  // MAP_SHARED with a memfd for shared memory
    int fd = -1;                              // borrowed; may be closed after Map returns
    off_t offset = 0;
  };

  // Maps a region. Errors: kInvalidArgument for a zero size, the mmap errno
  // otherwise (kResourceExhausted for ENOMEM).
  static Result<MemoryMapping> Map(const Options& options);
  // Anonymous private read-write memory of `size_bytes`.
  static Result<MemoryMapping> Anonymous(size_t size_bytes);

  MemoryMapping() = default;
  ~MemoryMapping() { Reset(); }
  MemoryMapping(MemoryMapping&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), size_bytes_(std::exchange(other.size_bytes_, 0)) {}
  MemoryMapping& operator=(MemoryMapping&& other) noexcept {
    if (this != &other) {
      Reset();
      data_ = std::exchange(other.data_, nullptr);
      size_bytes_ = std::exchange(other.size_bytes_, 0);
    }
    return *this;
  }
  MemoryMapping(const MemoryMapping&) = delete;
  MemoryMapping& operator=(const MemoryMapping&) = delete;

  // Valid until this object is destroyed, reset or moved from.
  uint8_t* data() const { return static_cast<uint8_t*>(data_); }
  size_t size_bytes() const { return size_bytes_; }
  std::span<uint8_t> bytes() const { return {data(), size_bytes_}; }
  bool valid() const { return data_ != nullptr; }

  // Unmaps now.
  void Reset();

  // Gives the pages of [offset, offset + size_bytes) back to the kernel
  // (MADV_DONTNEED) without unmapping them, so that a large mapping can be
  // released a piece at a time instead of in one long munmap. A private
  // anonymous mapping reads zeros there afterwards. REQUIRES: `offset` is a
  // multiple of the page size and the range lies inside the mapping.
  void Discard(size_t offset, size_t size_bytes);

  // Faults the pages of [offset, offset + size_bytes) in, writable
  // (MADV_POPULATE_WRITE), without changing what they hold: safe while
  // other threads write there. Errors: kUnimplemented where the kernel
  // lacks it (before Linux 5.14), kResourceExhausted for ENOMEM, the errno
  // otherwise. REQUIRES: as Discard.
  Status Populate(size_t offset, size_t size_bytes);

  // Asks for transparent huge pages over the whole mapping (MADV_HUGEPAGE):
  // a 2 MiB block in one page is one segment for a disk's DMA and one TLB
  // entry for a copy. Only advice, and ignored where the kernel has no
  // transparent huge pages; call before the pages are touched.
  void AdviseHugePages();

 private:
  MemoryMapping(void* data, size_t size_bytes) : data_(data), size_bytes_(size_bytes) {}

  void* data_ = nullptr;
  size_t size_bytes_ = 0;
};

}  // namespace kvtier
