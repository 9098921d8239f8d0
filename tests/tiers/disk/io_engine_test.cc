#include "tiers/disk/io_engine.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <latch>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "common/memory_mapping.h"
#include "common/mutex.h"
#include "common/unique_fd.h"
#include "tests/tiers/disk/io_test_util.h"
#include "tiers/disk/io_engine_internal.h"

namespace kvtier {
namespace {

using disk_io_test::Completion;
using disk_io_test::FillPattern;
using disk_io_test::FirstMismatch;
using disk_io_test::RunSync;
using disk_io_test::TempDir;

constexpr uint64_t kBlock = 4096;

// ---------------------------------------------------------------------------
// RunToCompletion, over scripted transfers: no file, no ring.

// Answers each call with the next scripted result (a byte count is capped at
// what was asked), and records the calls.
struct ScriptedTransfer {
  struct Call {
    uint64_t offset;
    uint64_t length;
  };
  std::vector<ssize_t> script = {};
  std::vector<Call> calls = {};

  TransferFn Fn() {
    return [this](uint64_t offset, uint8_t* buffer, uint64_t length) -> ssize_t {
      calls.push_back({offset, length});
      EXPECT_LT(calls.size(), 1000u) << "runaway retry loop";
      const size_t i = calls.size() - 1;
      const ssize_t res = i < script.size() ? script[i] : static_cast<ssize_t>(length);
      if (res > 0) std::memset(buffer, 0xAB, static_cast<size_t>(res));
      return res;
    };
  }
};

TEST(RunToCompletionTest, ContinuesAfterShortTransfers) {
  ScriptedTransfer t{.script = {100, 1, 4000}};
  std::vector<uint8_t> buffer(8192);
  Result<uint64_t> moved = RunToCompletion(t.Fn(), 1000, buffer.data(), 8192, "read");
  ASSERT_TRUE(moved.has_value()) << moved.error();
  EXPECT_EQ(*moved, 8192u);
  ASSERT_EQ(t.calls.size(), 4u);
  // Each call picks up exactly where the previous one stopped.
  EXPECT_EQ(t.calls[1].offset, 1100u);
  EXPECT_EQ(t.calls[1].length, 8092u);
  EXPECT_EQ(t.calls[2].offset, 1101u);
  EXPECT_EQ(t.calls[3].offset, 5101u);
  EXPECT_EQ(t.calls[3].length, 8192u - 4101u);
  EXPECT_EQ(buffer.back(), 0xAB);
}

TEST(RunToCompletionTest, RetriesEintrAndEagain) {
  ScriptedTransfer t{.script = {-EINTR, -EAGAIN, 10, -EINTR}};
  std::vector<uint8_t> buffer(64);
  Result<uint64_t> moved = RunToCompletion(t.Fn(), 0, buffer.data(), 64, "write");
  ASSERT_TRUE(moved.has_value()) << moved.error();
  EXPECT_EQ(*moved, 64u);
  ASSERT_EQ(t.calls.size(), 5u);
  EXPECT_EQ(t.calls[3].offset, 10u);  // a retry resumes, it does not restart
  EXPECT_EQ(t.calls[4].offset, 10u);
}

TEST(RunToCompletionTest, GivesUpAfterMaxRetriesInARow) {
  ScriptedTransfer t{.script = std::vector<ssize_t>(10, -EAGAIN)};
  std::vector<uint8_t> buffer(64);
  Result<uint64_t> moved = RunToCompletion(t.Fn(), 0, buffer.data(), 64, "read x", 3);
  ASSERT_FALSE(moved.has_value());
  EXPECT_EQ(t.calls.size(), 4u);  // the first try and 3 retries
  EXPECT_EQ(moved.error().source(), ErrorSource::kErrno);
  EXPECT_EQ(moved.error().raw_code(), EAGAIN);
  EXPECT_NE(moved.error().message().find("read x"), std::string::npos) << moved.error();
}

TEST(RunToCompletionTest, ProgressResetsTheRetryCount) {
  // Three EAGAINs, progress, three more: never more than max_retries in a row.
  ScriptedTransfer t{.script = {-EAGAIN, -EAGAIN, -EAGAIN, 1, -EAGAIN, -EAGAIN, -EAGAIN}};
  std::vector<uint8_t> buffer(2);
  Result<uint64_t> moved = RunToCompletion(t.Fn(), 0, buffer.data(), 2, "read", 3);
  ASSERT_TRUE(moved.has_value()) << moved.error();
  EXPECT_EQ(*moved, 2u);
}

TEST(RunToCompletionTest, FinalErrorKeepsErrno) {
  ScriptedTransfer t{.script = {512, -EIO}};
  std::vector<uint8_t> buffer(4096);
  Result<uint64_t> moved = RunToCompletion(t.Fn(), 0, buffer.data(), 4096, "pread seg0");
  ASSERT_FALSE(moved.has_value());
  EXPECT_EQ(t.calls.size(), 2u);  // EIO is not retried
  EXPECT_EQ(moved.error().code(), StatusCode::kIoError);
  EXPECT_EQ(moved.error().source(), ErrorSource::kErrno);
  EXPECT_EQ(moved.error().raw_code(), EIO);
  EXPECT_NE(moved.error().message().find("pread seg0"), std::string::npos) << moved.error();
}

TEST(RunToCompletionTest, ZeroByteTransferBeforeTheEndIsAnError) {
  ScriptedTransfer t{.script = {100, 0}};
  std::vector<uint8_t> buffer(4096);
  Result<uint64_t> moved = RunToCompletion(t.Fn(), 0, buffer.data(), 4096, "read");
  ASSERT_FALSE(moved.has_value());
  EXPECT_EQ(t.calls.size(), 2u);
  EXPECT_EQ(moved.error().code(), StatusCode::kIoError);
  EXPECT_NE(moved.error().message().find("unexpected end of file"), std::string::npos)
      << moved.error();
}

TEST(RunToCompletionTest, MoreBytesThanAskedIsAnError) {
  ScriptedTransfer t{.script = {4097}};
  std::vector<uint8_t> buffer(8192);
  Result<uint64_t> moved = RunToCompletion(t.Fn(), 0, buffer.data(), 4096, "read");
  ASSERT_FALSE(moved.has_value());
  EXPECT_EQ(moved.error().code(), StatusCode::kInternal);
}

TEST(RunToCompletionTest, ZeroLengthMakesNoCall) {
  ScriptedTransfer t;
  Result<uint64_t> moved = RunToCompletion(t.Fn(), 0, nullptr, 0, "read");
  ASSERT_TRUE(moved.has_value());
  EXPECT_EQ(*moved, 0u);
  EXPECT_TRUE(t.calls.empty());
}

// ---------------------------------------------------------------------------
// PickNextChunk, the scheduling policy of both engines: no engine, no file.

using io_internal::Pick;
using io_internal::PickNextChunk;
using io_internal::Turn;

// Runs the policy over `reads` and `writes` queued chunks, all ready at
// once, until both are started; returns the start order ("R"/"W").
std::string StartOrder(uint32_t reads, uint32_t writes, uint32_t reads_per_write) {
  std::string order;
  uint32_t in_a_row = 0;
  for (;;) {
    const Pick pick = PickNextChunk(reads > 0, writes > 0, in_a_row, reads_per_write);
    if (pick.turn == Turn::kNone) return order;
    in_a_row = pick.reads_in_a_row;
    if (pick.turn == Turn::kRead) {
      --reads;
      order += 'R';
    } else {
      --writes;
      order += 'W';
    }
  }
}

TEST(PickNextChunkTest, NothingReadyIsNone) {
  const Pick pick = PickNextChunk(false, false, 3, 4);
  EXPECT_EQ(pick.turn, Turn::kNone);
  EXPECT_EQ(pick.reads_in_a_row, 3u);
}

TEST(PickNextChunkTest, ReadsGoFirstAndWritesGetEveryNthTurnWhileBothWait) {
  EXPECT_EQ(StartOrder(12, 3, 4), "RRRRWRRRRWRRRRW");
  EXPECT_EQ(StartOrder(6, 6, 1), "RWRWRWRWRWRW");
  EXPECT_EQ(StartOrder(5, 1, 2), "RRWRRR");
  // Once the reads are gone the writes run back to back, and vice versa.
  EXPECT_EQ(StartOrder(2, 4, 4), "RRWWWW");
  EXPECT_EQ(StartOrder(9, 1, 4), "RRRRWRRRRR");
}

TEST(PickNextChunkTest, AtLeastOneWriteInEveryWindowWhileBothWait) {
  for (uint32_t reads_per_write : {1u, 2u, 4u, 7u, 16u}) {
    const std::string order = StartOrder(1000, 1000, reads_per_write);
    // While both kinds remain (the first 1000 reads), every window of
    // reads_per_write + 1 starts holds a write.
    const size_t last_read = order.rfind('R');
    for (size_t at = 0; at + reads_per_write + 1 <= last_read; ++at) {
      ASSERT_NE(order.substr(at, reads_per_write + 1).find('W'), std::string::npos)
          << "reads_per_write " << reads_per_write << ", window at " << at;
    }
    // And reads still get their share: never two writes in a row then.
    EXPECT_EQ(order.substr(0, last_read).find("WW"), std::string::npos);
  }
}

TEST(PickNextChunkTest, ReadsWhileNoWriteCanStartAreNotCounted) {
  // Writes queued but without room (io_uring: every write slot in flight):
  // reads go, and the count stays where it was.
  Pick pick = PickNextChunk(true, false, 1, 2);
  EXPECT_EQ(pick.turn, Turn::kRead);
  EXPECT_EQ(pick.reads_in_a_row, 1u);
  pick = PickNextChunk(true, true, pick.reads_in_a_row, 2);
  EXPECT_EQ(pick.turn, Turn::kRead);
  EXPECT_EQ(pick.reads_in_a_row, 2u);
  pick = PickNextChunk(true, true, pick.reads_in_a_row, 2);
  EXPECT_EQ(pick.turn, Turn::kWrite);
  EXPECT_EQ(pick.reads_in_a_row, 0u);
  // A write alone starts, and resets the count.
  pick = PickNextChunk(false, true, 5, 2);
  EXPECT_EQ(pick.turn, Turn::kWrite);
  EXPECT_EQ(pick.reads_in_a_row, 0u);
}

// ---------------------------------------------------------------------------
// Create.

TEST(IoEngineCreateTest, RejectsBadOptions) {
  for (IoEngine::Options options :
       {IoEngine::Options{.threads = 0}, IoEngine::Options{.queue_depth = 0},
        IoEngine::Options{.max_write_chunk_bytes = 0},
        IoEngine::Options{.max_write_chunk_bytes = 1000},
        IoEngine::Options{.reads_per_write = 0}}) {
    Result<std::unique_ptr<IoEngine>> engine = IoEngine::Create(options);
    ASSERT_FALSE(engine.has_value());
    EXPECT_EQ(engine.error().code(), StatusCode::kInvalidArgument) << engine.error();
  }
}

TEST(IoEngineCreateTest, ThreadPoolAlwaysWorks) {
  Result<std::unique_ptr<IoEngine>> engine = IoEngine::Create({.kind = IoEngineKind::kThreadPool});
  ASSERT_TRUE(engine.has_value()) << engine.error();
  EXPECT_STREQ((*engine)->name(), "threadpool");
}

TEST(IoEngineCreateTest, IoUringIsUsedOrRefusedWithAReason) {
  Result<std::unique_ptr<IoEngine>> engine = IoEngine::Create({.kind = IoEngineKind::kIoUring});
  if (!engine.has_value()) {
    // Never a silent fallback: the caller asked for io_uring.
    EXPECT_EQ(engine.error().code(), StatusCode::kUnimplemented) << engine.error();
    EXPECT_FALSE(engine.error().message().empty());
    GTEST_SKIP() << "io_uring unavailable here: " << engine.error();
  }
  EXPECT_STREQ((*engine)->name(), "io_uring");
}

TEST(IoEngineCreateTest, AutoPicksIoUringWhereItWorks) {
  Result<std::unique_ptr<IoEngine>> uring = IoEngine::Create({.kind = IoEngineKind::kIoUring});
  Result<std::unique_ptr<IoEngine>> engine = IoEngine::Create({.kind = IoEngineKind::kAuto});
  ASSERT_TRUE(engine.has_value()) << engine.error();
  EXPECT_STREQ((*engine)->name(), uring.has_value() ? "io_uring" : "threadpool");
}

// ---------------------------------------------------------------------------
// Both engines, on a real file: {io_uring, threadpool} x {O_DIRECT or not} x
// {buffers registered or not}.

struct EngineParam {
  IoEngineKind kind;
  bool direct_io;
  bool fixed_buffers;
};

std::string ParamName(const testing::TestParamInfo<EngineParam>& info) {
  std::string name = info.param.kind == IoEngineKind::kIoUring ? "IoUring" : "ThreadPool";
  name += info.param.direct_io ? "_Direct" : "_Buffered";
  name += info.param.fixed_buffers ? "_Fixed" : "_Plain";
  return name;
}

class IoEngineTest : public testing::TestWithParam<EngineParam> {
 protected:
  static constexpr uint64_t kFileBytes = 16 << 20;
  static constexpr uint64_t kBufferBytes = 16 << 20;

  // Creates the engine, the file and the buffer. Returns false, with
  // skip_reason_ set, where io_uring or buffer registration is unavailable.
  bool Init(IoEngine::Options options) {
    EXPECT_TRUE(dir_.ok()) << "mkdtemp failed";
    options.kind = GetParam().kind;
    Result<std::unique_ptr<IoEngine>> engine = IoEngine::Create(options);
    if (!engine.has_value()) {
      if (engine.error().code() == StatusCode::kUnimplemented) {
        skip_reason_ = "io_uring unavailable: " + engine.error().ToString();
      } else {
        ADD_FAILURE() << engine.error();
        skip_reason_ = "engine creation failed";
      }
      return false;
    }
    engine_ = std::move(*engine);

    const int flags = O_RDWR | O_CREAT | O_CLOEXEC | (GetParam().direct_io ? O_DIRECT : 0);
    fd_ = UniqueFd(::open(dir_.File("data").c_str(), flags, 0600));
    if (!fd_) {
      ADD_FAILURE() << "open: " << std::strerror(errno);
      skip_reason_ = "open failed";
      return false;
    }
    EXPECT_EQ(::ftruncate(fd_.get(), kFileBytes), 0) << std::strerror(errno);

    Result<MemoryMapping> buffer = MemoryMapping::Anonymous(kBufferBytes);
    EXPECT_TRUE(buffer.has_value());
    if (!buffer.has_value()) return false;
    buffer_ = std::move(*buffer);

    if (GetParam().fixed_buffers) {
      const std::span<uint8_t> spans[] = {buffer_.bytes()};
      Status status = engine_->RegisterBuffers(spans);
      if (!status.ok()) {
        // Typically RLIMIT_MEMLOCK: a limit of the machine, not a bug.
        skip_reason_ = "buffer registration unavailable: " + status.ToString();
        return false;
      }
    }
    return true;
  }

  IoRequest Request(IoOp op, uint64_t file_offset, uint64_t buffer_offset, uint64_t length) {
    return IoRequest{.op = op,
                     .fd = fd_.get(),
                     .offset = file_offset,
                     .buffer = buffer_.data() + buffer_offset,
                     .length = length};
  }

  TempDir dir_;
  std::string skip_reason_;
  std::unique_ptr<IoEngine> engine_;
  UniqueFd fd_;
  MemoryMapping buffer_;
};

#define KVTIER_INIT_OR_SKIP(options)                  \
  do {                                                \
    if (!Init(options)) GTEST_SKIP() << skip_reason_; \
  } while (false)

TEST_P(IoEngineTest, WritesThenReadsBackRandomBlocks) {
  KVTIER_INIT_OR_SKIP(
      (IoEngine::Options{.threads = 2, .queue_depth = 16, .max_write_chunk_bytes = 8 * kBlock}));
  // 300 requests of 1 to 16 blocks at random, non-overlapping places.
  std::mt19937_64 rng(42);
  struct Extent {
    uint64_t file_offset, buffer_offset, length;
  };
  std::vector<Extent> extents;
  std::vector<uint64_t> slots(kFileBytes / (16 * kBlock));
  for (uint64_t i = 0; i < slots.size(); ++i) slots[i] = i;
  std::shuffle(slots.begin(), slots.end(), rng);
  uint64_t buffer_at = 0;
  for (uint64_t slot : slots) {
    const uint64_t length = (1 + rng() % 16) * kBlock;
    extents.push_back({slot * 16 * kBlock, buffer_at, length});
    buffer_at += length;
    if (buffer_at + 16 * kBlock > kBufferBytes) break;
  }
  constexpr uint32_t kSeed = 7;
  for (const Extent& e : extents) {
    FillPattern({buffer_.data() + e.buffer_offset, e.length}, e.file_offset, kSeed);
  }

  std::vector<Completion> writes(extents.size());
  for (size_t i = 0; i < extents.size(); ++i) {
    IoRequest request =
        Request(IoOp::kWrite, extents[i].file_offset, extents[i].buffer_offset, extents[i].length);
    request.done = writes[i].Callback();
    engine_->Submit(std::move(request));
  }
  for (size_t i = 0; i < extents.size(); ++i) {
    Result<uint64_t> result = writes[i].Wait();
    ASSERT_TRUE(result.has_value()) << result.error();
    EXPECT_EQ(*result, extents[i].length);
  }

  std::memset(buffer_.data(), 0, kBufferBytes);
  std::vector<Completion> reads(extents.size());
  for (size_t i = 0; i < extents.size(); ++i) {
    IoRequest request =
        Request(IoOp::kRead, extents[i].file_offset, extents[i].buffer_offset, extents[i].length);
    request.done = reads[i].Callback();
    engine_->Submit(std::move(request));
  }
  for (size_t i = 0; i < extents.size(); ++i) {
    Result<uint64_t> result = reads[i].Wait();
    ASSERT_TRUE(result.has_value()) << result.error();
    EXPECT_EQ(*result, extents[i].length);
    const Extent& e = extents[i];
    EXPECT_EQ(FirstMismatch({buffer_.data() + e.buffer_offset, e.length}, e.file_offset, kSeed), -1)
        << "extent at file offset " << e.file_offset;
  }
}

TEST_P(IoEngineTest, ConcurrentSubmittersAndSyncs) {
  KVTIER_INIT_OR_SKIP(
      (IoEngine::Options{.threads = 2, .queue_depth = 8, .max_write_chunk_bytes = 4 * kBlock}));
  constexpr int kThreads = 4;
  constexpr uint64_t kPerThread = 64;  // blocks of 16 KiB each
  constexpr uint64_t kBytes = 4 * kBlock;
  constexpr uint32_t kSeed = 11;
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::vector<Completion> done(kPerThread);
      for (uint64_t i = 0; i < kPerThread; ++i) {
        const uint64_t at = (t * kPerThread + i) * kBytes;
        FillPattern({buffer_.data() + at, kBytes}, at, kSeed);
        IoRequest request = Request(IoOp::kWrite, at, at, kBytes);
        request.done = done[i].Callback();
        engine_->Submit(std::move(request));
      }
      for (auto& d : done) {
        if (!d.Wait().has_value()) ++failures;
      }
      // Each thread makes its own writes durable.
      if (!RunSync(*engine_, IoRequest{.op = IoOp::kSync, .fd = fd_.get()}).has_value()) {
        ++failures;
      }
    });
  }
  for (auto& t : threads) t.join();
  ASSERT_EQ(failures.load(), 0);

  const uint64_t total = kThreads * kPerThread * kBytes;
  std::memset(buffer_.data(), 0, total);
  Result<uint64_t> read = RunSync(*engine_, Request(IoOp::kRead, 0, 0, total));
  ASSERT_TRUE(read.has_value()) << read.error();
  EXPECT_EQ(*read, total);
  EXPECT_EQ(FirstMismatch({buffer_.data(), total}, 0, kSeed), -1);
}

TEST_P(IoEngineTest, SyncReportsSuccess) {
  KVTIER_INIT_OR_SKIP((IoEngine::Options{.threads = 1}));
  FillPattern({buffer_.data(), kBlock}, 0, 3);
  ASSERT_TRUE(RunSync(*engine_, Request(IoOp::kWrite, 0, 0, kBlock)).has_value());
  Result<uint64_t> sync = RunSync(*engine_, IoRequest{.op = IoOp::kSync, .fd = fd_.get()});
  ASSERT_TRUE(sync.has_value()) << sync.error();
  EXPECT_EQ(*sync, 0u);
}

// What the engine reports of its threads: each chunk it started, its bytes
// and the depth it started at, its syncs, and idle time that includes a wait
// still under way (an engine with nothing to do is idle all along).
TEST_P(IoEngineTest, StatsCountChunksBytesDepthSyncsAndIdleTime) {
  constexpr uint64_t kChunk = 256 << 10;
  KVTIER_INIT_OR_SKIP((IoEngine::Options{.threads = 2, .queue_depth = 8, .max_write_chunk_bytes = kChunk}));
  const IoEngineStats before = engine_->stats();
  EXPECT_EQ(before.reads + before.writes + before.syncs, 0u);
  // A 1 MiB write (4 chunks), a sync, then four 256 KiB reads at once.
  FillPattern({buffer_.data(), 1 << 20}, 0, 5);
  ASSERT_TRUE(RunSync(*engine_, Request(IoOp::kWrite, 0, 0, 1 << 20)).has_value());
  ASSERT_TRUE(RunSync(*engine_, IoRequest{.op = IoOp::kSync, .fd = fd_.get()}).has_value());
  std::latch reads(4);
  for (uint64_t i = 0; i < 4; ++i) {
    engine_->Submit(IoRequest{.op = IoOp::kRead,
                              .fd = fd_.get(),
                              .offset = i * kChunk,
                              .buffer = buffer_.data() + (2 << 20) + i * kChunk,
                              .length = kChunk,
                              .done = [&](Result<uint64_t> got) {
                                EXPECT_TRUE(got.has_value());
                                reads.count_down();
                              }});
  }
  reads.wait();
  const IoEngineStats after = engine_->stats();
  EXPECT_EQ(after.writes, 4u);
  EXPECT_EQ(after.write_bytes, uint64_t{1} << 20);
  EXPECT_EQ(after.syncs, 1u);
  EXPECT_EQ(after.reads, 4u);
  EXPECT_EQ(after.read_bytes, 4 * kChunk);
  EXPECT_GE(after.depth_sum, after.reads + after.writes + after.syncs) << "each at depth 1 at least";
  EXPECT_LE(after.depth_sum, 8 * (after.reads + after.writes + after.syncs)) << "never past the queue depth";
  EXPECT_LE(after.idle_ns, after.thread_ns);
  // Nothing to do for 100 ms: both threads idle nearly all of it, though
  // neither wait has ended yet.
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  const IoEngineStats idle = engine_->stats();
  const double thread_ms = static_cast<double>(idle.thread_ns - after.thread_ns) / 1e6;
  const double idle_ms = static_cast<double>(idle.idle_ns - after.idle_ns) / 1e6;
  EXPECT_GE(thread_ms, 2 * 100.0);
  EXPECT_GE(idle_ms, 0.9 * thread_ms);
  EXPECT_LE(idle_ms, thread_ms);
}

// A large write is split into chunks; a read submitted while it runs gets in
// between and completes first. One thread (one ring), so the order is the
// engine's doing: the gate holds the thread while W and X are queued, X (a
// read) goes first, and X's done submits R while W still has most of its 128
// chunks to go (io_uring: at most queue_depth / 2 chunks in flight; threads:
// one at a time).
TEST_P(IoEngineTest, ReadSubmittedDuringALargeWriteCompletesFirst) {
  KVTIER_INIT_OR_SKIP(
      (IoEngine::Options{.threads = 1, .queue_depth = 8, .max_write_chunk_bytes = 64 << 10}));
  constexpr uint64_t kWriteBytes = 8 << 20;
  constexpr uint64_t kReadAt = 12 << 20;  // in the file and in the buffer
  constexpr uint32_t kSeed = 5;
  FillPattern({buffer_.data() + kReadAt, 2 * kBlock}, kReadAt, kSeed);
  ASSERT_TRUE(RunSync(*engine_, Request(IoOp::kWrite, kReadAt, kReadAt, 2 * kBlock)).has_value());
  std::memset(buffer_.data() + kReadAt, 0, 2 * kBlock);
  FillPattern({buffer_.data(), kWriteBytes}, 0, kSeed);

  Mutex mu;
  std::vector<std::string> order;
  auto record = [&](const char* what) {
    MutexLock lock(&mu);
    order.push_back(what);
  };

  std::latch gate_entered(1), gate_release(1);
  IoRequest gate{.op = IoOp::kRead, .fd = fd_.get()};  // zero bytes: no system call
  gate.done = [&](Result<uint64_t>) {
    gate_entered.count_down();
    gate_release.wait();
  };
  engine_->Submit(std::move(gate));
  gate_entered.wait();  // the engine's only thread is now inside the gate

  Completion write_done, r_done;
  IoRequest w = Request(IoOp::kWrite, 0, 0, kWriteBytes);
  w.done = [&](Result<uint64_t> result) {
    record("W");
    write_done.Callback()(std::move(result));
  };
  IoRequest x = Request(IoOp::kRead, kReadAt, kReadAt, kBlock);
  x.done = [&](Result<uint64_t> result) {
    EXPECT_TRUE(result.has_value());
    record("X");
    IoRequest r = Request(IoOp::kRead, kReadAt + kBlock, kReadAt + kBlock, kBlock);
    r.done = [&](Result<uint64_t> r_result) {
      record("R");
      r_done.Callback()(std::move(r_result));
    };
    engine_->Submit(std::move(r));
  };
  engine_->Submit(std::move(w));
  engine_->Submit(std::move(x));
  gate_release.count_down();

  Result<uint64_t> r_result = r_done.Wait();
  Result<uint64_t> w_result = write_done.Wait();
  ASSERT_TRUE(r_result.has_value()) << r_result.error();
  ASSERT_TRUE(w_result.has_value()) << w_result.error();
  EXPECT_EQ(*w_result, kWriteBytes);
  {
    MutexLock lock(&mu);
    EXPECT_EQ(order, (std::vector<std::string>{"X", "R", "W"}));
  }
  EXPECT_EQ(FirstMismatch({buffer_.data() + kReadAt, 2 * kBlock}, kReadAt, kSeed), -1);

  // Every chunk of the write landed where it belongs.
  std::memset(buffer_.data(), 0, kWriteBytes);
  ASSERT_TRUE(RunSync(*engine_, Request(IoOp::kRead, 0, 0, kWriteBytes)).has_value());
  EXPECT_EQ(FirstMismatch({buffer_.data(), kWriteBytes}, 0, kSeed), -1);
}

// Many reads queued ahead of two writes and a sync: the writes and the sync
// still get every third turn, and complete while most reads wait. One thread
// and one chunk in flight, so completions come in the order the engine
// started them: the gate holds the thread until everything is queued, and
// the order is then the policy's (PickNextChunk), the same for both engines.
TEST_P(IoEngineTest, WritesAndSyncsGetTheirShareWhileReadsWait) {
  KVTIER_INIT_OR_SKIP((IoEngine::Options{
      .threads = 1, .queue_depth = 1, .max_write_chunk_bytes = kBlock, .reads_per_write = 2}));
  constexpr int kReads = 64;
  constexpr uint64_t kWriteAt = 8 << 20;  // in the file and in the buffer
  constexpr uint32_t kSeed = 9;
  FillPattern({buffer_.data() + kWriteAt, 3 * kBlock}, kWriteAt, kSeed);

  Mutex mu;
  std::vector<std::string> order;
  auto record = [&](std::string what) {
    MutexLock lock(&mu);
    order.push_back(std::move(what));
  };

  std::latch gate_entered(1), gate_release(1);
  IoRequest gate{.op = IoOp::kRead, .fd = fd_.get()};  // zero bytes: no system call
  gate.done = [&](Result<uint64_t>) {
    gate_entered.count_down();
    gate_release.wait();
  };
  engine_->Submit(std::move(gate));
  gate_entered.wait();  // the engine's only thread is now inside the gate

  std::atomic<int> failures{0};
  std::vector<Completion> done(kReads + 3);
  auto submit = [&](IoRequest request, std::string name, Completion* completion) {
    request.done = [&, name = std::move(name), completion](Result<uint64_t> result) {
      if (!result.has_value()) ++failures;
      record(name);
      completion->Callback()(std::move(result));
    };
    engine_->Submit(std::move(request));
  };
  for (int i = 0; i < kReads; ++i) {
    submit(Request(IoOp::kRead, i * kBlock, i * kBlock, kBlock), "R", &done[i]);
  }
  // W1 is two chunks, W2 one.
  submit(Request(IoOp::kWrite, kWriteAt, kWriteAt, 2 * kBlock), "W1", &done[kReads]);
  submit(Request(IoOp::kWrite, kWriteAt + 2 * kBlock, kWriteAt + 2 * kBlock, kBlock), "W2",
         &done[kReads + 1]);
  submit(IoRequest{.op = IoOp::kSync, .fd = fd_.get()}, "S", &done[kReads + 2]);
  gate_release.count_down();
  for (Completion& c : done) (void)c.Wait();
  ASSERT_EQ(failures.load(), 0);

  // Starts: R R W1 R R W1 R R W2 R R S, then the other 56 reads.
  std::vector<std::string> expected = {"R", "R", "R", "R", "W1", "R", "R", "W2", "R", "R", "S"};
  expected.resize(kReads + 3, "R");
  {
    MutexLock lock(&mu);
    EXPECT_EQ(order, expected);
    const auto sync_at = std::find(order.begin(), order.end(), "S") - order.begin();
    EXPECT_EQ(std::count(order.begin(), order.begin() + sync_at, "R"), 8)
        << "the sync completed while 56 reads were still queued";
  }
  std::memset(buffer_.data() + kWriteAt, 0, 3 * kBlock);
  ASSERT_TRUE(RunSync(*engine_, Request(IoOp::kRead, kWriteAt, kWriteAt, 3 * kBlock)).has_value());
  EXPECT_EQ(FirstMismatch({buffer_.data() + kWriteAt, 3 * kBlock}, kWriteAt, kSeed), -1);
}

TEST_P(IoEngineTest, ErrorsKeepTheirErrno) {
  KVTIER_INIT_OR_SKIP((IoEngine::Options{.threads = 1}));
  Result<uint64_t> bad_fd = RunSync(
      *engine_, IoRequest{.op = IoOp::kRead, .fd = -1, .buffer = buffer_.data(), .length = kBlock});
  ASSERT_FALSE(bad_fd.has_value());
  EXPECT_EQ(bad_fd.error().source(), ErrorSource::kErrno);
  EXPECT_EQ(bad_fd.error().raw_code(), EBADF) << bad_fd.error();

  Result<uint64_t> bad_sync = RunSync(*engine_, IoRequest{.op = IoOp::kSync, .fd = -1});
  ASSERT_FALSE(bad_sync.has_value());
  EXPECT_EQ(bad_sync.error().raw_code(), EBADF) << bad_sync.error();

  if (GetParam().direct_io) {
    // O_DIRECT refuses an unaligned offset with EINVAL. A write: ext4 answers
    // an unaligned read of a hole with zeros instead.
    Result<uint64_t> unaligned = RunSync(*engine_, Request(IoOp::kWrite, 100, 0, kBlock));
    ASSERT_FALSE(unaligned.has_value());
    EXPECT_EQ(unaligned.error().code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(unaligned.error().raw_code(), EINVAL) << unaligned.error();
  }
}

TEST_P(IoEngineTest, ReadPastTheEndOfTheFileIsAnError) {
  KVTIER_INIT_OR_SKIP((IoEngine::Options{.threads = 1}));
  Result<uint64_t> read =
      RunSync(*engine_, Request(IoOp::kRead, kFileBytes - kBlock, 0, 2 * kBlock));
  ASSERT_FALSE(read.has_value());
  EXPECT_EQ(read.error().code(), StatusCode::kIoError);
  EXPECT_NE(read.error().message().find("unexpected end of file"), std::string::npos)
      << read.error();
}

TEST_P(IoEngineTest, DoneRunsOnAnEngineThread) {
  KVTIER_INIT_OR_SKIP((IoEngine::Options{.threads = 2}));
  for (uint64_t length : {uint64_t{0}, kBlock}) {
    std::promise<std::thread::id> where;
    IoRequest request = Request(IoOp::kRead, 0, 0, length);
    request.done = [&](Result<uint64_t> result) {
      EXPECT_TRUE(result.has_value());
      where.set_value(std::this_thread::get_id());
    };
    engine_->Submit(std::move(request));
    EXPECT_NE(where.get_future().get(), std::this_thread::get_id()) << "length " << length;
  }
}

TEST_P(IoEngineTest, DestructionCompletesEverythingSubmitted) {
  KVTIER_INIT_OR_SKIP(
      (IoEngine::Options{.threads = 2, .queue_depth = 4, .max_write_chunk_bytes = kBlock}));
  std::atomic<int> ok{0}, failed{0};
  constexpr int kRequests = 64;
  for (int i = 0; i < kRequests; ++i) {
    IoRequest request = Request(IoOp::kWrite, i * 4 * kBlock, i * 4 * kBlock, 4 * kBlock);
    request.done = [&](Result<uint64_t> result) { ++(result.has_value() ? ok : failed); };
    engine_->Submit(std::move(request));
  }
  engine_.reset();
  EXPECT_EQ(ok.load(), kRequests);
  EXPECT_EQ(failed.load(), 0);
}

INSTANTIATE_TEST_SUITE_P(Matrix, IoEngineTest,
                         testing::Values(EngineParam{IoEngineKind::kIoUring, true, true},
                                         EngineParam{IoEngineKind::kIoUring, true, false},
                                         EngineParam{IoEngineKind::kIoUring, false, true},
                                         EngineParam{IoEngineKind::kIoUring, false, false},
                                         EngineParam{IoEngineKind::kThreadPool, true, true},
                                         EngineParam{IoEngineKind::kThreadPool, true, false},
                                         EngineParam{IoEngineKind::kThreadPool, false, true},
                                         EngineParam{IoEngineKind::kThreadPool, false, false}),
                         ParamName);

// ---------------------------------------------------------------------------
// io_uring only.

Result<std::unique_ptr<IoEngine>> CreateIoUring(IoEngine::Options options) {
  options.kind = IoEngineKind::kIoUring;
  return IoEngine::Create(options);
}

// A pipe, whose end holds a ring's slot until the test writes to it or
// drains it, and a file in `dir` holding one block of 0x5A. Check ok().
struct PipeAndFile {
  UniqueFd pipe_read, pipe_write, file;
  std::vector<uint8_t> block = std::vector<uint8_t>(kBlock, 0x5A);

  explicit PipeAndFile(const TempDir& dir) {
    int fds[2];
    if (::pipe2(fds, O_CLOEXEC) != 0) return;
    pipe_read = UniqueFd(fds[0]);
    pipe_write = UniqueFd(fds[1]);
    file = UniqueFd(::open(dir.File("f").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600));
    if (file.valid() && ::pwrite(file.get(), block.data(), kBlock, 0) != static_cast<ssize_t>(kBlock)) {
      file = UniqueFd();
    }
  }
  bool ok() const { return pipe_read.valid() && pipe_write.valid() && file.valid(); }
};

// A write blocked in the kernel (on a full pipe) holds at most half the ring:
// a read submitted after it still runs and completes. No timing involved: the
// write cannot finish until the test drains the pipe.
TEST(IoUringEngineTest, ReadCompletesWhileAWriteIsBlocked) {
  Result<std::unique_ptr<IoEngine>> engine =
      CreateIoUring({.threads = 1, .queue_depth = 8, .max_write_chunk_bytes = kBlock});
  if (!engine.has_value()) GTEST_SKIP() << "io_uring unavailable: " << engine.error();
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  PipeAndFile io(dir);
  ASSERT_TRUE(io.ok()) << std::strerror(errno);
  // One page of pipe: the second chunk of the write already waits.
  ASSERT_GT(::fcntl(io.pipe_write.get(), F_SETPIPE_SZ, 4096), 0);

  constexpr uint64_t kWriteBytes = 64 * kBlock;
  std::vector<uint8_t> to_pipe(kWriteBytes, 0x33);
  std::atomic<bool> write_finished{false};
  Completion write_done;
  IoRequest write{
      .op = IoOp::kWrite, .fd = io.pipe_write.get(), .buffer = to_pipe.data(), .length = kWriteBytes};
  write.done = [&](Result<uint64_t> result) {
    write_finished = true;
    write_done.Callback()(std::move(result));
  };
  (*engine)->Submit(std::move(write));

  std::vector<uint8_t> read_buffer(kBlock);
  Result<uint64_t> read = RunSync(
      **engine,
      IoRequest{
          .op = IoOp::kRead, .fd = io.file.get(), .buffer = read_buffer.data(), .length = kBlock});
  ASSERT_TRUE(read.has_value()) << read.error();
  EXPECT_EQ(read_buffer, io.block);
  EXPECT_FALSE(write_finished.load());

  // Now let the write through.
  std::vector<uint8_t> drained(kWriteBytes);
  uint64_t got = 0;
  while (got < kWriteBytes) {
    const ssize_t n = ::read(io.pipe_read.get(), drained.data() + got, kWriteBytes - got);
    ASSERT_GT(n, 0) << std::strerror(errno);
    got += static_cast<uint64_t>(n);
  }
  Result<uint64_t> written = write_done.Wait();
  ASSERT_TRUE(written.has_value()) << written.error();
  EXPECT_EQ(*written, kWriteBytes);
  EXPECT_EQ(drained, to_pipe);
}

TEST(IoUringEngineTest, TheRingIsRefilledBeforeDoneCallbacksRun) {
  // A ring of depth 1, its slot taken by a read of an empty pipe, and a
  // file read waiting behind it. When the pipe read completes, the file
  // read starts before the pipe read's done callback runs: a done callback
  // (a record's checksum) must not hold the device idle.
  Result<std::unique_ptr<IoEngine>> engine = CreateIoUring({.threads = 1, .queue_depth = 1});
  if (!engine.has_value()) GTEST_SKIP() << "io_uring unavailable: " << engine.error();
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  PipeAndFile io(dir);
  ASSERT_TRUE(io.ok()) << std::strerror(errno);

  uint8_t byte = 0;
  std::atomic<uint64_t> started_at_callback{0};
  Completion pipe_done, file_done;
  IoRequest from_pipe{.op = IoOp::kRead, .fd = io.pipe_read.get(), .buffer = &byte, .length = 1};
  from_pipe.done = [&](Result<uint64_t> result) {
    started_at_callback = (*engine)->stats().reads;
    pipe_done.Callback()(std::move(result));
  };
  (*engine)->Submit(std::move(from_pipe));
  std::vector<uint8_t> read_buffer(kBlock);
  (*engine)->Submit(IoRequest{.op = IoOp::kRead,
                              .fd = io.file.get(),
                              .buffer = read_buffer.data(),
                              .length = kBlock,
                              .done = file_done.Callback()});
  // RegisterBuffers runs on the I/O thread at the top of a pass, after that
  // pass took in what was submitted before it: once it returns, both reads
  // wait in the thread's queue (whether the registration itself is allowed
  // here or not), so the file read is there when the pipe read completes.
  Result<MemoryMapping> memory = MemoryMapping::Anonymous(1 << 16);
  ASSERT_TRUE(memory.has_value());
  const std::span<uint8_t> spans[] = {memory->bytes()};
  (void)(*engine)->RegisterBuffers(spans);
  // The pass that took them in starts the pipe read soon after; it cannot
  // complete, so the file read cannot start until the test writes to it.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while ((*engine)->stats().reads == 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_EQ((*engine)->stats().reads, 1u) << "the file read started while the pipe read held the ring";

  const uint8_t one = 7;
  ASSERT_EQ(::write(io.pipe_write.get(), &one, 1), 1);
  Result<uint64_t> piped = pipe_done.Wait();
  ASSERT_TRUE(piped.has_value()) << piped.error();
  EXPECT_EQ(byte, 7);
  Result<uint64_t> read = file_done.Wait();
  ASSERT_TRUE(read.has_value()) << read.error();
  EXPECT_EQ(read_buffer, io.block);
  EXPECT_EQ(started_at_callback.load(), 2u) << "the pipe read's done callback ran before the ring was refilled";
}

TEST(IoUringEngineTest, RegisteringTwiceIsRefused) {
  Result<std::unique_ptr<IoEngine>> engine = CreateIoUring({.threads = 2});
  if (!engine.has_value()) GTEST_SKIP() << "io_uring unavailable: " << engine.error();
  Result<MemoryMapping> memory = MemoryMapping::Anonymous(1 << 20);
  ASSERT_TRUE(memory.has_value());
  const std::span<uint8_t> spans[] = {memory->bytes().subspan(0, 1 << 19),
                                      memory->bytes().subspan(1 << 19)};
  Status first = (*engine)->RegisterBuffers(spans);
  if (!first.ok()) GTEST_SKIP() << "buffer registration unavailable: " << first;
  Status second = (*engine)->RegisterBuffers(spans);
  EXPECT_EQ(second.code(), StatusCode::kFailedPrecondition) << second;
  // Still serving I/O, from either registered buffer or from outside them.
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  UniqueFd file(::open(dir.File("f").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600));
  ASSERT_TRUE(file.valid());
  std::vector<uint8_t> outside(kBlock, 1);
  for (uint8_t* p : {memory->data(), memory->data() + (1 << 19) - kBlock / 2, outside.data()}) {
    Result<uint64_t> written = RunSync(
        **engine, IoRequest{.op = IoOp::kWrite, .fd = file.get(), .buffer = p, .length = kBlock});
    EXPECT_TRUE(written.has_value()) << written.error();
  }
}

}  // namespace
}  // namespace kvtier
