#include "kvtier/host_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>

namespace kvtier {
namespace {

// Whether [start, end) lies in anonymous private read-write mappings of this
// process, one after another; else why not.
Status CheckAnonymousPrivate(uintptr_t start, uintptr_t end) {
  std::ifstream maps("/proc/self/maps");
  if (!maps) return Status::FromErrno(errno, "reading /proc/self/maps");
  std::string line;
  uintptr_t covered = start;
  while (covered < end && std::getline(maps, line)) {
    uintptr_t lo = 0;
    uintptr_t hi = 0;
    char perms[5] = {};
    unsigned long long offset = 0;
    unsigned dev_major = 0;
    unsigned dev_minor = 0;
    unsigned long long inode = 0;
    int path_at = 0;
    if (std::sscanf(line.c_str(), "%" SCNxPTR "-%" SCNxPTR " %4s %llx %x:%x %llu %n", &lo, &hi, perms, &offset,
                    &dev_major, &dev_minor, &inode, &path_at) < 7) {
      continue;
    }
    if (hi <= covered) continue;
    if (lo > covered) break;  // a hole
    const std::string path = path_at > 0 ? line.substr(static_cast<size_t>(path_at)) : "";
    const bool anonymous = inode == 0 && (path.empty() || path == "[heap]");
    if (std::strcmp(perms, "rw-p") != 0 || !anonymous) {
      return InvalidArgument("memory at 0x" + (std::ostringstream() << std::hex << covered).str() +
                             " is not anonymous private read-write memory (mapping " + line +
                             "): kvtier can share only memory the engine allocated itself "
                             "(e.g. torch.zeros), and only once");
    }
    covered = hi;
  }
  if (covered < end) {
    return InvalidArgument("memory at 0x" + (std::ostringstream() << std::hex << covered).str() +
                           " is not mapped in this process");
  }
  return Status::Ok();
}

}  // namespace

Result<AdoptedHostMemory> AdoptedHostMemory::Adopt(void* data, uint64_t size_bytes) {
  if (data == nullptr || size_bytes == 0) {
    return Err(InvalidArgument("AdoptedHostMemory: a null or empty range"));
  }
  const auto page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const auto begin = reinterpret_cast<uintptr_t>(data);
  uintptr_t last = 0;
  if (__builtin_add_overflow(begin, size_bytes, &last) || last > UINTPTR_MAX - page) {
    return Err(InvalidArgument("AdoptedHostMemory: the range overflows"));
  }
  const uintptr_t start = begin & ~(page - 1);
  const uintptr_t end = (last + page - 1) & ~(page - 1);
  const uint64_t length = end - start;
  KVTIER_RETURN_IF_ERROR(CheckAnonymousPrivate(start, end));

  UniqueFd fd(::memfd_create("kvtier-engine-kv-cache", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!fd) return Err(Status::FromErrno(errno, "memfd_create"));
  if (::ftruncate(fd.get(), static_cast<off_t>(length)) != 0) {
    return Err(Status::FromErrno(errno, "ftruncate of the adopted KV cache memfd"));
  }
  // The daemon maps this memory; a shrink under its copies would crash it.
  if (::fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_SEAL) != 0) {
    return Err(Status::FromErrno(errno, "sealing the adopted KV cache memfd"));
  }
  void* staging = ::mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
  if (staging == MAP_FAILED) return Err(Status::FromErrno(errno, "mmap of the adopted KV cache memfd"));
  auto* to = static_cast<uint8_t*>(staging);
  const auto* from = reinterpret_cast<const uint8_t*>(start);
  // The interior first, then the two edge pages, which may hold other data
  // of the process: their copy is the last thing before the move.
  if (length > 2 * page) std::memcpy(to + page, from + page, length - 2 * page);
  std::memcpy(to, from, page);
  if (length > page) std::memcpy(to + length - page, from + length - page, page);
  void* moved = ::mremap(staging, length, length, MREMAP_MAYMOVE | MREMAP_FIXED, reinterpret_cast<void*>(start));
  if (moved == MAP_FAILED) {
    const int error = errno;
    ::munmap(staging, length);
    return Err(Status::FromErrno(error, "mremap of the KV cache memfd over the engine's pages"));
  }
  return AdoptedHostMemory(std::move(fd), length, begin - start);
}

}  // namespace kvtier
