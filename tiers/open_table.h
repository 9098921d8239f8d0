// OpenTable: the open-addressing core of DiskOnlyIndex and of BlockIndex's
// key -> entry table. Fixed-size slots keyed by StoredKey in one flat array,
// linear probing, no tombstones, and growth that never rebuilds in one pass.
//
// Both tables live on BlockCache's event loop and may hold tens of millions
// of keys, so no call may walk the whole table:
//  - Erase shifts the rest of its probe run back (backward-shift deletion,
//    Knuth's Algorithm R), leaving the table as if the key had never been
//    inserted. No tombstones, so nothing ever needs a cleaning rebuild.
//  - Growth maps the larger table (untouched zero pages: free up front) and
//    then each Insert and Erase moves at most kMigrateSlotsPerCall slots of
//    the old table into it, Redis-dict style. Find, Erase and ForEach look in
//    both tables while a migration runs. The old table's pages go back to the
//    kernel behind the migration, so its memory shrinks as it goes and the
//    final unmap is short.
//
// Why lookups stay right during a migration: the old table is emptied in
// index order; [0, lo) is done. What remains is used as a ring [lo,
// capacity): a probe that runs off the end goes on at lo, and a key whose home
// is below lo starts probing at lo. Every remaining entry's path from its home
// to its slot was all full; taking slots away at the front takes the same
// slots out of every path that ran through them, so the paths stay full in
// the ring. Erase in the old table shifts within that ring.
//
// Traits supplies, as static members:
//   bool IsEmpty(const Slot&)      true for Slot{} and for an all-zero slot
//   const StoredKey& KeyOf(const Slot&)
//   uint64_t Hash(const StoredKey&)  mixed in all 64 bits (multiply-shift
//                                    takes the high bits of hash * capacity)
//   size_t kMaxLoadPercent         an Insert that would pass it grows first
//   size_t kGrowPercent            new capacity, in percent of what the live
//                                  keys need at kMaxLoadPercent
//   size_t kMinCapacity
//
// Thread-compatible.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <type_traits>
#include <utility>

#include "common/check.h"
#include "common/key128.h"
#include "common/memory_mapping.h"

namespace kvtier {

// The most old-table slots one Insert or Erase moves while a migration runs:
// the bound on the extra work of any one call.
inline constexpr size_t kOpenTableMigrateSlotsPerCall = 16;

struct OpenTableStats {
  size_t capacity = 0;  // slots of the table Inserts go to
  bool migrating = false;
  size_t slots_left_to_migrate = 0;  // of the old table
  size_t bytes = 0;                  // slot memory mapped now, both tables
};

template <typename Slot, typename Traits>
class OpenTable {
 public:
  static constexpr size_t kMigrateSlotsPerCall = kOpenTableMigrateSlotsPerCall;
  using Stats = OpenTableStats;

  OpenTable() = default;
  OpenTable(const OpenTable&) = delete;
  OpenTable& operator=(const OpenTable&) = delete;

  // Null when absent. Valid until the next Insert or Erase (both move slots).
  Slot* Find(const StoredKey& key) {
    const uint64_t h = Traits::Hash(key);
    if (Slot* s = current_.Find(key, h); s != nullptr) return s;
    return old_.Find(key, h);
  }

  // REQUIRES: `slot` is not empty and its key is absent (checked).
  void Insert(const Slot& slot) {
    KVTIER_CHECK(!Traits::IsEmpty(slot));
    if ((size_ + 1) * 100 > current_.capacity * Traits::kMaxLoadPercent) {
      // A migration ends long before the new table is full again (the
      // static_assert below), so a growth never finds one still running.
      KVTIER_CHECK(!migrating());
      StartGrowth();
    }
    MigrateSome();
    const StoredKey& key = Traits::KeyOf(slot);
    const uint64_t h = Traits::Hash(key);
    KVTIER_CHECK(old_.Find(key, h) == nullptr);
    current_.Put(slot, h);
    ++size_;
  }

  // REQUIRES: `slot` came from Find, with no Insert or Erase since.
  void Erase(Slot* slot) {
    Table& t = current_.Holds(slot) ? current_ : old_;
    KVTIER_CHECK(t.Holds(slot) && !Traits::IsEmpty(*slot));
    t.EraseAt(static_cast<size_t>(slot - t.slots));
    --size_;
    MigrateSome();
  }

  // Starts loading the home slot of `key` (in both tables while migrating).
  void Prefetch(const StoredKey& key) const {
    const uint64_t h = Traits::Hash(key);
    if (current_.capacity != 0) __builtin_prefetch(&current_.slots[current_.Home(h)]);
    if (migrating()) __builtin_prefetch(&old_.slots[old_.Home(h)]);
  }

  size_t size() const { return size_; }
  bool migrating() const { return old_.capacity != 0; }
  Stats stats() const {
    return {.capacity = current_.capacity,
            .migrating = migrating(),
            .slots_left_to_migrate = old_.capacity - old_.lo,
            .bytes = (current_.capacity + old_.capacity) * sizeof(Slot) - old_.released_bytes};
  }

  // f(Slot&) once for every non-empty slot. f must not Insert or Erase.
  template <typename F>
  void ForEach(F&& f) {
    current_.ForEach(f);
    old_.ForEach(f);
  }

 private:
  static_assert(std::is_trivially_copyable_v<Slot> && std::is_trivially_destructible_v<Slot>,
                "slots are moved with plain copies and live in zero-filled mappings");
  static_assert(Traits::kMaxLoadPercent > 0 && Traits::kMaxLoadPercent < 100);
  // A migration takes old_capacity / K calls, each adding at most one key;
  // with growth G and load L it ends before the new table reaches L when
  // G - 1 > 1 / (L * K). Twice that leaves room for rounding in small tables
  // (which kMinCapacity >= K keeps from being too small).
  static_assert((Traits::kGrowPercent - 100) * Traits::kMaxLoadPercent * kMigrateSlotsPerCall >=
                    2 * 100 * 100,
                "growth too small for the migration to finish before the next one is due");
  static_assert(Traits::kMinCapacity >= kMigrateSlotsPerCall);
  // Migrated old-table memory goes back to the kernel this much at a time:
  // few madvise calls, each a few tens of microseconds at most.
  static constexpr size_t kReleaseBytes = size_t{256} << 10;

  // One slot array, probed as a ring [lo, capacity).
  struct Table {
    MemoryMapping memory;
    Slot* slots = nullptr;
    size_t capacity = 0;
    size_t lo = 0;              // slots below lo have been migrated out
    size_t released_bytes = 0;  // at the front, given back to the kernel

    // A mapping is zero pages until written, and an all-zero slot is empty.
    static Table Allocate(size_t capacity) {
      static_assert(Traits::IsEmpty(Slot{}));
      Result<MemoryMapping> m = MemoryMapping::Anonymous(capacity * sizeof(Slot));
      // Out of memory: the index cannot go on without its table (as a
      // std::vector's bad_alloc would end the process).
      KVTIER_CHECK_MSG(m.has_value(), m.error().ToString());
      Table t;
      t.memory = std::move(*m);
      t.slots = static_cast<Slot*>(static_cast<void*>(t.memory.data()));
      t.capacity = capacity;
      return t;
    }

    size_t Home(uint64_t h) const {
      __extension__ using U128 = unsigned __int128;  // -Wpedantic asks for the marker
      // Multiply-shift, so the capacity need not be a power of two.
      const size_t i = static_cast<size_t>((static_cast<U128>(h) * capacity) >> 64);
      return i < lo ? lo : i;
    }
    size_t Next(size_t i) const { return i + 1 == capacity ? lo : i + 1; }
    // Steps from a to b along the ring.
    size_t Distance(size_t a, size_t b) const { return b >= a ? b - a : b + (capacity - lo) - a; }
    bool Holds(const Slot* s) const {
      return capacity != 0 && !std::less<const Slot*>()(s, slots + lo) &&
             std::less<const Slot*>()(s, slots + capacity);
    }

    Slot* Find(const StoredKey& key, uint64_t h) {
      // A probe run ends at an empty slot; a ring with none (late in a
      // migration) is walked once.
      for (size_t i = Home(h), n = capacity - lo; n > 0; --n, i = Next(i)) {
        Slot& s = slots[i];
        if (Traits::IsEmpty(s)) return nullptr;
        if (Traits::KeyOf(s) == key) return &s;
      }
      return nullptr;
    }

    // REQUIRES: below full (the load factor keeps it so).
    void Put(const Slot& slot, uint64_t h) {
      for (size_t i = Home(h);; i = Next(i)) {
        Slot& s = slots[i];
        if (Traits::IsEmpty(s)) {
          s = slot;
          return;
        }
        KVTIER_CHECK(!(Traits::KeyOf(s) == Traits::KeyOf(slot)));
      }
    }

    void EraseAt(size_t hole) {
      slots[hole] = Slot{};
      // Each later slot of the run moves into the hole when the hole lies on
      // its path from home; clearing as it moves keeps the run's end (an
      // empty slot) in sight even in a ring without another empty slot.
      for (size_t j = Next(hole); !Traits::IsEmpty(slots[j]); j = Next(j)) {
        const size_t home = Home(Traits::Hash(Traits::KeyOf(slots[j])));
        if (Distance(home, j) >= Distance(hole, j)) {
          slots[hole] = slots[j];
          slots[j] = Slot{};
          hole = j;
        }
      }
    }

    template <typename F>
    void ForEach(F& f) {
      for (size_t i = lo; i < capacity; ++i) {
        if (!Traits::IsEmpty(slots[i])) f(slots[i]);
      }
    }
  };

  void StartGrowth() {
    const size_t want = std::max(Traits::kMinCapacity, (size_ + 1) * 100 / Traits::kMaxLoadPercent *
                                                           Traits::kGrowPercent / 100);
    old_ = std::move(current_);
    current_ = Table::Allocate(want);
    if (size_ == 0) old_ = Table{};  // nothing to move
  }

  void MigrateSome() {
    if (!migrating()) return;
    const size_t end = std::min(old_.capacity, old_.lo + kMigrateSlotsPerCall);
    for (; old_.lo < end; ++old_.lo) {
      const Slot& s = old_.slots[old_.lo];
      if (!Traits::IsEmpty(s)) current_.Put(s, Traits::Hash(Traits::KeyOf(s)));
    }
    if (old_.lo == old_.capacity) {
      old_ = Table{};  // unmaps what is left
      return;
    }
    const size_t done = old_.lo * sizeof(Slot) / kReleaseBytes * kReleaseBytes;
    if (done > old_.released_bytes) {
      old_.memory.Discard(old_.released_bytes, done - old_.released_bytes);
      old_.released_bytes = done;
    }
  }

  Table current_;
  Table old_;  // capacity 0 unless migrating
  size_t size_ = 0;
};

}  // namespace kvtier
