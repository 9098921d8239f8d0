// The disk tier's free-space check (free_space.h), and FileDevice::Open on a
// file system too small for the segment asked for.
#include "tiers/disk/free_space.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <string>

#include "tests/tiers/disk/io_test_util.h"
#include "tiers/disk/file_device.h"

namespace kvtier {
namespace {

constexpr uint64_t kMiB = 1ull << 20;
constexpr uint64_t kGiB = 1ull << 30;

TEST(FreeSpaceTest, TheReserveIsAThirtySecondCappedAtOneGiB) {
  EXPECT_EQ(PreallocationReserveBytes(256 * kMiB), 8 * kMiB);
  EXPECT_EQ(PreallocationReserveBytes(32 * kGiB), 1 * kGiB);
  EXPECT_EQ(PreallocationReserveBytes(4096 * kGiB), 1 * kGiB);
}

TEST(FreeSpaceTest, ATierThatLeavesTheReserveFits) {
  const FileSystemSpace fs{.size_bytes = 256 * kMiB, .available_bytes = 200 * kMiB};
  // 8 MiB reserve: up to 192 MiB fits, one byte more does not.
  EXPECT_TRUE(CheckRoomToPreallocate("/x/seg", 192 * kMiB, 0, fs).ok());
  const Status st = CheckRoomToPreallocate("/x/seg", 192 * kMiB + 4096, 0, fs);
  EXPECT_EQ(st.code(), StatusCode::kResourceExhausted) << st;
  EXPECT_EQ(st.raw_code(), ENOSPC);
}

TEST(FreeSpaceTest, TheRefusalNamesPathSizeAndFreeSpace) {
  const FileSystemSpace fs{.size_bytes = 256 * kMiB, .available_bytes = 200 * kMiB};
  const Status st = CheckRoomToPreallocate("/mnt/small/segment-0.kvt", kGiB, 0, fs);
  ASSERT_EQ(st.code(), StatusCode::kResourceExhausted) << st;
  const std::string& m = st.message();
  EXPECT_NE(m.find("/mnt/small/segment-0.kvt"), std::string::npos) << m;
  EXPECT_NE(m.find("cannot preallocate 1073741824 bytes (1.0 GiB)"), std::string::npos) << m;
  EXPECT_NE(m.find("209715200 bytes (200.0 MiB) available"), std::string::npos) << m;
  EXPECT_NE(m.find("leaves at least 8388608 bytes"), std::string::npos) << m;
  // More than the whole file system, and no underflow either way.
  EXPECT_FALSE(CheckRoomToPreallocate("/x", 300 * kMiB, 0, fs).ok());
  EXPECT_FALSE(
      CheckRoomToPreallocate("/x", 64 * kMiB, 0, {.size_bytes = 256 * kMiB, .available_bytes = 0})
          .ok());
}

TEST(FreeSpaceTest, WhatTheFileHoldsAlreadyCounts) {
  // A full file system: a restart of a tier whose file is already
  // preallocated (or nearly) needs nothing more.
  const FileSystemSpace full{.size_bytes = 256 * kMiB, .available_bytes = 0};
  EXPECT_TRUE(CheckRoomToPreallocate("/x", 64 * kMiB, 64 * kMiB, full).ok());
  EXPECT_TRUE(CheckRoomToPreallocate("/x", 64 * kMiB, 100 * kMiB, full).ok());
  // A tier grown from 64 to 128 MiB needs 64 MiB more plus the reserve.
  EXPECT_TRUE(CheckRoomToPreallocate("/x", 128 * kMiB, 64 * kMiB,
                                     {.size_bytes = 256 * kMiB, .available_bytes = 72 * kMiB})
                  .ok());
  const Status st = CheckRoomToPreallocate(
      "/x", 128 * kMiB, 64 * kMiB, {.size_bytes = 256 * kMiB, .available_bytes = 71 * kMiB});
  EXPECT_EQ(st.code(), StatusCode::kResourceExhausted);
  EXPECT_NE(st.message().find("it holds 67108864 bytes (64.0 MiB) already"), std::string::npos)
      << st;
}

TEST(FreeSpaceTest, FileSystemSpaceOfReadsStatvfs) {
  disk_io_test::TempDir dir;
  ASSERT_TRUE(dir.ok());
  UniqueFd fd(::open(dir.path().c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  ASSERT_TRUE(fd.valid());
  Result<FileSystemSpace> space = FileSystemSpaceOf(fd.get(), dir.path());
  ASSERT_TRUE(space.has_value()) << space.error();
  struct statvfs vfs {};
  ASSERT_EQ(::statvfs(dir.path().c_str(), &vfs), 0);
  EXPECT_EQ(space->size_bytes, static_cast<uint64_t>(vfs.f_blocks) * vfs.f_frsize);
  EXPECT_GT(space->size_bytes, 0u);
  EXPECT_LE(space->available_bytes, space->size_bytes);
}

// A small tmpfs: FileDevice::Open of a segment larger than it refuses
// before preallocating anything, and leaves no file it created; an existing
// (smaller) segment stays as it was.
class FileDeviceOnASmallFileSystemTest : public testing::Test {
 protected:
  void SetUp() override {
    if (::geteuid() != 0) GTEST_SKIP() << "mounting a small tmpfs needs root";
    ASSERT_TRUE(dir_.ok());
    mnt_ = dir_.File("fs");
    std::filesystem::create_directories(mnt_);
    if (::mount("tmpfs", mnt_.c_str(), "tmpfs", 0, "size=16m") != 0) {
      GTEST_SKIP() << "cannot mount a tmpfs here: " << std::strerror(errno);
    }
    mounted_ = true;
    Result<std::unique_ptr<IoEngine>> engine =
        IoEngine::Create({.kind = IoEngineKind::kThreadPool});
    ASSERT_TRUE(engine.has_value()) << engine.error();
    engine_ = std::move(*engine);
  }
  void TearDown() override {
    if (mounted_) ::umount2(mnt_.c_str(), MNT_DETACH);
  }
  uint64_t Available() const {
    struct statvfs vfs {};
    EXPECT_EQ(::statvfs(mnt_.c_str(), &vfs), 0);
    return static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize;
  }
  Result<std::unique_ptr<FileDevice>> Open(uint64_t size_bytes) {
    return FileDevice::Open(
        {.path = segment(), .size_bytes = size_bytes, .direct_io = false, .engine = engine_.get()});
  }
  std::string segment() const { return mnt_ + "/segment-0.kvt"; }

  disk_io_test::TempDir dir_;  // outlives the mount in it
  std::string mnt_;
  bool mounted_ = false;
  std::unique_ptr<IoEngine> engine_;
};

TEST_F(FileDeviceOnASmallFileSystemTest, ATooLargeSegmentIsRefusedAndLeavesNothing) {
  const uint64_t before = Available();
  Result<std::unique_ptr<FileDevice>> device = Open(64 * kMiB);
  ASSERT_FALSE(device.has_value());
  EXPECT_EQ(device.error().code(), StatusCode::kResourceExhausted) << device.error();
  EXPECT_NE(device.error().message().find(segment()), std::string::npos) << device.error();
  EXPECT_NE(device.error().message().find("available"), std::string::npos) << device.error();
  EXPECT_FALSE(std::filesystem::exists(segment()));
  EXPECT_EQ(Available(), before);
  // What fits with the reserve (16 MiB / 32 = 512 KiB) opens.
  device = Open(8 * kMiB);
  ASSERT_TRUE(device.has_value()) << device.error();
  EXPECT_TRUE((*device)->created());
}

TEST_F(FileDeviceOnASmallFileSystemTest, AnExistingSegmentIsKeptAndCounted) {
  {
    Result<std::unique_ptr<FileDevice>> device = Open(8 * kMiB);
    ASSERT_TRUE(device.has_value()) << device.error();
  }
  // Growing it past the file system is refused; the file stays as it was.
  Result<std::unique_ptr<FileDevice>> grown = Open(64 * kMiB);
  ASSERT_FALSE(grown.has_value());
  EXPECT_EQ(grown.error().code(), StatusCode::kResourceExhausted) << grown.error();
  struct stat st {};
  ASSERT_EQ(::stat(segment().c_str(), &st), 0);
  EXPECT_EQ(static_cast<uint64_t>(st.st_size), 8 * kMiB);
  // Growing it by what the file system still has counts its 8 MiB: 12 MiB
  // needs 4 more, which fits, though 12 MiB would not fit anew.
  ASSERT_LT(Available(), 12 * kMiB);
  Result<std::unique_ptr<FileDevice>> reopened = Open(12 * kMiB);
  ASSERT_TRUE(reopened.has_value()) << reopened.error();
  EXPECT_FALSE((*reopened)->created());
}

}  // namespace
}  // namespace kvtier
