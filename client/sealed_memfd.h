// A memfd of `size_bytes` that the daemon will accept for a KV cache: sealed
// against shrinking (a shrink under the daemon's copies would crash it) and
// against further seals, plus `more_seals` (F_SEAL_GROW for a fixed-size
// page). Used by ShmKvCache, AdoptedHostMemory and CudaExport's completion
// page; `what` names the memfd in errors and in /proc/PID/maps.
//
// Internal to libkvtier. Thread-safe (no shared state).
#pragma once

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <string>

#include "common/status.h"
#include "common/unique_fd.h"

namespace kvtier {

inline Result<UniqueFd> NewSealedMemfd(const char* what, uint64_t size_bytes, int more_seals = 0) {
  UniqueFd fd(::memfd_create(what, MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!fd) return Err(Status::FromErrno(errno, std::string("memfd_create of ") + what));
  if (::ftruncate(fd.get(), static_cast<off_t>(size_bytes)) != 0) {
    return Err(Status::FromErrno(errno, std::string("ftruncate of ") + what));
  }
  if (::fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_SEAL | more_seals) != 0) {
    return Err(Status::FromErrno(errno, std::string("sealing ") + what));
  }
  return fd;
}

}  // namespace kvtier
