#include "kvtier/host_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include "client/sealed_memfd.h"

namespace kvtier {
namespace {

constexpr char kMemfdName[] = "kvtier-engine-kv-cache";

// The page spans adopted by live AdoptedHostMemory objects of this process,
// start -> end. Spans adopted before and since released stay shared mappings
// of their (closed) memfds, and the engine's allocator hands them out again:
// those may be adopted anew, live ones never.
struct LiveSpans {
  std::mutex mu;
  std::map<uintptr_t, uintptr_t> spans;

  static LiveSpans& Get() {
    static LiveSpans* live = new LiveSpans();  // never destroyed: used by static destructors
    return *live;
  }
  bool Overlaps(uintptr_t start, uintptr_t end) {
    std::lock_guard lock(mu);
    auto it = spans.upper_bound(start);
    if (it != spans.begin() && std::prev(it)->second > start) return true;
    return it != spans.end() && it->first < end;
  }
};

// Whether [start, end) lies in anonymous private read-write mappings of this
// process (or in mappings of kvtier's own memfds that no live adoption
// holds), one after another; else why not.
Status CheckAdoptable(uintptr_t start, uintptr_t end) {
  if (LiveSpans::Get().Overlaps(start, end)) {
    return InvalidArgument("memory at 0x" + (std::ostringstream() << std::hex << start).str() +
                           " is registered with kvtier already (a live KV cache holds it)");
  }
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
    if (std::sscanf(line.c_str(), "%" SCNxPTR "-%" SCNxPTR " %4s %llx %x:%x %llu %n", &lo, &hi,
                    perms, &offset, &dev_major, &dev_minor, &inode, &path_at) < 7) {
      continue;
    }
    if (hi <= covered) continue;
    if (lo > covered) break;  // a hole
    const std::string path = path_at > 0 ? line.substr(static_cast<size_t>(path_at)) : "";
    const bool anonymous = inode == 0 && (path.empty() || path == "[heap]");
    const bool released = std::strcmp(perms, "rw-s") == 0 &&
                          path.starts_with(std::string("/memfd:") + kMemfdName);
    if (!(std::strcmp(perms, "rw-p") == 0 && anonymous) && !released) {
      return InvalidArgument("memory at 0x" + (std::ostringstream() << std::hex << covered).str() +
                             " is not anonymous private read-write memory (mapping " + line +
                             "): kvtier can share only memory the engine allocated itself "
                             "(e.g. torch.zeros)");
    }
    covered = hi;
  }
  if (covered < end) {
    return InvalidArgument("memory at 0x" + (std::ostringstream() << std::hex << covered).str() +
                           " is not mapped in this process");
  }
  return Status::Ok();
}

#if defined(__SANITIZE_ADDRESS__)
#define KVTIER_UNDER_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define KVTIER_UNDER_ASAN 1
#endif
#endif

#ifdef KVTIER_UNDER_ASAN
// Copies whole pages of this process's memory. Besides the ranges they hold
// other bytes: an allocator's headers and, under AddressSanitizer, its red
// zones, which are read here on purpose; so the copy is a loop the sanitizer
// does not check (memcpy would go through its checked interceptor).
__attribute__((no_sanitize("address"))) void CopyPages(uint8_t* to, const uint8_t* from,
                                                       uint64_t bytes) {
  auto* d = reinterpret_cast<volatile uint64_t*>(to);
  const auto* s = reinterpret_cast<const volatile uint64_t*>(from);
  for (uint64_t i = 0; i < bytes / sizeof(uint64_t); ++i) d[i] = s[i];
}
#endif

// Whether the page at `p` holds only zero bytes. Not sanitized, for the
// same reason as CopyPages: the pages may hold red zones.
__attribute__((no_sanitize("address"))) bool IsZeroPage(const uint8_t* p, uint64_t page) {
#ifdef KVTIER_UNDER_ASAN
  const auto* s = reinterpret_cast<const volatile uint64_t*>(p);
  for (uint64_t i = 0; i < page / sizeof(uint64_t); ++i) {
    if (s[i] != 0) return false;
  }
  return true;
#else
  // All bytes equal to the first word's, which is zero: one stream, read by
  // glibc's vectorized memcmp.
  uint64_t first = 0;
  std::memcpy(&first, p, sizeof(first));
  return first == 0 && std::memcmp(p, p + sizeof(first), page - sizeof(first)) == 0;
#endif
}

// A part of a span to adopt: [offset, offset + length) from its start.
struct Piece {
  uint64_t offset = 0;
  uint64_t length = 0;
};

// Writes the bytes [from, from + length) into the memfd at `offset`.
Status WriteRun(int fd, const uint8_t* from, uint64_t offset, uint64_t length) {
#ifdef KVTIER_UNDER_ASAN
  // Through a mapping and CopyPages: pwrite's interceptor would check the
  // bytes, and they may hold the allocator's red zones.
  void* staging =
      ::mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_SHARED, fd, static_cast<off_t>(offset));
  if (staging == MAP_FAILED) return Status::FromErrno(errno, "mmap of the adopted KV cache memfd");
  CopyPages(static_cast<uint8_t*>(staging), from, length);
  ::munmap(staging, length);
#else
  // pwrite fills whole shmem pages without zeroing them first, which a
  // store through a mapping pays for: faster than a memcpy into fresh memory.
  while (length > 0) {
    const ssize_t n = ::pwrite(fd, from, length, static_cast<off_t>(offset));
    if (n < 0) {
      if (errno == EINTR) continue;
      return Status::FromErrno(errno, "writing the KV cache into its memfd");
    }
    from += n;
    offset += static_cast<uint64_t>(n);
    length -= static_cast<uint64_t>(n);
  }
#endif
  return Status::Ok();
}

// Copies the pieces of [start, ...) into the memfd at the same offsets, then
// maps the memfd over them (which frees the engine's private pages). Pages
// that hold only zeros are not copied: the memfd's holes read as zeros and
// take memory only once written, so an engine's fresh cache costs one read.
Status CopyAndMap(int fd, uintptr_t start, std::span<const Piece> pieces, uint64_t page) {
  for (const Piece& piece : pieces) {
    const auto* from = reinterpret_cast<const uint8_t*>(start + piece.offset);
    for (uint64_t at = 0; at < piece.length;) {
      if (IsZeroPage(from + at, page)) {
        at += page;
        continue;
      }
      uint64_t run = page;
      while (at + run < piece.length && !IsZeroPage(from + at + run, page)) run += page;
      KVTIER_RETURN_IF_ERROR(WriteRun(fd, from + at, piece.offset + at, run));
      at += run;
    }
  }
  for (const Piece& piece : pieces) {
    void* where = reinterpret_cast<void*>(start + piece.offset);
    void* mapped = ::mmap(where, piece.length, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd,
                          static_cast<off_t>(piece.offset));
    if (mapped == MAP_FAILED)
      return Status::FromErrno(errno, "mmap of the KV cache memfd over the engine's pages");
  }
  return Status::Ok();
}

// Moves the pages [start, start + length) into a new sealed memfd at the same
// address, a window at a time, so that memory use grows by one window, not by
// the whole cache; returns the memfd.
Result<UniqueFd> AdoptPages(uintptr_t start, uint64_t length, uint64_t page) {
  constexpr uint64_t kWindowBytes = 64ULL << 20;
  KVTIER_ASSIGN_OR_RETURN(UniqueFd fd, NewSealedMemfd(kMemfdName, length));
  // The interior first, then the two edge pages, which may hold other data
  // of the process: their copy is the last thing before their move.
  if (length > 2 * page) {
    for (uint64_t at = page; at < length - page; at += kWindowBytes) {
      const Piece window{at, std::min(kWindowBytes, length - page - at)};
      KVTIER_RETURN_IF_ERROR(CopyAndMap(fd.get(), start, std::span(&window, 1), page));
    }
  }
  std::vector<Piece> edges{{0, page}};
  if (length > page) edges.push_back({length - page, page});
  KVTIER_RETURN_IF_ERROR(CopyAndMap(fd.get(), start, edges, page));
  return fd;
}

}  // namespace

Result<AdoptedHostMemory> AdoptedHostMemory::Adopt(std::span<const HostRange> ranges) {
  if (ranges.empty()) return Err(InvalidArgument("AdoptedHostMemory: no range"));
  const auto page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  // Each range's whole pages, then groups of overlapping ones, by address.
  struct Pages {
    uintptr_t start = 0;
    uintptr_t end = 0;
    size_t range = 0;
  };
  std::vector<Pages> pages;
  for (size_t i = 0; i < ranges.size(); ++i) {
    const auto begin = reinterpret_cast<uintptr_t>(ranges[i].data);
    uintptr_t last = 0;
    if (begin == 0 || ranges[i].size_bytes == 0) {
      return Err(
          InvalidArgument("AdoptedHostMemory: range " + std::to_string(i) + " is null or empty"));
    }
    if (__builtin_add_overflow(begin, ranges[i].size_bytes, &last) || last > UINTPTR_MAX - page) {
      return Err(InvalidArgument("AdoptedHostMemory: range " + std::to_string(i) + " overflows"));
    }
    pages.push_back({begin & ~(page - 1), (last + page - 1) & ~(page - 1), i});
  }
  std::sort(pages.begin(), pages.end(),
            [](const Pages& a, const Pages& b) { return a.start < b.start; });
  struct Group {
    uintptr_t start = 0;
    uintptr_t end = 0;
  };
  std::vector<Group> groups;
  std::vector<uint32_t> group_of(ranges.size());
  for (const Pages& p : pages) {
    if (groups.empty() || p.start >= groups.back().end) groups.push_back({p.start, p.end});
    groups.back().end = std::max(groups.back().end, p.end);
    group_of[p.range] = static_cast<uint32_t>(groups.size() - 1);
  }
  // Everything is checked before anything moves.
  for (const Group& g : groups) KVTIER_RETURN_IF_ERROR(CheckAdoptable(g.start, g.end));
  AdoptedHostMemory out;
  for (const Group& g : groups) {
    KVTIER_ASSIGN_OR_RETURN(UniqueFd fd, AdoptPages(g.start, g.end - g.start, page));
    out.spans_.push_back(Span{std::move(fd), g.end - g.start, LiveSpan(g.start, g.end)});
  }
  for (size_t i = 0; i < ranges.size(); ++i) {
    const uint32_t g = group_of[i];
    out.ranges_.push_back(Where{g, reinterpret_cast<uintptr_t>(ranges[i].data) - groups[g].start});
  }
  return out;
}

AdoptedHostMemory::LiveSpan::LiveSpan(uintptr_t start, uintptr_t end) : start_(start) {
  LiveSpans& live = LiveSpans::Get();
  std::lock_guard lock(live.mu);
  live.spans[start] = end;
}

void AdoptedHostMemory::LiveSpan::Release() noexcept {
  if (start_ == 0) return;
  LiveSpans& live = LiveSpans::Get();
  std::lock_guard lock(live.mu);
  live.spans.erase(std::exchange(start_, 0));
}

std::vector<KvRegion> AdoptedHostMemory::regions() const {
  std::vector<KvRegion> out;
  for (const Span& s : spans_) out.push_back(KvRegion{s.fd.get(), s.size_bytes});
  return out;
}

Result<std::vector<Placement>> AdoptedHostMemory::Rebase(std::vector<Placement> placements) const {
  for (size_t i = 0; i < placements.size(); ++i) {
    Placement& p = placements[i];
    if (p.region >= ranges_.size()) {
      return Err(InvalidArgument("placement " + std::to_string(i) + " names range " +
                                 std::to_string(p.region) + "; there are " +
                                 std::to_string(ranges_.size())));
    }
    p.offset_bytes += ranges_[p.region].offset_bytes;
    p.region = ranges_[p.region].span;
  }
  return placements;
}

}  // namespace kvtier
