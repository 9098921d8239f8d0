// OpFences, the client's side of the copy fences: a cancelled op's copy in
// progress holds Cancel until it leaves the fence, or until the daemon
// process that entered it has exited (kill -9 in the middle of a copy):
// then no copy of the op can run, and the engine may reuse its blocks at
// once instead of after call_timeout. The "daemon" here is a forked child
// that enters the fence on the shared page and never leaves it.
#include "client/op_fences.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <memory>
#include <string>

#include "common/memory_mapping.h"
#include "common/op_fence.h"

namespace kvtier {
namespace {

using std::chrono::milliseconds;
using std::chrono::steady_clock;

class OpFencesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    fences_ = OpFences::Create().value();
    fence_ = fences_->Open(nullptr);
    // The "daemon" listens on an abstract socket, as kvtierd does on its
    // path: a socket connected to it names it (PeerProcess), as the client
    // library's does kvtierd.
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    const std::string name = "kvtier-op-fences-test-" + std::to_string(::getpid());
    std::memcpy(addr.sun_path + 1, name.data(), name.size());
    const auto addr_len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
    int ready[2];
    ASSERT_EQ(::pipe(ready), 0);
    child_ = ::fork();
    ASSERT_GE(child_, 0);
    if (child_ == 0) {
      ::close(ready[0]);
      const int listener = ::socket(AF_UNIX, SOCK_SEQPACKET, 0);
      if (listener < 0 || ::bind(listener, reinterpret_cast<sockaddr*>(&addr), addr_len) != 0 ||
          ::listen(listener, 1) != 0) {
        ::_exit(5);
      }
      Result<MemoryMapping> m = MemoryMapping::Map(MemoryMapping::Options{
          .size_bytes = FencePage::kBytes, .prot = PROT_READ | PROT_WRITE, .flags = MAP_SHARED, .fd = fences_->fd()});
      if (!m) ::_exit(2);
      FencePage page(std::move(*m));
      if (!page.Enter(fence_.slot, fence_.generation)) ::_exit(3);
      const char one = 1;
      if (::write(ready[1], &one, 1) != 1) ::_exit(4);
      while (true) ::pause();  // in the middle of a copy, for good
    }
    ::close(ready[1]);
    char c = 0;
    ASSERT_EQ(::read(ready[0], &c, 1), 1) << "the child never entered the fence";
    ::close(ready[0]);
    socket_ = UniqueFd(::socket(AF_UNIX, SOCK_SEQPACKET, 0));
    ASSERT_EQ(::connect(socket_.get(), reinterpret_cast<sockaddr*>(&addr), addr_len), 0);
  }
  void TearDown() override {
    if (child_ > 0) {
      ::kill(child_, SIGKILL);
      ::waitpid(child_, nullptr, 0);
    }
  }

  std::unique_ptr<OpFences> fences_;
  OpFences::Fence fence_;
  pid_t child_ = -1;
  UniqueFd socket_;
};

TEST_F(OpFencesTest, ACopyInProgressHoldsCancelUntilItsDaemonHasExited) {
  std::shared_ptr<const UniqueFd> daemon = OpFences::PeerProcess(socket_.get());
  ASSERT_NE(daemon, nullptr) << "no pidfd for the socket's peer";
  OpFences::Fence fence = fence_;
  fence.daemon = daemon;
  // The daemon lives, inside the copy: not quiet.
  EXPECT_FALSE(fences_->Cancel(fence, steady_clock::now() + milliseconds(100)));
  // Killed in the middle of it: no copy can run now.
  ASSERT_EQ(::kill(child_, SIGKILL), 0);
  const auto start = steady_clock::now();
  EXPECT_TRUE(fences_->Cancel(fence, steady_clock::now() + milliseconds(10000)));
  EXPECT_LT(steady_clock::now() - start, milliseconds(2000));
}

TEST_F(OpFencesTest, WithoutAPidfdOnlyTheFenceWordCounts) {
  ASSERT_EQ(::kill(child_, SIGKILL), 0);
  ::waitpid(child_, nullptr, 0);
  child_ = -1;
  // Nothing says that the process is gone: Cancel waits out its deadline.
  EXPECT_FALSE(fences_->Cancel(fence_, steady_clock::now() + milliseconds(200)));
}

// What a GPU stream's wait on a progress word (cuStreamWaitValue64 with
// CU_STREAM_WAIT_VALUE_GEQ) lets through: a cyclic compare of the words.
bool StreamWaitPasses(OpFences& fences, const OpFences::Fence& fence, uint32_t layers) {
  const uint64_t word =
      std::atomic_ref<const uint64_t>(fences.progress_words()[fence.slot]).load(std::memory_order_acquire);
  return static_cast<int64_t>(word - OpFences::ProgressTarget(fence, layers)) >= 0;
}

// A GPU stream waiting for a load's layers (Client::StreamWaitLayers) goes
// on once they are in place, or once the op is over, cancelled or its slot
// serves a later op, and never before: no stream of the engine waits
// forever on a word nobody will raise, or reads a layer not yet there.
TEST(OpFencesLayerWaitTest, AStreamsWaitPassesOnceTheLayersAreInPlaceOrTheOpIsOver) {
  std::unique_ptr<OpFences> fences = OpFences::Create().value();
  MemoryMapping m = MemoryMapping::Map(MemoryMapping::Options{.size_bytes = FencePage::kBytes,
                                                              .prot = PROT_READ | PROT_WRITE,
                                                              .flags = MAP_SHARED,
                                                              .fd = fences->fd()})
                        .value();
  FencePage daemon(std::move(m));  // the daemon's view of the page

  const OpFences::Fence load = fences->Open(nullptr, /*by_layer=*/true);
  EXPECT_FALSE(StreamWaitPasses(*fences, load, 1));
  daemon.Progress(load.slot, load.generation, 2, /*over=*/false);
  EXPECT_TRUE(StreamWaitPasses(*fences, load, 1));
  EXPECT_TRUE(StreamWaitPasses(*fences, load, 2));
  EXPECT_FALSE(StreamWaitPasses(*fences, load, 3));
  // Over with 2 layers (a failed load): every later layer's wait goes on,
  // and the engine learns from Wait that the blocks did not all arrive.
  daemon.Progress(load.slot, load.generation, 2, /*over=*/true);
  EXPECT_TRUE(StreamWaitPasses(*fences, load, 3));
  EXPECT_TRUE(StreamWaitPasses(*fences, load, 1u << 30));

  // Cancelled by the client with no copy in progress: over.
  const OpFences::Fence cancelled = fences->Open(nullptr, /*by_layer=*/true);
  daemon.Progress(cancelled.slot, cancelled.generation, 1, /*over=*/false);
  EXPECT_FALSE(StreamWaitPasses(*fences, cancelled, 2));
  EXPECT_TRUE(fences->Cancel(cancelled, steady_clock::now() + milliseconds(1000)));
  EXPECT_TRUE(StreamWaitPasses(*fences, cancelled, 2));

  // A copy still in progress keeps the stream waiting past a Cancel that
  // gave up: its blocks are not safe to read.
  const OpFences::Fence hung = fences->Open(nullptr, /*by_layer=*/true);
  ASSERT_TRUE(daemon.Enter(hung.slot, hung.generation));
  EXPECT_FALSE(fences->Cancel(hung, steady_clock::now() + milliseconds(50)));
  EXPECT_FALSE(StreamWaitPasses(*fences, hung, 1));
  daemon.Leave(hung.slot, hung.generation);
  EXPECT_TRUE(fences->Cancel(hung, steady_clock::now() + milliseconds(1000)));
  EXPECT_TRUE(StreamWaitPasses(*fences, hung, 1));

  // The client going away ends every open op's waits.
  const OpFences::Fence open = fences->Open(nullptr, /*by_layer=*/true);
  EXPECT_FALSE(StreamWaitPasses(*fences, open, 1));
  fences->EndLayerWaits();
  EXPECT_TRUE(StreamWaitPasses(*fences, open, 1));

  // Every slot opened again for later ops: a wait for the first op's slot
  // that the GPU has not looked at yet goes on too.
  const OpFences::Fence first = fences->Open(nullptr, /*by_layer=*/true);
  fences->Close(first);
  OpFences::Fence later = fences->Open(nullptr, /*by_layer=*/true);
  for (uint32_t i = 0; i < FencePage::kSlots && later.slot != first.slot; ++i) {
    fences->Close(later);
    later = fences->Open(nullptr, /*by_layer=*/true);
  }
  ASSERT_EQ(later.slot, first.slot);
  EXPECT_TRUE(StreamWaitPasses(*fences, first, 1));
  EXPECT_FALSE(StreamWaitPasses(*fences, later, 1));
}

// The progress word keeps the low 32 bits of a generation: across their
// wrap, a later op's word still passes an earlier op's wait (the compare
// is cyclic), and an earlier op's word never passes a later op's.
TEST(OpFencesLayerWaitTest, TheCompareHoldsAcrossTheGenerationsWrap) {
  const uint64_t before_wrap = (uint64_t{1} << 32) - 1;
  for (const uint64_t g : {uint64_t{1}, before_wrap, before_wrap + 1, uint64_t{7} << 40}) {
    const uint64_t later_word = FencePage::ProgressTarget(g + 1, 0);
    EXPECT_GE(static_cast<int64_t>(later_word - FencePage::ProgressTarget(g, 1u << 30)), 0) << g;
    EXPECT_LT(static_cast<int64_t>(FencePage::ProgressTarget(g, 5) - FencePage::ProgressTarget(g + 1, 1)), 0) << g;
    // Over (bit 31) passes any layer count of the same op.
    EXPECT_GE(static_cast<int64_t>((FencePage::ProgressTarget(g, 0) | FencePage::kOver) -
                                   FencePage::ProgressTarget(g, FencePage::kLayersMask)),
              0)
        << g;
  }
}

}  // namespace
}  // namespace kvtier
