// BlockDevice: the seam between the disk tier and storage. Asynchronous
// positioned reads and writes of whole aligned buffers, and a durability
// barrier. Implementations:
//   FileDevice (file_device.h):   a preallocated segment file, O_DIRECT, over
//                                 io_uring or a preadv/pwritev thread pool;
//   MemoryDevice (tests):         bytes in memory;
//   FaultyDevice (tests):         wraps another device and injects EIO,
//                                 ENOSPC, short or torn writes, bit flips.
//
// Contract: `done` runs exactly once, on a device thread (never inside the
// call), with the number of bytes transferred — always the full length on
// success: implementations retry short I/O, EINTR and EAGAIN themselves — or
// the error, with errno kept in the Status. The buffer must stay valid and
// untouched until `done` runs. REQUIRES for Read/Write: offset, buffer address
// and length are multiples of alignment(), and offset + length <= size_bytes().
//
// Implementations are thread-safe.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>

#include "common/status.h"

namespace kvtier {

class BlockDevice {
 public:
  using Done = std::function<void(Result<uint64_t>)>;

  virtual ~BlockDevice() = default;

  virtual uint64_t size_bytes() const = 0;
  virtual uint32_t alignment() const = 0;
  // For logs and errors: the file path, "memory", ...
  virtual const std::string& name() const = 0;

  virtual void Read(uint64_t offset, std::span<uint8_t> buffer, Done done) = 0;
  // Writes are not durable until a Sync issued after their `done` completes.
  virtual void Write(uint64_t offset, std::span<const uint8_t> buffer, Done done) = 0;
  // fdatasync: every write completed before this call is durable when `done`
  // reports success.
  virtual void Sync(Done done) = 0;
};

}  // namespace kvtier
