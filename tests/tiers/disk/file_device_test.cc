#include "tiers/disk/file_device.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "common/memory_mapping.h"
#include "tests/tiers/disk/io_test_util.h"

namespace kvtier {
namespace {

using disk_io_test::Completion;
using disk_io_test::FillPattern;
using disk_io_test::FirstMismatch;
using disk_io_test::TempDir;

constexpr uint64_t kBlock = FileDevice::kAlignment;
constexpr uint64_t kDeviceBytes = 4 << 20;

struct DeviceParam {
  IoEngineKind kind;
  bool direct_io;
};

std::string ParamName(const testing::TestParamInfo<DeviceParam>& info) {
  return std::string(info.param.kind == IoEngineKind::kIoUring ? "IoUring" : "ThreadPool") +
         (info.param.direct_io ? "_Direct" : "_Buffered");
}

class FileDeviceTest : public testing::TestWithParam<DeviceParam> {
 protected:
  void SetUp() override {
    ASSERT_TRUE(dir_.ok()) << "mkdtemp failed";
    Result<std::unique_ptr<IoEngine>> engine =
        IoEngine::Create({.kind = GetParam().kind, .threads = 2});
    if (!engine.has_value()) {
      ASSERT_EQ(engine.error().code(), StatusCode::kUnimplemented) << engine.error();
      GTEST_SKIP() << "io_uring unavailable: " << engine.error();
    }
    engine_ = std::move(*engine);
    Result<MemoryMapping> buffer = MemoryMapping::Anonymous(kDeviceBytes);
    ASSERT_TRUE(buffer.has_value()) << buffer.error();
    buffer_ = std::move(*buffer);
  }

  FileDevice::Options Options(uint64_t size_bytes = kDeviceBytes) {
    return {.path = dir_.File("segment-0"),
            .size_bytes = size_bytes,
            .direct_io = GetParam().direct_io,
            .engine = engine_.get()};
  }

  static Result<uint64_t> Read(BlockDevice& device, uint64_t offset, std::span<uint8_t> buffer) {
    Completion completion;
    device.Read(offset, buffer, completion.Callback());
    return completion.Wait();
  }
  static Result<uint64_t> Write(BlockDevice& device, uint64_t offset,
                                std::span<const uint8_t> buffer) {
    Completion completion;
    device.Write(offset, buffer, completion.Callback());
    return completion.Wait();
  }
  static Result<uint64_t> Sync(BlockDevice& device) {
    Completion completion;
    device.Sync(completion.Callback());
    return completion.Wait();
  }

  TempDir dir_;
  std::unique_ptr<IoEngine> engine_;
  MemoryMapping buffer_;
};

TEST_P(FileDeviceTest, CreatesAndPreallocatesTheFile) {
  Result<std::unique_ptr<FileDevice>> device = FileDevice::Open(Options());
  ASSERT_TRUE(device.has_value()) << device.error();
  EXPECT_EQ((*device)->size_bytes(), kDeviceBytes);
  EXPECT_EQ((*device)->alignment(), 4096u);
  EXPECT_EQ((*device)->name(), dir_.File("segment-0"));

  struct stat st {};
  ASSERT_EQ(::stat(dir_.File("segment-0").c_str(), &st), 0);
  EXPECT_EQ(static_cast<uint64_t>(st.st_size), kDeviceBytes);
  // Allocated, not sparse: later writes cannot run out of space.
  EXPECT_GE(static_cast<uint64_t>(st.st_blocks) * 512, kDeviceBytes);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
}

TEST_P(FileDeviceTest, KeepsALargerFileAndGrowsASmallerOne) {
  const std::string path = dir_.File("segment-0");
  {
    UniqueFd fd(::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600));
    ASSERT_TRUE(fd.valid());
    ASSERT_EQ(::ftruncate(fd.get(), 2 * kDeviceBytes), 0);
  }
  {
    Result<std::unique_ptr<FileDevice>> device = FileDevice::Open(Options());
    ASSERT_TRUE(device.has_value()) << device.error();
    EXPECT_EQ((*device)->size_bytes(), kDeviceBytes);  // only the part asked for is used
  }
  struct stat st {};
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_EQ(static_cast<uint64_t>(st.st_size), 2 * kDeviceBytes);

  Result<std::unique_ptr<FileDevice>> bigger = FileDevice::Open(Options(4 * kDeviceBytes));
  ASSERT_TRUE(bigger.has_value()) << bigger.error();
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_EQ(static_cast<uint64_t>(st.st_size), 4 * kDeviceBytes);
  EXPECT_GE(static_cast<uint64_t>(st.st_blocks) * 512, 4 * kDeviceBytes);
}

TEST_P(FileDeviceTest, RejectsBadOptions) {
  FileDevice::Options no_engine = Options();
  no_engine.engine = nullptr;
  FileDevice::Options unaligned = Options(kDeviceBytes + 512);
  for (const FileDevice::Options& options : {no_engine, unaligned, Options(0)}) {
    Result<std::unique_ptr<FileDevice>> device = FileDevice::Open(options);
    ASSERT_FALSE(device.has_value());
    EXPECT_EQ(device.error().code(), StatusCode::kInvalidArgument) << device.error();
  }
  FileDevice::Options missing_dir = Options();
  missing_dir.path = dir_.File("no-such-dir/segment-0");
  Result<std::unique_ptr<FileDevice>> device = FileDevice::Open(missing_dir);
  ASSERT_FALSE(device.has_value());
  EXPECT_EQ(device.error().code(), StatusCode::kNotFound) << device.error();
  EXPECT_EQ(device.error().raw_code(), ENOENT);
}

TEST_P(FileDeviceTest, MisalignedRequestsFailThroughDoneOnAnEngineThread) {
  Result<std::unique_ptr<FileDevice>> opened = FileDevice::Open(Options());
  ASSERT_TRUE(opened.has_value()) << opened.error();
  FileDevice& device = **opened;
  struct Case {
    const char* what;
    uint64_t offset;
    uint64_t buffer_offset;
    uint64_t length;
  };
  for (const Case& c : {Case{"offset", 512, 0, kBlock}, Case{"length", 0, 0, 100},
                        Case{"buffer", 0, 512, kBlock}}) {
    for (bool write : {false, true}) {
      std::promise<std::pair<Result<uint64_t>, std::thread::id>> got;
      auto done = [&](Result<uint64_t> result) {
        got.set_value({std::move(result), std::this_thread::get_id()});
      };
      std::span<uint8_t> span(buffer_.data() + c.buffer_offset, c.length);
      if (write) {
        device.Write(c.offset, span, done);
      } else {
        device.Read(c.offset, span, done);
      }
      auto [result, thread] = got.get_future().get();
      ASSERT_FALSE(result.has_value()) << c.what;
      EXPECT_EQ(result.error().code(), StatusCode::kInvalidArgument) << result.error();
      EXPECT_EQ(result.error().raw_code(), EINVAL);
      EXPECT_NE(result.error().message().find("multiples of 4096"), std::string::npos)
          << result.error();
      EXPECT_NE(thread, std::this_thread::get_id()) << "done ran inside the call";
    }
  }
}

TEST_P(FileDeviceTest, OutOfBoundsRequestsFail) {
  Result<std::unique_ptr<FileDevice>> opened = FileDevice::Open(Options());
  ASSERT_TRUE(opened.has_value()) << opened.error();
  FileDevice& device = **opened;
  std::span<uint8_t> two_blocks(buffer_.data(), 2 * kBlock);
  for (uint64_t offset : {kDeviceBytes - kBlock, kDeviceBytes, uint64_t{1} << 62}) {
    Result<uint64_t> read = Read(device, offset, two_blocks);
    ASSERT_FALSE(read.has_value()) << offset;
    EXPECT_EQ(read.error().code(), StatusCode::kInvalidArgument) << read.error();
    EXPECT_NE(read.error().message().find("past the device"), std::string::npos) << read.error();
    Result<uint64_t> write = Write(device, offset, two_blocks);
    ASSERT_FALSE(write.has_value()) << offset;
    EXPECT_EQ(write.error().code(), StatusCode::kInvalidArgument) << write.error();
  }
  // The last block itself is fine.
  Result<uint64_t> last = Read(device, kDeviceBytes - kBlock, two_blocks.subspan(0, kBlock));
  ASSERT_TRUE(last.has_value()) << last.error();
  EXPECT_EQ(*last, kBlock);
}

TEST_P(FileDeviceTest, DataSurvivesCloseAndReopen) {
  constexpr uint32_t kSeed = 99;
  const uint64_t offsets[] = {0, 5 * kBlock, kDeviceBytes - 3 * kBlock};
  {
    Result<std::unique_ptr<FileDevice>> device = FileDevice::Open(Options());
    ASSERT_TRUE(device.has_value()) << device.error();
    for (uint64_t offset : offsets) {
      std::span<uint8_t> span(buffer_.data() + offset, 3 * kBlock);
      FillPattern(span, offset, kSeed);
      Result<uint64_t> written = Write(**device, offset, span);
      ASSERT_TRUE(written.has_value()) << written.error();
      EXPECT_EQ(*written, 3 * kBlock);
    }
    Result<uint64_t> synced = Sync(**device);
    ASSERT_TRUE(synced.has_value()) << synced.error();
  }
  std::memset(buffer_.data(), 0, kDeviceBytes);
  Result<std::unique_ptr<FileDevice>> device = FileDevice::Open(Options());
  ASSERT_TRUE(device.has_value()) << device.error();
  for (uint64_t offset : offsets) {
    std::span<uint8_t> span(buffer_.data() + offset, 3 * kBlock);
    Result<uint64_t> read = Read(**device, offset, span);
    ASSERT_TRUE(read.has_value()) << read.error();
    EXPECT_EQ(FirstMismatch(span, offset, kSeed), -1) << "at " << offset;
  }
}

TEST_P(FileDeviceTest, DestructionWaitsForRequestsInFlight) {
  Result<std::unique_ptr<FileDevice>> device = FileDevice::Open(Options());
  ASSERT_TRUE(device.has_value()) << device.error();
  std::atomic<int> done{0};
  constexpr int kRequests = 128;
  for (int i = 0; i < kRequests; ++i) {
    (*device)->Read(i * kBlock, {buffer_.data() + i * kBlock, kBlock},
                    [&](Result<uint64_t> result) {
                      EXPECT_TRUE(result.has_value());
                      ++done;
                    });
  }
  device->reset();
  EXPECT_EQ(done.load(), kRequests);
}

INSTANTIATE_TEST_SUITE_P(Engines, FileDeviceTest,
                         testing::Values(DeviceParam{IoEngineKind::kIoUring, true},
                                         DeviceParam{IoEngineKind::kIoUring, false},
                                         DeviceParam{IoEngineKind::kThreadPool, true},
                                         DeviceParam{IoEngineKind::kThreadPool, false}),
                         ParamName);

// Where a file system refuses O_DIRECT (tmpfs before Linux 6.6, some FUSE
// and network file systems), Open says how to fix the configuration.
TEST(FileDeviceDirectIoTest, RefusedODirectNamesTheSetting) {
  std::string tmpl = "/dev/shm/kvtier-disk-io-XXXXXX";
  if (::mkdtemp(tmpl.data()) == nullptr) GTEST_SKIP() << "no /dev/shm here";
  struct Cleanup {
    std::string dir;
    ~Cleanup() {
      std::error_code ignored;
      std::filesystem::remove_all(dir, ignored);
    }
  } cleanup{tmpl};
  Result<std::unique_ptr<IoEngine>> engine = IoEngine::Create({.kind = IoEngineKind::kThreadPool});
  ASSERT_TRUE(engine.has_value()) << engine.error();
  Result<std::unique_ptr<FileDevice>> device = FileDevice::Open({.path = tmpl + "/segment",
                                                                 .size_bytes = kDeviceBytes,
                                                                 .direct_io = true,
                                                                 .engine = engine->get()});
  if (device.has_value()) GTEST_SKIP() << "tmpfs accepts O_DIRECT on this kernel";
  EXPECT_EQ(device.error().code(), StatusCode::kFailedPrecondition) << device.error();
  EXPECT_EQ(device.error().raw_code(), EINVAL);
  EXPECT_NE(device.error().message().find("tiers.disk.direct_io=false"), std::string::npos)
      << device.error();
}

}  // namespace
}  // namespace kvtier

namespace kvtier {
namespace {

TEST(FileDeviceLockTest, ASecondOpenOfTheSameSegmentIsRefused) {
  disk_io_test::TempDir dir;
  Result<std::unique_ptr<IoEngine>> engine = IoEngine::Create({.kind = IoEngineKind::kThreadPool});
  ASSERT_TRUE(engine.has_value()) << engine.error();
  const FileDevice::Options options{.path = dir.path() + "/segment-0.kvt",
                                    .size_bytes = 1 << 20,
                                    .direct_io = false,
                                    .engine = engine->get()};
  Result<std::unique_ptr<FileDevice>> first = FileDevice::Open(options);
  ASSERT_TRUE(first.has_value()) << first.error();
  Result<std::unique_ptr<FileDevice>> second = FileDevice::Open(options);  // waits, then gives up
  ASSERT_FALSE(second.has_value());
  EXPECT_EQ(second.error().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(second.error().message().find("in use by another kvtierd"), std::string::npos);
  first->reset();  // the lock goes with the descriptor
  EXPECT_TRUE(FileDevice::Open(options).has_value());
}

}  // namespace
}  // namespace kvtier
