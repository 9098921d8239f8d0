// Tests of the test block devices themselves: the disk tier's tests trust
// them to behave like a real device and to inject exactly what they are told.
#include <gtest/gtest.h>

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <future>
#include <latch>
#include <memory>
#include <span>
#include <thread>
#include <vector>

#include "tests/tiers/disk/faulty_device.h"
#include "tests/tiers/disk/memory_device.h"

namespace kvtier {
namespace {

constexpr uint64_t kPage = 4096;
constexpr uint64_t kDeviceBytes = 16 * kPage;

// A 4 KiB-aligned heap buffer, as O_DIRECT needs.
class AlignedBuffer {
 public:
  explicit AlignedBuffer(uint64_t size_bytes, uint8_t fill = 0)
      : size_bytes_(size_bytes),
        data_(static_cast<uint8_t*>(std::aligned_alloc(kPage, size_bytes))) {
    std::fill(data_.get(), data_.get() + size_bytes_, fill);
  }
  std::span<uint8_t> span() { return {data_.get(), size_bytes_}; }
  std::span<uint8_t> span(uint64_t offset, uint64_t length) {
    return span().subspan(offset, length);
  }

 private:
  struct Free {
    void operator()(uint8_t* p) const { std::free(p); }
  };
  uint64_t size_bytes_;
  std::unique_ptr<uint8_t, Free> data_;
};

// The outcome of one operation and the thread its `done` ran on.
struct Completion {
  Result<uint64_t> result;
  std::thread::id thread;
};

// Issues one operation and waits for its completion. `done` running twice
// would set the promise twice and abort the test.
template <typename Issue>
Completion Await(Issue issue) {
  std::promise<Completion> promise;
  std::future<Completion> future = promise.get_future();
  issue([&promise](Result<uint64_t> result) {
    promise.set_value({std::move(result), std::this_thread::get_id()});
  });
  return future.get();
}

Completion ReadAt(BlockDevice& d, uint64_t offset, std::span<uint8_t> buffer) {
  return Await([&](BlockDevice::Done done) { d.Read(offset, buffer, std::move(done)); });
}
Completion WriteAt(BlockDevice& d, uint64_t offset, std::span<const uint8_t> buffer) {
  return Await([&](BlockDevice::Done done) { d.Write(offset, buffer, std::move(done)); });
}
Completion SyncNow(BlockDevice& d) {
  return Await([&](BlockDevice::Done done) { d.Sync(std::move(done)); });
}

void ExpectBytes(const Completion& c, uint64_t bytes) {
  ASSERT_TRUE(c.result.has_value()) << c.result.error();
  EXPECT_EQ(*c.result, bytes);
}
void ExpectErrno(const Completion& c, StatusCode code, int err) {
  ASSERT_FALSE(c.result.has_value());
  EXPECT_EQ(c.result.error().code(), code) << c.result.error();
  EXPECT_EQ(c.result.error().source(), ErrorSource::kErrno);
  EXPECT_EQ(c.result.error().raw_code(), err) << c.result.error();
}

bool AllEqual(std::span<const uint8_t> bytes, uint8_t value) {
  return std::all_of(bytes.begin(), bytes.end(), [value](uint8_t b) { return b == value; });
}

// ---- MemoryDevice ----

TEST(MemoryDeviceTest, WritesReadBackAndSync) {
  MemoryDevice device(kDeviceBytes);
  EXPECT_EQ(device.size_bytes(), kDeviceBytes);
  EXPECT_EQ(device.alignment(), kPage);
  EXPECT_EQ(device.name(), "memory");
  AlignedBuffer data(2 * kPage, 0x11);
  data.span()[kPage + 5] = 0x22;
  ExpectBytes(WriteAt(device, 3 * kPage, data.span()), 2 * kPage);
  ExpectBytes(SyncNow(device), 0);
  EXPECT_EQ(device.syncs(), 1u);

  AlignedBuffer back(4 * kPage, 0xff);
  ExpectBytes(ReadAt(device, 2 * kPage, back.span()), 4 * kPage);
  EXPECT_TRUE(AllEqual(back.span(0, kPage), 0));  // never written
  EXPECT_TRUE(std::equal(data.span().begin(), data.span().end(), back.span().begin() + kPage));
  EXPECT_TRUE(AllEqual(back.span(3 * kPage, kPage), 0));
  EXPECT_EQ(device.raw()[3 * kPage + kPage + 5], 0x22);
  // The last page, and an empty transfer at the very end, are in bounds.
  ExpectBytes(ReadAt(device, kDeviceBytes - kPage, back.span(0, kPage)), kPage);
  ExpectBytes(ReadAt(device, kDeviceBytes, back.span(0, 0)), 0);
}

TEST(MemoryDeviceTest, MisalignedRequestsFailWithEinval) {
  MemoryDevice device(kDeviceBytes);
  AlignedBuffer buffer(3 * kPage);
  const auto c1 = ReadAt(device, 512, buffer.span(0, kPage));             // offset
  const auto c2 = WriteAt(device, 0, buffer.span(0, kPage + 512));        // length
  const auto c3 = ReadAt(device, 0, buffer.span(512, kPage));             // address
  const auto c4 = WriteAt(device, kPage, buffer.span(kPage / 2, kPage));  // address
  for (const Completion& c : {c1, c2, c3, c4}) {
    ExpectErrno(c, StatusCode::kInvalidArgument, EINVAL);
    EXPECT_NE(c.result.error().message().find("not aligned"), std::string::npos);
    EXPECT_NE(c.thread, std::this_thread::get_id());
  }
  EXPECT_TRUE(AllEqual(device.raw(), 0)) << "a rejected write must not land";
}

TEST(MemoryDeviceTest, OutOfBoundsRequestsFailWithEinval) {
  MemoryDevice device(kDeviceBytes);
  AlignedBuffer buffer(2 * kPage);
  const auto c1 = ReadAt(device, kDeviceBytes - kPage, buffer.span());   // straddles the end
  const auto c2 = WriteAt(device, kDeviceBytes, buffer.span(0, kPage));  // starts at the end
  // offset + length wraps around 2^64: must not pass as in bounds.
  const auto c3 = ReadAt(device, UINT64_MAX - kPage + 1, buffer.span(0, 2 * kPage));
  for (const Completion& c : {c1, c2, c3}) {
    ExpectErrno(c, StatusCode::kInvalidArgument, EINVAL);
    EXPECT_NE(c.result.error().message().find("past the device"), std::string::npos);
  }
}

TEST(MemoryDeviceTest, DoneRunsOnTheDeviceThreadNeverInline) {
  MemoryDevice device(kDeviceBytes);
  AlignedBuffer buffer(kPage);
  // Park the device thread inside a first completion; then every later
  // operation has provably not completed when its call returns.
  std::latch parked(1), release(1);
  std::atomic<int> completed{0};
  device.Sync([&](Result<uint64_t>) {
    parked.count_down();
    release.wait();
    completed.fetch_add(1);  // relaxed would do; seq_cst keeps the test simple
  });
  parked.wait();
  std::vector<std::thread::id> threads(3);
  device.Write(0, buffer.span(), [&](Result<uint64_t>) {
    threads[0] = std::this_thread::get_id();
    completed.fetch_add(1);
  });
  device.Read(0, buffer.span(), [&](Result<uint64_t>) {
    threads[1] = std::this_thread::get_id();
    completed.fetch_add(1);
  });
  device.Read(1, buffer.span(), [&](Result<uint64_t>) {  // an error, also not inline
    threads[2] = std::this_thread::get_id();
    completed.fetch_add(1);
  });
  EXPECT_EQ(completed.load(), 0);
  release.count_down();
  device.WaitIdle();
  EXPECT_EQ(completed.load(), 4);
  for (const std::thread::id& id : threads) {
    EXPECT_NE(id, std::this_thread::get_id());
    EXPECT_EQ(id, device.io_thread_id());
  }
}

TEST(MemoryDeviceTest, CompletesInIssueOrder) {
  MemoryDevice device(kDeviceBytes);
  AlignedBuffer buffer(kPage);
  std::vector<int> order;  // only the device thread touches it until WaitIdle
  for (int i = 0; i < 20; ++i) {
    if (i % 3 == 0) {
      device.Sync([&order, i](Result<uint64_t>) { order.push_back(i); });
    } else {
      device.Read(0, buffer.span(), [&order, i](Result<uint64_t>) { order.push_back(i); });
    }
  }
  device.WaitIdle();
  ASSERT_EQ(order.size(), 20u);
  for (int i = 0; i < 20; ++i) EXPECT_EQ(order[static_cast<size_t>(i)], i);
}

TEST(MemoryDeviceTest, DropUnsyncedRollsBackToTheLastSync) {
  MemoryDevice device(kDeviceBytes);
  AlignedBuffer a(kPage, 0xaa), b(2 * kPage, 0xbb), c(kPage, 0xcc);
  ExpectBytes(WriteAt(device, 0, a.span()), kPage);
  ExpectBytes(SyncNow(device), 0);
  // After the sync: overwrite page 0, write page 1 fresh.
  ExpectBytes(WriteAt(device, 0, b.span()), 2 * kPage);
  EXPECT_TRUE(AllEqual(device.raw().subspan(0, 2 * kPage), 0xbb));  // visible before the crash
  device.WaitIdle();
  device.DropUnsynced();
  EXPECT_TRUE(AllEqual(device.raw().subspan(0, kPage), 0xaa));
  EXPECT_TRUE(AllEqual(device.raw().subspan(kPage, kPage), 0));

  // A sync makes later writes survive; an unsynced one after it still does not.
  ExpectBytes(WriteAt(device, kPage, b.span(0, kPage)), kPage);
  ExpectBytes(SyncNow(device), 0);
  ExpectBytes(WriteAt(device, kPage, c.span()), kPage);
  device.WaitIdle();
  device.DropUnsynced();
  EXPECT_TRUE(AllEqual(device.raw().subspan(0, kPage), 0xaa));
  EXPECT_TRUE(AllEqual(device.raw().subspan(kPage, kPage), 0xbb));

  // Dropping twice, or with nothing written, changes nothing.
  device.DropUnsynced();
  EXPECT_TRUE(AllEqual(device.raw().subspan(kPage, kPage), 0xbb));
}

TEST(MemoryDeviceTest, RawEditsAreSeenByReads) {
  MemoryDevice device(kDeviceBytes);
  device.raw()[kPage + 7] = 0x42;
  AlignedBuffer buffer(kPage, 0xff);
  ExpectBytes(ReadAt(device, kPage, buffer.span()), kPage);
  EXPECT_EQ(buffer.span()[7], 0x42);
  EXPECT_EQ(buffer.span()[6], 0);
}

TEST(MemoryDeviceTest, DestructionCompletesQueuedOperations) {
  AlignedBuffer buffer(kPage);
  std::atomic<int> completed{0};
  {
    MemoryDevice device(kDeviceBytes);
    for (int i = 0; i < 50; ++i) {
      device.Write(0, buffer.span(), [&](Result<uint64_t>) { completed.fetch_add(1); });
    }
  }
  EXPECT_EQ(completed.load(), 50);
}

// ---- FaultyDevice ----

TEST(FaultyDeviceTest, PassesThroughWhenNothingIsArmed) {
  MemoryDevice memory(kDeviceBytes);
  FaultyDevice device(&memory);
  EXPECT_EQ(device.size_bytes(), kDeviceBytes);
  EXPECT_EQ(device.alignment(), kPage);
  EXPECT_EQ(device.name(), "faulty(memory)");
  AlignedBuffer data(kPage, 0x5a), back(kPage);
  ExpectBytes(WriteAt(device, 2 * kPage, data.span()), kPage);
  ExpectBytes(SyncNow(device), 0);
  EXPECT_EQ(memory.syncs(), 1u);
  ExpectBytes(ReadAt(device, 2 * kPage, back.span()), kPage);
  EXPECT_TRUE(AllEqual(back.span(), 0x5a));
  // Errors of the wrapped device come through as they are.
  ExpectErrno(ReadAt(device, 1, back.span()), StatusCode::kInvalidArgument, EINVAL);
  const FaultyDevice::Counters counters = device.counters();
  EXPECT_EQ(counters.failed_ops, 0u);
  EXPECT_EQ(counters.torn_writes, 0u);
  EXPECT_EQ(counters.bit_flips, 0u);
}

TEST(FaultyDeviceTest, FailNthKeepsTheErrnoAndTheOpNeverLands) {
  MemoryDevice memory(kDeviceBytes);
  FaultyDevice device(&memory);
  AlignedBuffer data(kPage, 0x77), back(kPage);
  device.FailNth(FaultOp::kWrite, 2, ENOSPC);
  ExpectBytes(ReadAt(device, 0, back.span()), kPage);             // reads do not count
  ExpectBytes(WriteAt(device, 0, data.span()), kPage);            // 1st write
  const Completion failed = WriteAt(device, kPage, data.span());  // 2nd write
  ExpectErrno(failed, StatusCode::kResourceExhausted, ENOSPC);
  EXPECT_NE(failed.thread, std::this_thread::get_id());
  EXPECT_TRUE(AllEqual(memory.raw().subspan(kPage, kPage), 0)) << "the failed write landed";
  ExpectBytes(WriteAt(device, 2 * kPage, data.span()), kPage);  // 3rd: fine again
  EXPECT_EQ(device.counters().failed_ops, 1u);

  device.FailNth(FaultOp::kRead, 1, EIO);
  ExpectErrno(ReadAt(device, 0, back.span()), StatusCode::kIoError, EIO);
  ExpectBytes(ReadAt(device, 0, back.span()), kPage);

  device.FailNth(FaultOp::kSync, 1, EIO);
  ExpectErrno(SyncNow(device), StatusCode::kIoError, EIO);
  EXPECT_EQ(memory.syncs(), 0u) << "the failed sync reached the device";
  ExpectBytes(SyncNow(device), 0);
  EXPECT_EQ(device.counters().failed_ops, 3u);
}

TEST(FaultyDeviceTest, FailNthAnyCountsEveryKind) {
  MemoryDevice memory(kDeviceBytes);
  FaultyDevice device(&memory);
  AlignedBuffer data(kPage);
  device.FailNth(FaultOp::kAny, 3, EROFS);
  ExpectBytes(ReadAt(device, 0, data.span()), kPage);
  ExpectBytes(SyncNow(device), 0);
  ExpectErrno(WriteAt(device, 0, data.span()), StatusCode::kIoError, EROFS);
  ExpectBytes(WriteAt(device, 0, data.span()), kPage);
}

TEST(FaultyDeviceTest, TornWriteLandsOnlyThePrefixAndReportsSuccess) {
  MemoryDevice memory(kDeviceBytes);
  FaultyDevice device(&memory);
  AlignedBuffer old_data(4 * kPage, 0x01), new_data(4 * kPage, 0x02);
  ExpectBytes(WriteAt(device, 0, old_data.span()), 4 * kPage);
  device.TornWriteNth(1, kPage);
  ExpectBytes(WriteAt(device, 0, new_data.span()), 4 * kPage);  // the lie
  EXPECT_TRUE(AllEqual(memory.raw().subspan(0, kPage), 0x02));
  EXPECT_TRUE(AllEqual(memory.raw().subspan(kPage, 3 * kPage), 0x01)) << "the tail must stay old";
  EXPECT_EQ(device.counters().torn_writes, 1u);

  // Nothing at all lands with keep_bytes 0; the second write from now is hit.
  device.TornWriteNth(2, 0);
  ExpectBytes(WriteAt(device, 4 * kPage, new_data.span(0, kPage)), kPage);
  const Completion torn = WriteAt(device, 8 * kPage, new_data.span(0, kPage));
  ExpectBytes(torn, kPage);
  EXPECT_NE(torn.thread, std::this_thread::get_id());
  EXPECT_TRUE(AllEqual(memory.raw().subspan(4 * kPage, kPage), 0x02));
  EXPECT_TRUE(AllEqual(memory.raw().subspan(8 * kPage, kPage), 0));
  EXPECT_EQ(device.counters().torn_writes, 2u);

  // A write the device rejects is not torn into one it would accept.
  device.TornWriteNth(1, kPage);
  ExpectErrno(WriteAt(device, kDeviceBytes - kPage, new_data.span(0, 2 * kPage)),
              StatusCode::kInvalidArgument, EINVAL);
  EXPECT_EQ(device.counters().torn_writes, 2u);
}

TEST(FaultyDeviceTest, FailureWinsOverATornWriteOnTheSameWrite) {
  MemoryDevice memory(kDeviceBytes);
  FaultyDevice device(&memory);
  AlignedBuffer data(2 * kPage, 0x09);
  device.TornWriteNth(1, kPage);
  device.FailNth(FaultOp::kWrite, 1, EIO);
  ExpectErrno(WriteAt(device, 0, data.span()), StatusCode::kIoError, EIO);
  ExpectBytes(WriteAt(device, 0, data.span()), 2 * kPage);  // both rules used up
  EXPECT_TRUE(AllEqual(memory.raw().subspan(0, 2 * kPage), 0x09));
  EXPECT_EQ(device.counters().torn_writes, 0u);
}

TEST(FaultyDeviceTest, BitFlipOnReadFlipsExactlyThatBit) {
  MemoryDevice memory(kDeviceBytes);
  FaultyDevice device(&memory);
  for (uint64_t i = 0; i < kDeviceBytes; ++i) memory.raw()[i] = static_cast<uint8_t>(i * 31);
  constexpr uint64_t kTarget = 5 * kPage + 100;
  device.BitFlipOnRead(kTarget, 3);

  AlignedBuffer buffer(2 * kPage);
  ExpectBytes(ReadAt(device, 4 * kPage, buffer.span()), 2 * kPage);
  for (uint64_t i = 0; i < 2 * kPage; ++i) {
    const uint8_t stored = memory.raw()[4 * kPage + i];
    const uint8_t expected = 4 * kPage + i == kTarget ? stored ^ 0x08 : stored;
    ASSERT_EQ(buffer.span()[i], expected) << "byte " << i;
  }
  EXPECT_EQ(memory.raw()[kTarget], static_cast<uint8_t>(kTarget * 31)) << "the medium changed";
  EXPECT_EQ(device.counters().bit_flips, 1u);

  // A read that does not cover the byte is untouched; the flip persists.
  ExpectBytes(ReadAt(device, 6 * kPage, buffer.span()), 2 * kPage);
  EXPECT_TRUE(
      std::equal(buffer.span().begin(), buffer.span().end(), memory.raw().begin() + 6 * kPage));
  ExpectBytes(ReadAt(device, 5 * kPage, buffer.span(0, kPage)), kPage);
  EXPECT_EQ(buffer.span()[100], memory.raw()[kTarget] ^ 0x08);
  EXPECT_EQ(device.counters().bit_flips, 2u);

  device.ClearFaults();
  ExpectBytes(ReadAt(device, 5 * kPage, buffer.span(0, kPage)), kPage);
  EXPECT_EQ(buffer.span()[100], memory.raw()[kTarget]);
}

}  // namespace
}  // namespace kvtier
