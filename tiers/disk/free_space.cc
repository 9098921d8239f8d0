#include "tiers/disk/free_space.h"

#include <sys/statvfs.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>

namespace kvtier {
namespace {

// "1073741824 bytes (1.0 GiB)": exact, and readable.
std::string Bytes(uint64_t n) {
  const bool gib = n >= (1ull << 30);
  char human[32];
  std::snprintf(human, sizeof(human), "%.1f %s",
                static_cast<double>(n) / (gib ? 1ull << 30 : 1ull << 20), gib ? "GiB" : "MiB");
  return std::to_string(n) + " bytes (" + human + ")";
}

}  // namespace

Result<FileSystemSpace> FileSystemSpaceOf(int fd, const std::string& path) {
  struct statvfs vfs {};
  if (::fstatvfs(fd, &vfs) != 0) return Err(Status::FromErrno(errno, "statvfs " + path));
  return FileSystemSpace{.size_bytes = static_cast<uint64_t>(vfs.f_blocks) * vfs.f_frsize,
                         .available_bytes = static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize};
}

uint64_t PreallocationReserveBytes(uint64_t file_system_bytes) {
  return std::min<uint64_t>(file_system_bytes / 32, 1ull << 30);
}

Status CheckRoomToPreallocate(const std::string& path, uint64_t size_bytes,
                              uint64_t allocated_bytes, const FileSystemSpace& space) {
  const uint64_t needed = size_bytes - std::min(size_bytes, allocated_bytes);
  const uint64_t reserve = PreallocationReserveBytes(space.size_bytes);
  // Nothing to allocate takes nothing, however full the file system is.
  if (needed == 0 ||
      (needed <= space.available_bytes && space.available_bytes - needed >= reserve)) {
    return Status::Ok();
  }
  return Status(
      StatusCode::kResourceExhausted,
      path + ": cannot preallocate " + Bytes(size_bytes) +
          (allocated_bytes > 0 ? " (it holds " + Bytes(allocated_bytes) + " already)" : "") +
          ": its file system has " + Bytes(space.available_bytes) + " available of " +
          Bytes(space.size_bytes) + ", and the disk tier leaves at least " + Bytes(reserve) +
          " free",
      ErrorSource::kErrno, ENOSPC);
}

}  // namespace kvtier
