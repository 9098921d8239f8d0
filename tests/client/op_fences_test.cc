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

}  // namespace
}  // namespace kvtier
