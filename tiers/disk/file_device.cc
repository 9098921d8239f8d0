#include "tiers/disk/file_device.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <string>
#include <thread>
#include <utility>

#include "tiers/disk/free_space.h"

namespace kvtier {
namespace {

// fsyncs the directory holding `path`, so a newly created file's entry
// survives a crash.
Status SyncParentDirectory(const std::string& path) {
  const size_t slash = path.rfind('/');
  const std::string dir = slash == std::string::npos ? "."
                          : slash == 0               ? "/"
                                                     : path.substr(0, slash);
  UniqueFd fd(open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!fd) return Status::FromErrno(errno, "open directory " + dir);
  if (fsync(fd.get()) != 0) return Status::FromErrno(errno, "fsync directory " + dir);
  return Status::Ok();
}

}  // namespace

Result<std::unique_ptr<FileDevice>> FileDevice::Open(const Options& options) {
  if (options.path.empty()) return Err(InvalidArgument("FileDevice: path is empty"));
  if (options.engine == nullptr) return Err(InvalidArgument("FileDevice: no I/O engine"));
  if (options.size_bytes == 0 || options.size_bytes % kAlignment != 0) {
    return Err(InvalidArgument("FileDevice " + options.path + ": size_bytes " +
                               std::to_string(options.size_bytes) +
                               " must be a positive multiple of " + std::to_string(kAlignment)));
  }
  const std::string& path = options.path;

  // Created (not opened) here, so that its directory entry is synced below.
  // A file this call created goes again if it fails; an existing one (a
  // warm disk tier) is never removed.
  struct RemoveCreatedOnFailure {
    const std::string& path;
    bool armed = false;
    ~RemoveCreatedOnFailure() {
      if (armed) ::unlink(path.c_str());
    }
  } created{path};
  UniqueFd fd(open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600));
  if (fd) {
    created.armed = true;
  } else if (errno != EEXIST) {
    return Err(Status::FromErrno(errno, "create " + path));
  }
  // Reopened with the final flags: O_DIRECT is refused at open time by file
  // systems without it, which is worth a message of its own.
  const int flags = O_RDWR | O_CLOEXEC | (options.direct_io ? O_DIRECT : 0);
  fd = UniqueFd(open(path.c_str(), flags));
  if (!fd) {
    const int err = errno;
    if (err == EINVAL && options.direct_io) {
      return Err(Status(StatusCode::kFailedPrecondition,
                        path + ": the file system does not support O_DIRECT; set "
                               "tiers.disk.direct_io=false",
                        ErrorSource::kErrno, err));
    }
    return Err(Status::FromErrno(err, "open " + path));
  }

  // Two daemons appending to one segment would overwrite each other's
  // records: the lock (released with the descriptor, also on a crash) keeps
  // a second one out.
  // A daemon that was just killed can hold the lock a little longer: the
  // kernel tears its io_uring down (and drops its file references)
  // asynchronously. So wait a few seconds before calling it in use.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  int locked = -1;
  while ((locked = flock(fd.get(), LOCK_EX | LOCK_NB)) != 0 && errno == EWOULDBLOCK &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (locked != 0) {
    const int err = errno;
    if (err == EWOULDBLOCK) {
      return Err(Status(StatusCode::kFailedPrecondition,
                        path + " is in use by another kvtierd (tiers.disk.paths must differ)",
                        ErrorSource::kErrno, err));
    }
    return Err(Status::FromErrno(err, "flock " + path));
  }

  struct stat st {};
  if (fstat(fd.get(), &st) != 0) return Err(Status::FromErrno(errno, "fstat " + path));
  if (!S_ISREG(st.st_mode)) return Err(InvalidArgument(path + " is not a regular file"));
  if (static_cast<uint64_t>(st.st_size) < options.size_bytes) {
    // What the file holds already counts (a tier grown across a restart).
    KVTIER_ASSIGN_OR_RETURN(const FileSystemSpace space, FileSystemSpaceOf(fd.get(), path));
    KVTIER_RETURN_IF_ERROR(CheckRoomToPreallocate(
        path, options.size_bytes, static_cast<uint64_t>(st.st_blocks) * 512, space));
    // Mode 0 allocates the blocks and extends the size: later writes cannot
    // fail with ENOSPC, and the segment's extents stay contiguous.
    int ret;
    do {
      ret = fallocate(fd.get(), 0, 0, static_cast<off_t>(options.size_bytes));
    } while (ret != 0 && errno == EINTR);
    if (ret != 0) {
      const int err = errno;
      return Err(Status::FromErrno(
          err, "fallocate " + path + " to " + std::to_string(options.size_bytes) + " bytes" +
                   (err == EOPNOTSUPP ? " (the file system cannot preallocate)" : "")));
    }
    // The new size is metadata a later fdatasync might not cover.
    if (fsync(fd.get()) != 0) return Err(Status::FromErrno(errno, "fsync " + path));
  }
  if (created.armed) KVTIER_RETURN_IF_ERROR(SyncParentDirectory(path));

  std::unique_ptr<FileDevice> device(
      new FileDevice(path, std::move(fd), options.size_bytes, options.engine));
  device->created_ = std::exchange(created.armed, false);
  return device;
}

FileDevice::~FileDevice() {
  // The engine borrows fd_ until each request's done returned.
  MutexLock lock(&mu_);
  while (in_flight_ > 0) idle_cv_.Wait(&mu_);
}

Status FileDevice::Check(const char* what, uint64_t offset, const uint8_t* buffer,
                         uint64_t length) const {
  const auto address = reinterpret_cast<uintptr_t>(buffer);
  // kInvalidArgument with EINVAL, as O_DIRECT pread/pwrite and the test
  // MemoryDevice report these, so callers see one error for both devices.
  if (offset % kAlignment != 0 || length % kAlignment != 0 || address % kAlignment != 0) {
    return Status::FromErrno(EINVAL, std::string(what) + " " + path_ + ": offset " +
                                         std::to_string(offset) + ", length " +
                                         std::to_string(length) + " and buffer address " +
                                         std::to_string(address) + " must be multiples of " +
                                         std::to_string(kAlignment));
  }
  if (offset > size_bytes_ || length > size_bytes_ - offset) {
    return Status::FromErrno(EINVAL, std::string(what) + " " + path_ + ": [" +
                                         std::to_string(offset) + ", +" + std::to_string(length) +
                                         ") is past the device's " + std::to_string(size_bytes_) +
                                         " bytes");
  }
  return Status::Ok();
}

void FileDevice::Read(uint64_t offset, std::span<uint8_t> buffer, Done done) {
  Status status = Check("read", offset, buffer.data(), buffer.size());
  if (!status.ok()) return Fail(std::move(status), std::move(done));
  Submit(IoRequest{.op = IoOp::kRead,
                   .fd = fd_.get(),
                   .offset = offset,
                   .buffer = buffer.data(),
                   .length = buffer.size()},
         std::move(done));
}

void FileDevice::Write(uint64_t offset, std::span<const uint8_t> buffer, Done done) {
  Status status = Check("write", offset, buffer.data(), buffer.size());
  if (!status.ok()) return Fail(std::move(status), std::move(done));
  // IoRequest has one buffer pointer for both directions; a write only reads
  // through it.
  Submit(IoRequest{.op = IoOp::kWrite,
                   .fd = fd_.get(),
                   .offset = offset,
                   .buffer = const_cast<uint8_t*>(buffer.data()),
                   .length = buffer.size()},
         std::move(done));
}

void FileDevice::Sync(Done done) {
  Submit(IoRequest{.op = IoOp::kSync, .fd = fd_.get()}, std::move(done));
}

void FileDevice::Fail(Status error, Done done) {
  // A zero-length read completes on an engine thread without a system call:
  // the way to run `done` there rather than inside this call.
  Submit(IoRequest{.op = IoOp::kRead, .fd = fd_.get()},
         [error = std::move(error), done = std::move(done)](Result<uint64_t>) {
           if (done) done(Err(error));
         });
}

void FileDevice::Submit(IoRequest request, Done done) {
  {
    MutexLock lock(&mu_);
    ++in_flight_;
  }
  request.done = [this, done = std::move(done)](Result<uint64_t> result) {
    if (done) done(std::move(result));
    MutexLock lock(&mu_);
    // The destructor may run as soon as the lock is released: touch nothing
    // of `this` after it.
    if (--in_flight_ == 0) idle_cv_.SignalAll();
  };
  engine_->Submit(std::move(request));
}

}  // namespace kvtier
