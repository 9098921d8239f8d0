// DiskWriteLog: one tenant's disk records in the order they were written
// (key and location, 24 bytes each), so that a tenant at its disk quota can
// forget its oldest records to make room for new ones (BlockCache keeps one
// per tenant that has a disk quota).
//
// The log is not told when a record goes away by other means (a region's
// reclaim, a promotion, an eviction, a rewrite elsewhere): its entry turns
// stale, and the owner skips it when it reaches the front. So that stale
// entries cannot pile up behind a live one, the owner calls Compact after
// each Push with a bound on the live entries: once the log holds more than
// twice that bound (plus kSlack), a pass walks it front to back a few entries
// per call, keeping the live ones in order and turning the rest into spare
// room that later Pushes reuse and Compact gives back, a few entries per
// call. The pass examines more entries per call than one Push adds, so it
// catches up with the end. No call does more than a constant amount of work,
// and the log stays within about twice the live entries.
//
// Thread-compatible: owned by BlockCache's thread.
#pragma once

#include <cstdint>
#include <deque>

#include "common/key128.h"

namespace kvtier {

class DiskWriteLog {
 public:
  // Entries a log may hold beyond twice its live bound before a pass starts.
  static constexpr uint64_t kSlack = 1024;

  struct Record {
    StoredKey key;
    uint64_t where = 0;  // Where(device, offset)
  };
  static_assert(sizeof(Record) == 24);

  // A record's location in one word: the offset is 4 KiB aligned, so the
  // device (< 4096) fits in its low bits.
  static uint64_t Where(uint32_t device, uint64_t offset) { return offset | device; }

  DiskWriteLog() = default;
  DiskWriteLog(const DiskWriteLog&) = delete;
  DiskWriteLog& operator=(const DiskWriteLog&) = delete;
  DiskWriteLog(DiskWriteLog&&) = default;
  DiskWriteLog& operator=(DiskWriteLog&&) = default;

  // Appends the newest record.
  void Push(const Record& r) {
    if (end_ < q_.size()) {
      q_[end_] = r;
    } else {
      q_.push_back(r);
    }
    ++end_;
  }

  // The oldest entry (live or stale), or nullptr when the log is empty.
  // Valid until the next call.
  const Record* Oldest() const {
    const size_t front = passing_ && kept_ == 0 ? next_ : 0;
    return front < end_ ? &q_[front] : nullptr;
  }
  // REQUIRES: Oldest() != nullptr.
  void PopOldest() {
    if (passing_ && kept_ == 0) {
      ++next_;  // examined and let go: the pass skips it
      return;
    }
    q_.pop_front();
    --end_;
    if (passing_) {
      --kept_;
      --next_;
    }
  }

  // Up to `steps` entries of work: gives back spare room, and passes over
  // the log (starting a pass when it holds more than 2 * live_bound + kSlack
  // entries), keeping those for which is_live(const Record&) is true.
  template <typename IsLive>
  void Compact(IsLive&& is_live, uint64_t live_bound, uint32_t steps) {
    for (uint32_t i = 0; i < steps && q_.size() > end_; ++i) q_.pop_back();
    if (!passing_) {
      if (size() <= 2 * live_bound + kSlack) return;
      passing_ = true;
      kept_ = next_ = 0;
    }
    for (uint32_t i = 0; i < steps; ++i) {
      if (next_ == end_) {
        end_ = kept_;  // what the pass let go is spare room now
        passing_ = false;
        return;
      }
      if (is_live(q_[next_])) q_[kept_++] = q_[next_];
      ++next_;
    }
  }

  // Entries, live or stale.
  size_t size() const { return passing_ ? kept_ + (end_ - next_) : end_; }
  // Entries the deque holds: the log, what a pass has let go, and spare room.
  size_t held() const { return q_.size(); }

 private:
  // q_[0, end_) is the log; q_[end_, q_.size()) is spare room. While a pass
  // runs, q_[0, kept_) are the entries it kept, q_[kept_, next_) what it let
  // go, and q_[next_, end_) what it has yet to examine.
  std::deque<Record> q_;
  size_t end_ = 0;
  bool passing_ = false;
  size_t kept_ = 0;
  size_t next_ = 0;
};

}  // namespace kvtier
