#include "common/memory_mapping.h"

#include <cerrno>
#include <string>

#include "common/check.h"

namespace kvtier {

Result<MemoryMapping> MemoryMapping::Map(const Options& options) {
  if (options.size_bytes == 0) {
    return Err(InvalidArgument("MemoryMapping: size_bytes must be > 0"));
  }
  void* p = ::mmap(nullptr, options.size_bytes, options.prot, options.flags, options.fd,
                   options.offset);
  if (p == MAP_FAILED) {
    return Err(Status::FromErrno(errno, "mmap of " + std::to_string(options.size_bytes) + " bytes"));
  }
  return MemoryMapping(p, options.size_bytes);
}

Result<MemoryMapping> MemoryMapping::Anonymous(size_t size_bytes) {
  return Map(Options{.size_bytes = size_bytes});
}

void MemoryMapping::Discard(size_t offset, size_t size_bytes) {
  KVTIER_CHECK(offset <= size_bytes_ && size_bytes <= size_bytes_ - offset);
  // Fails only for invalid arguments (a misaligned offset), a bug.
  KVTIER_CHECK(::madvise(data() + offset, size_bytes, MADV_DONTNEED) == 0);
}

Status MemoryMapping::Populate(size_t offset, size_t size_bytes) {
  KVTIER_CHECK(offset <= size_bytes_ && size_bytes <= size_bytes_ - offset);
#ifndef MADV_POPULATE_WRITE
  constexpr int MADV_POPULATE_WRITE = 23;  // <linux/mman.h>, Linux 5.14
#endif
  if (::madvise(data() + offset, size_bytes, MADV_POPULATE_WRITE) == 0) return Status::Ok();
  if (errno == EINVAL) {
    return Status(StatusCode::kUnimplemented, "MADV_POPULATE_WRITE: this kernel lacks it (Linux 5.14 added it)");
  }
  return Status::FromErrno(errno, "madvise(MADV_POPULATE_WRITE)");
}

void MemoryMapping::AdviseHugePages() {
  if (data_ != nullptr) (void)::madvise(data_, size_bytes_, MADV_HUGEPAGE);
}

void MemoryMapping::Reset() {
  if (data_ != nullptr) {
    ::munmap(data_, size_bytes_);  // Fails only for invalid arguments, which we never pass.
    data_ = nullptr;
    size_bytes_ = 0;
  }
}

}  // namespace kvtier
