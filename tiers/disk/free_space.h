// Free space for the disk tier: before a segment file is preallocated, its
// file system must have room for it and keep a reserve, so that the disk
// tier never fills the file system it shares with its index, logs and
// whatever else lives there (fallocate would allocate until ENOSPC and leave
// the file system full).
//
// Thread-safe (pure functions, and one statvfs).
#pragma once

#include <cstdint>
#include <string>

#include "common/status.h"

namespace kvtier {

struct FileSystemSpace {
  uint64_t size_bytes = 0;  // f_blocks * f_frsize
  uint64_t available_bytes =
      0;  // f_bavail * f_frsize: what an unprivileged user may still allocate
};

// The file system of the open descriptor `fd` (`path` names it in errors).
// Errors: the errno of fstatvfs.
Result<FileSystemSpace> FileSystemSpaceOf(int fd, const std::string& path);

// What preallocation leaves free at least: 1/32 of the file system, at most
// 1 GiB (documented in docs/config.md, tiers.disk.bytes).
uint64_t PreallocationReserveBytes(uint64_t file_system_bytes);

// Whether `path`, which holds `allocated_bytes` already (st_blocks * 512; 0
// for a new file), may grow to `size_bytes`: OK when what it still needs
// leaves PreallocationReserveBytes available. Errors: kResourceExhausted
// (errno ENOSPC) naming the path, the size asked for, what the file holds,
// what is available and the reserve.
Status CheckRoomToPreallocate(const std::string& path, uint64_t size_bytes,
                              uint64_t allocated_bytes, const FileSystemSpace& space);

}  // namespace kvtier
