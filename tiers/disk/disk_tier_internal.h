// Internals of the disk tier (tiers/disk/disk_tier.h), shared by its three
// source files: disk_tier.cc (open, recovery, reads, forgets, the index's
// values), disk_tier_append.cc (appends and group commits) and
// disk_tier_reclaim.cc (reclaim, carrying hit blocks forward, freeing
// regions). Nothing else includes it.
#pragma once

#include <rocksdb/slice.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "common/key128.h"
#include "common/mutex.h"
#include "common/status.h"
#include "tiers/disk/disk_tier.h"
#include "tiers/disk/record.h"

namespace kvtier::disk_tier_detail {

struct FreeDeleter {
  void operator()(uint8_t* p) const { std::free(p); }
};
using AlignedPage = std::unique_ptr<uint8_t, FreeDeleter>;

// Zeroed, 4 KiB aligned; `bytes` a multiple of 4 KiB.
AlignedPage NewPages(uint64_t bytes);

inline rocksdb::Slice KeySlice(const StoredKey& key) {
  return rocksdb::Slice(reinterpret_cast<const char*>(key.bytes.data()), key.bytes.size());
}

// Index value: version u8, device u32, region u32, offset u64, record_bytes
// u64, sequence u64, payload_bytes u64, payload_checksum u64, ns 16 bytes,
// owner_len u8, owner; version 2 then annotation_len u32 and the record's
// annotation; versions 3 and 4 the codec u8, dtype u8, group u32, raw_bytes
// u64, annotation_len u32 (0: none) and the annotation. Little-endian
// (common/le_bytes.h); docs/disk-format.md.
bool ParseValue(const StoredKey& key, std::string_view in, DiskRecord* out);

// A record's I/O is one or two requests: an old raw record's header page and
// payload; any other record's whole payload pages (none for a payload under
// 4 KiB) and tail page (none for a bare record of whole pages). The last one
// to finish carries on with the first error, if any. Thread-safe.
struct RecordIo {
  RecordIo(int parts, uint64_t page_bytes) : page(NewPages(page_bytes)), pending(parts) {}
  AlignedPage page;        // a raw record's header, or a packed one's tail
  std::atomic<int> pending;  // acq_rel: the last arrival sees every part's effects
  Mutex mu;
  Status status KVTIER_GUARDED_BY(mu);

  // Records one part's result; returns true (and the combined status) for
  // the last, false for the others.
  bool Arrive(const Result<uint64_t>& part, Status* combined) {
    if (!part) {
      MutexLock lock(&mu);
      if (status.ok()) status = part.error();
    }
    if (pending.fetch_sub(1, std::memory_order_acq_rel) != 1) return false;
    MutexLock lock(&mu);
    *combined = status;
    return true;
  }
};

// A region's row in the index's regions column family: its key (device,
// then region, big-endian, so that rows sort by device, then region) and
// value (its state u8, then its sequence, u64 little-endian).
std::string RegionKey(uint32_t device, uint32_t region);

std::string RegionValue(uint8_t state, uint64_t sequence);

// How a record's I/O splits (StartAppend writes it so, Read reads it so):
// a header-page record is its header page, then its padded payload; any
// other is its payload's whole pages straight from or into the caller's
// buffer (head_bytes, maybe 0), then the rest through the tier's own page
// (page_bytes, maybe 0: a bare record of whole pages): the payload's last
// bytes, zeros and, for a trailer record, the trailer.
struct RecordSplit {
  bool header_page = false;
  uint64_t head_bytes = 0;
  uint64_t page_bytes = 0;
  int parts = 1;  // I/O requests
};

RecordSplit SplitRecord(uint64_t payload_bytes, RecordFormat format);

// Checks a record read back: an older record's header (its header page, or
// the record's tail ending with its trailer: `header`) must decode and name
// `key` and this payload, and the payload's XXH3-64 must be `checksum` (the
// index's, which an older header holds too). kCorruption says what failed.
Status CheckRecord(const StoredKey& key, RecordFormat format, std::span<const uint8_t> header,
                   std::span<const uint8_t> payload, uint64_t checksum);

}  // namespace kvtier::disk_tier_detail
