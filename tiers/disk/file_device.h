// FileDevice: a BlockDevice over one preallocated segment file, read and
// written through an IoEngine (io_uring or the thread pool), with O_DIRECT
// when asked, so the disk tier's pages bypass the page cache.
//
// Owns the file descriptor; borrows the engine, which must outlive it.
// alignment() is 4096 with and without O_DIRECT, so callers have one code
// path. Errors from argument checks (alignment, bounds) are delivered like
// I/O errors: through `done`, on an engine thread, never inside the call.
//
// Thread-safe. Destruction waits until the `done` of every request it
// accepted has returned; REQUIRES: not destroyed from one of its own `done`
// callbacks (that would wait for itself).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "common/mutex.h"
#include "common/status.h"
#include "common/unique_fd.h"
#include "tiers/disk/block_device.h"
#include "tiers/disk/io_engine.h"

namespace kvtier {

class FileDevice final : public BlockDevice {
 public:
  static constexpr uint32_t kAlignment = 4096;

  struct Options {
    std::string path;            // REQUIRED; its directory must exist
    uint64_t size_bytes = 0;     // REQUIRED: > 0, a multiple of kAlignment
    bool direct_io = true;       // O_DIRECT (config: tiers.disk.direct_io)
    IoEngine* engine = nullptr;  // REQUIRED; borrowed, must outlive the device
  };

  // Opens `path`, creating it (mode 0600) if missing, and preallocates
  // size_bytes with fallocate unless the file is already at least that large
  // (a larger file is kept as is; only its first size_bytes are used). A new
  // file's size and directory entry are made durable before returning.
  // Before preallocating it checks the file system's free space
  // (free_space.h): it never fills the file system. A failed Open removes
  // the file if it created it, never an existing one.
  // Errors: kInvalidArgument for bad options or a path that is not a regular
  // file; kFailedPrecondition when the file system refuses O_DIRECT (the
  // message says to set tiers.disk.direct_io=false); kResourceExhausted
  // (ENOSPC) when the preallocation would not leave the reserve free (the
  // message has the path, the size and the free space); the errno of open,
  // fallocate (EOPNOTSUPP where the file system cannot preallocate, ENOSPC)
  // or fsync otherwise.
  static Result<std::unique_ptr<FileDevice>> Open(const Options& options);

  ~FileDevice() override;
  FileDevice(const FileDevice&) = delete;
  FileDevice& operator=(const FileDevice&) = delete;

  uint64_t size_bytes() const override { return size_bytes_; }
  uint32_t alignment() const override { return kAlignment; }
  const std::string& name() const override { return path_; }
  // Whether Open created the file (so a start-up that fails later may remove it).
  bool created() const { return created_; }

  // Argument errors, through `done`: kInvalidArgument (errno EINVAL) for an
  // offset, length or buffer address that is not a multiple of alignment(),
  // or offset + length > size_bytes(). A zero-length read or write is an
  // empty success.
  void Read(uint64_t offset, std::span<uint8_t> buffer, Done done) override;
  void Write(uint64_t offset, std::span<const uint8_t> buffer, Done done) override;
  void Sync(Done done) override;

 private:
  FileDevice(std::string path, UniqueFd fd, uint64_t size_bytes, IoEngine* engine)
      : path_(std::move(path)), fd_(std::move(fd)), size_bytes_(size_bytes), engine_(engine) {}

  // OK, or why [offset, offset + length) at `buffer` cannot be transferred.
  Status Check(const char* what, uint64_t offset, const uint8_t* buffer, uint64_t length) const;
  // Submits `request`, counting it in flight until its done returned.
  void Submit(IoRequest request, Done done);
  // Delivers `error` to `done` on an engine thread, as the contract wants.
  void Fail(Status error, Done done);

  const std::string path_;
  const UniqueFd fd_;
  const uint64_t size_bytes_;
  IoEngine* const engine_;
  bool created_ = false;  // set once by Open

  Mutex mu_;
  CondVar idle_cv_;  // signalled when in_flight_ drops to 0
  uint64_t in_flight_ KVTIER_GUARDED_BY(mu_) = 0;
};

}  // namespace kvtier
