// MemoryDevice: a BlockDevice whose bytes live in a std::vector, for unit
// tests of the disk tier (the "memory block device" seam in STYLE.md).
//
// It keeps BlockDevice's contract as a real device does: every Read, Write and
// Sync completes on the device's own thread, in FIFO order, never inside the
// call; misaligned or out-of-bounds requests fail in `done` with
// kInvalidArgument (errno EINVAL kept), like an O_DIRECT pread/pwrite.
//
// Durability is modelled: the device keeps the image as of the last completed
// Sync, and DropUnsynced() rolls the live image back to it — a power loss.
// Bytes changed through raw() are not tracked as writes: they model on-media
// state (corruption a test plants), and DropUnsynced() only reverts blocks
// written through Write().
//
// Thread-safe, except raw(), whose bytes the caller may touch only while no
// operation is in flight (see WaitIdle()). Destruction completes everything
// queued first.
#pragma once

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <set>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common/check.h"
#include "common/mutex.h"
#include "common/serial_executor.h"
#include "tiers/disk/block_device.h"

namespace kvtier {

class MemoryDevice : public BlockDevice {
 public:
  // A zero-filled device. REQUIRES: alignment is a power of two and
  // size_bytes a multiple of it.
  explicit MemoryDevice(uint64_t size_bytes, uint32_t alignment = 4096, std::string name = "memory")
      : size_bytes_(size_bytes),
        alignment_(alignment),
        name_(std::move(name)),
        image_(size_bytes),
        synced_(size_bytes) {
    KVTIER_CHECK(alignment_ > 0 && (alignment_ & (alignment_ - 1)) == 0);
    KVTIER_CHECK(size_bytes_ % alignment_ == 0);
  }

  uint64_t size_bytes() const override { return size_bytes_; }
  uint32_t alignment() const override { return alignment_; }
  const std::string& name() const override { return name_; }

  void Read(uint64_t offset, std::span<uint8_t> buffer, Done done) override {
    executor_.Post(
        [this, offset, buffer, done = std::move(done)] { done(DoRead(offset, buffer)); });
  }
  void Write(uint64_t offset, std::span<const uint8_t> buffer, Done done) override {
    executor_.Post(
        [this, offset, buffer, done = std::move(done)] { done(DoWrite(offset, buffer)); });
  }
  // FIFO completion means every write issued before this Sync has landed by
  // the time it runs — at least what the contract promises.
  void Sync(Done done) override {
    executor_.Post([this, done = std::move(done)] { done(DoSync()); });
  }

  // The live image. REQUIRES: no operation in flight while the bytes are used.
  std::span<uint8_t> raw() { return {image_.data(), image_.size()}; }

  // Power loss: every block written since the last completed Sync returns to
  // its synced content. REQUIRES: no operation in flight (call WaitIdle()
  // first); a write racing with the "crash" has no defined outcome here — use
  // FaultyDevice::TornWriteNth for that.
  void DropUnsynced() {
    MutexLock lock(&mu_);
    for (uint64_t block : dirty_blocks_) {
      const uint64_t at = block * alignment_;
      std::memcpy(image_.data() + at, synced_.data() + at, alignment_);
    }
    dirty_blocks_.clear();
  }

  // Blocks until every operation issued so far has completed and its `done`
  // has returned. REQUIRES: not called from a `done`.
  void WaitIdle() { executor_.WaitIdle(); }

  // The thread `done` runs on.
  std::thread::id io_thread_id() const { return executor_.thread_id(); }

  uint64_t syncs() const {
    MutexLock lock(&mu_);
    return syncs_;
  }

 private:
  Status Validate(const char* op, uint64_t offset, const void* address, uint64_t length) const {
    const bool aligned = offset % alignment_ == 0 && length % alignment_ == 0 &&
                         reinterpret_cast<uintptr_t>(address) % alignment_ == 0;
    // Written so that offset + length cannot overflow.
    const bool in_bounds = length <= size_bytes_ && offset <= size_bytes_ - length;
    if (aligned && in_bounds) return Status::Ok();
    return Status::FromErrno(
        EINVAL, name_ + ": " + op + " at offset " + std::to_string(offset) + " of " +
                    std::to_string(length) + " bytes " +
                    (aligned ? "ends past the device (" + std::to_string(size_bytes_) + " bytes)"
                             : "is not aligned to " + std::to_string(alignment_)));
  }

  Result<uint64_t> DoRead(uint64_t offset, std::span<uint8_t> buffer) {
    KVTIER_RETURN_IF_ERROR(Validate("read", offset, buffer.data(), buffer.size()));
    MutexLock lock(&mu_);
    if (!buffer.empty()) std::memcpy(buffer.data(), image_.data() + offset, buffer.size());
    return buffer.size();
  }

  Result<uint64_t> DoWrite(uint64_t offset, std::span<const uint8_t> buffer) {
    KVTIER_RETURN_IF_ERROR(Validate("write", offset, buffer.data(), buffer.size()));
    MutexLock lock(&mu_);
    if (!buffer.empty()) std::memcpy(image_.data() + offset, buffer.data(), buffer.size());
    for (uint64_t at = offset; at < offset + buffer.size(); at += alignment_) {
      dirty_blocks_.insert(at / alignment_);
    }
    return buffer.size();
  }

  Result<uint64_t> DoSync() {
    MutexLock lock(&mu_);
    for (uint64_t block : dirty_blocks_) {
      const uint64_t at = block * alignment_;
      std::memcpy(synced_.data() + at, image_.data() + at, alignment_);
    }
    dirty_blocks_.clear();
    ++syncs_;
    return uint64_t{0};
  }

  const uint64_t size_bytes_;
  const uint32_t alignment_;
  const std::string name_;
  mutable Mutex mu_;
  // Not GUARDED_BY: raw() hands out the bytes; the lock orders the device
  // thread against DropUnsynced().
  std::vector<uint8_t> image_;
  std::vector<uint8_t> synced_ KVTIER_GUARDED_BY(mu_);
  // Blocks (offset / alignment) whose image_ differs from synced_.
  std::set<uint64_t> dirty_blocks_ KVTIER_GUARDED_BY(mu_);
  uint64_t syncs_ KVTIER_GUARDED_BY(mu_) = 0;
  // Last: destroyed first, so queued operations complete while the members
  // above still exist.
  SerialExecutor executor_;
};

}  // namespace kvtier
