// SmallVolume: a tmpfs of a chosen size mounted for a test, as the disk
// index's volume, so that the test can fill it to the last byte (RocksDB's
// writes then fail with ENOSPC) and free it again. Mounting needs root: a
// test skips, with the reason, where it cannot mount. Unmounted (lazily)
// when destroyed. For tests only; thread-compatible.
#pragma once

#include <gtest/gtest.h>
#include <sys/mount.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <system_error>
#include <vector>

namespace kvtier::tiers_test {

class SmallVolume {
 public:
  // A tmpfs of `size` (mount's notation: "6m") at `dir`, created; null with
  // `*why` set when this machine cannot mount one.
  static std::unique_ptr<SmallVolume> Mount(const std::string& dir, const std::string& size, std::string* why) {
    if (::geteuid() != 0) {
      *why = "mounting a small tmpfs for the index needs root";
      return nullptr;
    }
    std::filesystem::create_directories(dir);
    if (::mount("tmpfs", dir.c_str(), "tmpfs", 0, ("size=" + size).c_str()) != 0) {
      *why = std::string("cannot mount a tmpfs here: ") + std::strerror(errno);
      return nullptr;
    }
    return std::unique_ptr<SmallVolume>(new SmallVolume(dir));
  }
  ~SmallVolume() { ::umount2(dir_.c_str(), MNT_DETACH); }
  SmallVolume(const SmallVolume&) = delete;
  SmallVolume& operator=(const SmallVolume&) = delete;

  const std::string& path() const { return dir_; }

  // Fills the volume with a file of its own but for `room` bytes (0: to the
  // last byte).
  void Fill(uint64_t room = 0) {
    std::FILE* f = std::fopen(filler().c_str(), "w");
    ASSERT_NE(f, nullptr) << std::strerror(errno);
    std::vector<char> chunk(64 << 10, 'x');
    while (std::fwrite(chunk.data(), 1, chunk.size(), f) == chunk.size()) {
    }
    std::fclose(f);
    if (room == 0) return;
    std::error_code ec;
    std::filesystem::resize_file(filler(), std::filesystem::file_size(filler()) - room, ec);
    ASSERT_FALSE(ec) << ec.message();
  }
  // Removes what Fill wrote: the volume has room again.
  void Free() { std::filesystem::remove(filler()); }

 private:
  explicit SmallVolume(std::string dir) : dir_(std::move(dir)) {}
  std::string filler() const { return dir_ + "/filler"; }

  std::string dir_;
};

}  // namespace kvtier::tiers_test
