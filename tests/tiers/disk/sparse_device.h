// SparseDevice: a BlockDevice of any size (tens of TiB) that keeps only the
// pages written to it, in a map, for tests of the disk tier's addressing far
// into a large device (the "memory block device" seam in STYLE.md). Pages
// never written read as zeros.
//
// Like MemoryDevice it keeps BlockDevice's contract: every Read, Write and
// Sync completes on the device's own thread, in FIFO order, never inside the
// call; misaligned or out-of-bounds requests fail in `done` with
// kInvalidArgument (errno EINVAL kept). It models no power loss: every
// completed write counts as durable.
//
// Thread-safe. Destruction completes everything queued first.
#pragma once

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <map>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "common/check.h"
#include "common/mutex.h"
#include "common/serial_executor.h"
#include "tiers/disk/block_device.h"

namespace kvtier {

class SparseDevice : public BlockDevice {
 public:
  static constexpr uint32_t kPageBytes = 4096;

  // REQUIRES: size_bytes is a multiple of 4 KiB.
  explicit SparseDevice(uint64_t size_bytes, std::string name = "sparse")
      : size_bytes_(size_bytes), name_(std::move(name)) {
    KVTIER_CHECK(size_bytes_ % kPageBytes == 0);
  }

  uint64_t size_bytes() const override { return size_bytes_; }
  uint32_t alignment() const override { return kPageBytes; }
  const std::string& name() const override { return name_; }

  void Read(uint64_t offset, std::span<uint8_t> buffer, Done done) override {
    executor_.Post(
        [this, offset, buffer, done = std::move(done)] { done(DoRead(offset, buffer)); });
  }
  void Write(uint64_t offset, std::span<const uint8_t> buffer, Done done) override {
    executor_.Post(
        [this, offset, buffer, done = std::move(done)] { done(DoWrite(offset, buffer)); });
  }
  void Sync(Done done) override {
    executor_.Post([done = std::move(done)] { done(uint64_t{0}); });
  }

  // Offsets of the pages written so far, ascending.
  std::vector<uint64_t> WrittenPageOffsets() const {
    MutexLock lock(&mu_);
    std::vector<uint64_t> out;
    out.reserve(pages_.size());
    for (const auto& [page, bytes] : pages_) out.push_back(page * kPageBytes);
    return out;
  }

 private:
  using Page = std::array<uint8_t, kPageBytes>;

  Status Validate(const char* op, uint64_t offset, const void* address, uint64_t length) const {
    const bool aligned = offset % kPageBytes == 0 && length % kPageBytes == 0 &&
                         reinterpret_cast<uintptr_t>(address) % kPageBytes == 0;
    // Written so that offset + length cannot overflow.
    const bool in_bounds = length <= size_bytes_ && offset <= size_bytes_ - length;
    if (aligned && in_bounds) return Status::Ok();
    return Status::FromErrno(EINVAL, name_ + ": " + op + " at offset " + std::to_string(offset) +
                                         " of " + std::to_string(length) + " bytes " +
                                         (aligned ? "ends past the device" : "is not aligned"));
  }

  Result<uint64_t> DoRead(uint64_t offset, std::span<uint8_t> buffer) {
    KVTIER_RETURN_IF_ERROR(Validate("read", offset, buffer.data(), buffer.size()));
    MutexLock lock(&mu_);
    for (uint64_t at = 0; at < buffer.size(); at += kPageBytes) {
      auto it = pages_.find((offset + at) / kPageBytes);
      if (it == pages_.end()) {
        std::memset(buffer.data() + at, 0, kPageBytes);
      } else {
        std::memcpy(buffer.data() + at, it->second.data(), kPageBytes);
      }
    }
    return buffer.size();
  }

  Result<uint64_t> DoWrite(uint64_t offset, std::span<const uint8_t> buffer) {
    KVTIER_RETURN_IF_ERROR(Validate("write", offset, buffer.data(), buffer.size()));
    MutexLock lock(&mu_);
    for (uint64_t at = 0; at < buffer.size(); at += kPageBytes) {
      std::memcpy(pages_[(offset + at) / kPageBytes].data(), buffer.data() + at, kPageBytes);
    }
    return buffer.size();
  }

  const uint64_t size_bytes_;
  const std::string name_;
  mutable Mutex mu_;
  std::map<uint64_t, Page> pages_ KVTIER_GUARDED_BY(mu_);  // page number -> bytes
  // Last: destroyed first, so queued operations complete while the members
  // above still exist.
  SerialExecutor executor_;
};

}  // namespace kvtier
