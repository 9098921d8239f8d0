// LoopFileSystem: a small ext4 file system in an image file, on a loop
// device, mounted for one test; unmounted and detached by its destructor,
// also when the test fails. Needs root, /dev/loop-control and mkfs.ext4
// (e2fsprogs, tools/setup-deps.sh); Mount says why not otherwise, for a
// GTEST_SKIP.
//
// Thread-compatible; for tests only.
#pragma once

#include <fcntl.h>
#include <linux/loop.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>

#include "common/status.h"
#include "common/unique_fd.h"

namespace kvtier::testing {

class LoopFileSystem {
 public:
  // Makes an ext4 image of `size_bytes` at dir/fs.img and mounts it at
  // dir/fs. Errors (kUnavailable) say what is missing.
  static Result<std::unique_ptr<LoopFileSystem>> Mount(const std::string& dir,
                                                       uint64_t size_bytes) {
    if (::geteuid() != 0) return Err(Status(StatusCode::kUnavailable, "a loop mount needs root"));
    std::string mkfs;
    for (const char* p : {"/usr/sbin/mkfs.ext4", "/sbin/mkfs.ext4"}) {
      if (::access(p, X_OK) == 0) mkfs = p;
    }
    if (mkfs.empty()) {
      return Err(Status(StatusCode::kUnavailable,
                        "no mkfs.ext4 (package e2fsprogs, tools/setup-deps.sh)"));
    }
    std::unique_ptr<LoopFileSystem> fs(new LoopFileSystem());
    fs->image_ = dir + "/fs.img";
    fs->mount_point_ = dir + "/fs";
    {
      UniqueFd img(::open(fs->image_.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600));
      if (!img || ::ftruncate(img.get(), static_cast<off_t>(size_bytes)) != 0) {
        return Err(Status::FromErrno(errno, "creating " + fs->image_));
      }
    }
    const std::string cmd = mkfs + " -q -F -E nodiscard " + fs->image_ + " 2>&1";
    std::string out;
    FILE* p = ::popen(cmd.c_str(), "r");
    if (p == nullptr) return Err(Status::FromErrno(errno, "popen " + cmd));
    std::array<char, 512> buf{};
    for (size_t n; (n = std::fread(buf.data(), 1, buf.size(), p)) > 0;) out.append(buf.data(), n);
    if (::pclose(p) != 0) return Err(Status(StatusCode::kUnavailable, cmd + " failed: " + out));

    UniqueFd control(::open("/dev/loop-control", O_RDWR | O_CLOEXEC));
    if (!control) {
      return Err(Status(StatusCode::kUnavailable,
                        std::string("no /dev/loop-control: ") + std::strerror(errno)));
    }
    UniqueFd img(::open(fs->image_.c_str(), O_RDWR | O_CLOEXEC));
    if (!img) return Err(Status::FromErrno(errno, "open " + fs->image_));
    // Another process may take the free device first: try again.
    for (int attempt = 0; attempt < 20 && !fs->loop_; ++attempt) {
      const int n = ::ioctl(control.get(), LOOP_CTL_GET_FREE);
      if (n < 0) {
        return Err(Status(StatusCode::kUnavailable,
                          std::string("LOOP_CTL_GET_FREE: ") + std::strerror(errno)));
      }
      const std::string dev = "/dev/loop" + std::to_string(n);
      UniqueFd loop(::open(dev.c_str(), O_RDWR | O_CLOEXEC));
      if (!loop) continue;
      if (::ioctl(loop.get(), LOOP_SET_FD, img.get()) != 0) {
        if (errno == EBUSY) continue;
        return Err(
            Status(StatusCode::kUnavailable, "LOOP_SET_FD " + dev + ": " + std::strerror(errno)));
      }
      // Detached by the kernel once unmounted and closed, even after a lazy unmount.
      loop_info64 info{};
      info.lo_flags = LO_FLAGS_AUTOCLEAR;
      ::ioctl(loop.get(), LOOP_SET_STATUS64, &info);
      fs->loop_ = std::move(loop);
      fs->device_ = dev;
    }
    if (!fs->loop_) return Err(Status(StatusCode::kUnavailable, "no free loop device"));
    std::filesystem::create_directories(fs->mount_point_);
    if (::mount(fs->device_.c_str(), fs->mount_point_.c_str(), "ext4", 0, nullptr) != 0) {
      return Err(
          Status(StatusCode::kUnavailable, "mount " + fs->device_ + ": " + std::strerror(errno)));
    }
    fs->mounted_ = true;
    return fs;
  }

  ~LoopFileSystem() {
    if (mounted_ && ::umount2(mount_point_.c_str(), 0) != 0) {
      // Something still uses it (a daemon the test failed to stop): detach
      // lazily, so the loop device goes once it is let go.
      ::umount2(mount_point_.c_str(), MNT_DETACH);
    }
    if (loop_) ::ioctl(loop_.get(), LOOP_CLR_FD, 0);
  }
  LoopFileSystem(const LoopFileSystem&) = delete;
  LoopFileSystem& operator=(const LoopFileSystem&) = delete;

  const std::string& mount_point() const { return mount_point_; }

  // statvfs: f_bavail and f_blocks in bytes.
  uint64_t AvailableBytes() const { return Stat().f_bavail * Stat().f_frsize; }
  uint64_t SizeBytes() const { return Stat().f_blocks * Stat().f_frsize; }

 private:
  LoopFileSystem() = default;
  struct statvfs Stat() const {
    struct statvfs vfs {};
    ::statvfs(mount_point_.c_str(), &vfs);
    return vfs;
  }

  std::string image_;
  std::string mount_point_;
  std::string device_;
  UniqueFd loop_;
  bool mounted_ = false;
};

}  // namespace kvtier::testing
