// FaultyDevice: a BlockDevice that wraps another one (borrowed) and injects
// the failures a disk tier must survive (the "fault-injecting wrapper" seam in
// STYLE.md):
//   FailNth       the nth matching op from now fails with a chosen errno (EIO,
//                 ENOSPC, ...) and never reaches the wrapped device;
//   FailAll       every matching op fails so, until ClearFaults (a dead disk);
//   HoldWrites    writes wait, unstarted, until ReleaseWrites (a slow disk);
//   TornWriteNth  only an aligned prefix of the nth write reaches the device,
//                 yet `done` reports success — what a crash in the middle of a
//                 write looks like after restart;
//   BitFlipOnRead every successful read covering a byte sees one bit of it
//                 flipped; the wrapped device's bytes are untouched.
// Anything not armed passes through unchanged. Short transfers are not
// injected: the contract makes devices retry them, so callers never see one.
//
// Counting is by call order: "nth from now" counts ops as they are issued,
// from the call that arms the fault. Rules count independently; when a
// failure and a torn write fire on the same write, the failure wins (both are
// used up); when two failures fire on the same op, the one armed first wins.
//
// Injected failures complete on the wrapper's own thread, never inside the
// call, as the contract requires.
//
// Thread-safe. REQUIRES: the wrapped device outlives this one, and every op
// issued through this one has completed before it is destroyed.
#pragma once

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "common/check.h"
#include "common/mutex.h"
#include "common/serial_executor.h"
#include "tiers/disk/block_device.h"

namespace kvtier {

enum class FaultOp : uint8_t { kRead, kWrite, kSync, kAny };

class FaultyDevice : public BlockDevice {
 public:
  struct Counters {
    uint64_t failed_ops = 0;   // ops failed by FailNth
    uint64_t torn_writes = 0;  // writes cut short by TornWriteNth
    uint64_t bit_flips = 0;    // bits flipped in read results
  };

  // `inner` is borrowed and must outlive this device.
  explicit FaultyDevice(BlockDevice* inner)
      : inner_(inner), name_("faulty(" + inner->name() + ")") {}

  uint64_t size_bytes() const override { return inner_->size_bytes(); }
  uint32_t alignment() const override { return inner_->alignment(); }
  const std::string& name() const override { return name_; }

  // The nth op of kind `op` (1 = the next one) fails with errno `err`.
  // REQUIRES: n >= 1, err > 0.
  void FailNth(FaultOp op, uint64_t n, int err) {
    KVTIER_CHECK(n >= 1 && err > 0);
    MutexLock lock(&mu_);
    fail_rules_.push_back({op, n, err});
  }

  // Every op of kind `op` from now fails with errno `err`, until
  // ClearFaults. REQUIRES: err > 0.
  void FailAll(FaultOp op, int err) {
    KVTIER_CHECK(err > 0);
    MutexLock lock(&mu_);
    fail_rules_.push_back({op, 0, err, /*every=*/true});
  }

  // Writes issued from now wait until ReleaseWrites, which starts them in
  // order (a disk that cannot keep up, frozen for the test).
  void HoldWrites() {
    MutexLock lock(&mu_);
    hold_writes_ = true;
  }
  void ReleaseWrites() {
    std::vector<HeldWrite> held;
    {
      MutexLock lock(&mu_);
      hold_writes_ = false;
      held.swap(held_);
    }
    for (HeldWrite& w : held) Write(w.offset, w.buffer, std::move(w.done));
  }
  size_t held_writes() const {
    MutexLock lock(&mu_);
    return held_.size();
  }

  // Of the nth write from now (1 = the next), only the first `keep_bytes`
  // reach the wrapped device (all of it if the write is shorter; none for 0);
  // `done` reports the full length. A write the wrapped device would reject
  // (misaligned, out of bounds) is passed through whole so it still fails.
  // REQUIRES: n >= 1, keep_bytes a multiple of alignment().
  void TornWriteNth(uint64_t n, uint64_t keep_bytes) {
    KVTIER_CHECK(n >= 1 && keep_bytes % alignment() == 0);
    MutexLock lock(&mu_);
    torn_rules_.push_back({n, keep_bytes});
  }

  // Until ClearFaults(), every successful read covering device byte `offset`
  // returns it with bit `bit` (0 = least significant) inverted. Arming the
  // same bit twice is the same as once. REQUIRES: bit < 8.
  void BitFlipOnRead(uint64_t offset, uint8_t bit) {
    KVTIER_CHECK(bit < 8);
    MutexLock lock(&mu_);
    flips_.insert({offset, bit});
  }

  // Disarms everything; counters are kept.
  void ClearFaults() {
    MutexLock lock(&mu_);
    fail_rules_.clear();
    torn_rules_.clear();
    flips_.clear();
  }

  Counters counters() const {
    MutexLock lock(&mu_);
    return counters_;
  }

  void Read(uint64_t offset, std::span<uint8_t> buffer, Done done) override {
    std::vector<std::pair<uint64_t, uint8_t>> flips;
    int err = 0;
    {
      MutexLock lock(&mu_);
      err = TakeFailure(FaultOp::kRead);
      if (err == 0) {
        // Decided at issue time, like every other fault.
        for (auto it = flips_.lower_bound({offset, 0});
             it != flips_.end() && it->first - offset < buffer.size(); ++it) {
          flips.push_back(*it);
        }
      }
    }
    if (err != 0) return Fail(err, "read at offset " + std::to_string(offset), std::move(done));
    if (flips.empty()) return inner_->Read(offset, buffer, std::move(done));
    inner_->Read(offset, buffer,
                 [this, offset, buffer, flips = std::move(flips),
                  done = std::move(done)](Result<uint64_t> result) {
                   if (result.has_value()) {
                     for (const auto& [at, bit] : flips) {
                       buffer[at - offset] ^= static_cast<uint8_t>(1u << bit);
                     }
                     MutexLock lock(&mu_);
                     counters_.bit_flips += flips.size();
                   }
                   done(std::move(result));
                 });
  }

  void Write(uint64_t offset, std::span<const uint8_t> buffer, Done done) override {
    int err = 0;
    std::optional<uint64_t> keep_bytes;
    {
      MutexLock lock(&mu_);
      if (hold_writes_) {
        held_.push_back(HeldWrite{offset, buffer, std::move(done)});
        return;
      }
      err = TakeFailure(FaultOp::kWrite);
      keep_bytes = TakeTornWrite();
      if (err != 0) {
        keep_bytes.reset();
      } else if (keep_bytes && !Acceptable(offset, buffer)) {
        keep_bytes.reset();
      } else if (keep_bytes) {
        ++counters_.torn_writes;
      }
    }
    if (err != 0) return Fail(err, "write at offset " + std::to_string(offset), std::move(done));
    if (!keep_bytes) return inner_->Write(offset, buffer, std::move(done));
    const uint64_t full_bytes = buffer.size();
    const uint64_t kept = std::min<uint64_t>(*keep_bytes, full_bytes);
    if (kept == 0) {
      executor_.Post([full_bytes, done = std::move(done)] { done(full_bytes); });
      return;
    }
    inner_->Write(offset, buffer.first(kept),
                  [full_bytes, done = std::move(done)](Result<uint64_t> result) {
                    // The lie is the point: the writer believes all of it landed.
                    if (result.has_value()) result = full_bytes;
                    done(std::move(result));
                  });
  }

  void Sync(Done done) override {
    int err = 0;
    {
      MutexLock lock(&mu_);
      err = TakeFailure(FaultOp::kSync);
    }
    if (err != 0) return Fail(err, "sync", std::move(done));
    inner_->Sync(std::move(done));
  }

 private:
  struct FailRule {
    FaultOp op;
    uint64_t remaining;  // matching ops until it fires, counting the firing one
    int err;
    bool every = false;  // fires on every matching op, and stays
  };
  struct HeldWrite {
    uint64_t offset;
    std::span<const uint8_t> buffer;
    Done done;
  };
  struct TornRule {
    uint64_t remaining;
    uint64_t keep_bytes;
  };

  // Counts this op against every failure rule; returns the errno of the
  // first that fires, or 0.
  int TakeFailure(FaultOp op) KVTIER_REQUIRES(mu_) {
    int err = 0;
    for (auto it = fail_rules_.begin(); it != fail_rules_.end();) {
      if ((it->op == op || it->op == FaultOp::kAny) && it->every) {
        if (err == 0) err = it->err;
        ++it;
      } else if ((it->op == op || it->op == FaultOp::kAny) && --it->remaining == 0) {
        if (err == 0) err = it->err;
        it = fail_rules_.erase(it);
      } else {
        ++it;
      }
    }
    if (err != 0) ++counters_.failed_ops;
    return err;
  }

  // Counts this write against every torn-write rule; returns the prefix of
  // the first that fires.
  std::optional<uint64_t> TakeTornWrite() KVTIER_REQUIRES(mu_) {
    std::optional<uint64_t> keep;
    for (auto it = torn_rules_.begin(); it != torn_rules_.end();) {
      if (--it->remaining == 0) {
        if (!keep) keep = it->keep_bytes;
        it = torn_rules_.erase(it);
      } else {
        ++it;
      }
    }
    return keep;
  }

  bool Acceptable(uint64_t offset, std::span<const uint8_t> buffer) const {
    const uint64_t align = inner_->alignment();
    const uint64_t size = inner_->size_bytes();
    return offset % align == 0 && buffer.size() % align == 0 &&
           reinterpret_cast<uintptr_t>(buffer.data()) % align == 0 && buffer.size() <= size &&
           offset <= size - buffer.size();
  }

  void Fail(int err, const std::string& what, Done done) {
    Status status = Status::FromErrno(err, name_ + ": injected failure of " + what);
    executor_.Post([status = std::move(status), done = std::move(done)] { done(Err(status)); });
  }

  BlockDevice* const inner_;
  const std::string name_;
  mutable Mutex mu_;
  std::vector<FailRule> fail_rules_ KVTIER_GUARDED_BY(mu_);
  std::vector<TornRule> torn_rules_ KVTIER_GUARDED_BY(mu_);
  std::set<std::pair<uint64_t, uint8_t>> flips_ KVTIER_GUARDED_BY(mu_);
  bool hold_writes_ KVTIER_GUARDED_BY(mu_) = false;
  std::vector<HeldWrite> held_ KVTIER_GUARDED_BY(mu_);
  Counters counters_ KVTIER_GUARDED_BY(mu_);
  // Last: destroyed first, completing queued injected failures while the
  // members above still exist.
  SerialExecutor executor_;
};

}  // namespace kvtier
