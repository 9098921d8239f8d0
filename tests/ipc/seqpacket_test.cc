#include "ipc/seqpacket.h"

#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <system_error>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>

namespace kvtier::ipc {
namespace {

std::vector<uint8_t> Bytes(size_t size, uint8_t seed) {
  std::vector<uint8_t> out(size);
  for (size_t i = 0; i < size; ++i) out[i] = static_cast<uint8_t>(seed + i * 7);
  return out;
}

bool FdIsOpen(int fd) { return ::fcntl(fd, F_GETFD) != -1 || errno != EBADF; }

// Number of open descriptors, or -1 without /proc. The directory's own
// descriptor is counted every time, so differences are exact.
int CountOpenFds() {
  std::error_code ec;
  std::filesystem::directory_iterator it("/proc/self/fd", ec);
  if (ec) return -1;
  return static_cast<int>(std::distance(it, std::filesystem::directory_iterator()));
}

// A memfd holding `contents`.
UniqueFd MakeMemfd(const std::string& contents) {
  UniqueFd fd(::memfd_create("kvtier-seqpacket-test", MFD_CLOEXEC));
  EXPECT_TRUE(fd.valid()) << std::strerror(errno);
  if (!fd.valid()) return fd;
  EXPECT_EQ(::write(fd.get(), contents.data(), contents.size()),
            static_cast<ssize_t>(contents.size()));
  return fd;
}

// Reads the whole file behind `fd` from offset 0 (pread: the offset is shared
// with the sender's descriptor and sits at the end after its write).
std::string ReadAll(int fd) {
  std::string out(4096, '\0');
  const ssize_t n = ::pread(fd, out.data(), out.size(), 0);
  EXPECT_GE(n, 0) << std::strerror(errno);
  out.resize(n < 0 ? 0 : static_cast<size_t>(n));
  return out;
}

// Sends with raw sendmsg, to do what SendMessage refuses (too many fds).
ssize_t RawSendWithFds(int fd, std::span<const uint8_t> bytes, const std::vector<int>& fds) {
  iovec iov{};
  iov.iov_base = const_cast<uint8_t*>(bytes.data());
  iov.iov_len = bytes.size();
  std::vector<unsigned char> control(CMSG_SPACE(sizeof(int) * fds.size()));
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control.data();
  msg.msg_controllen = control.size();
  cmsghdr* cmsg = CMSG_FIRSTHDR(&msg);
  cmsg->cmsg_level = SOL_SOCKET;
  cmsg->cmsg_type = SCM_RIGHTS;
  cmsg->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
  std::memcpy(CMSG_DATA(cmsg), fds.data(), sizeof(int) * fds.size());
  return ::sendmsg(fd, &msg, MSG_NOSIGNAL);
}

class SeqpacketTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/kvtier-ipc-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr) << std::strerror(errno);
    dir_ = tmpl;
    path_ = dir_ + "/kvtier.sock";
  }
  void TearDown() override {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
    EXPECT_FALSE(ec) << ec.message();
  }

  // A connected pair through a real listener: `client` blocking, `server`
  // non-blocking, as the daemon and libkvtier get them.
  struct Pair {
    UniqueFd listener;
    UniqueFd client;
    UniqueFd server;
  };
  Pair MakePair() {
    Pair p;
    Result<UniqueFd> listener = Listen(path_, 0600);
    EXPECT_TRUE(listener.has_value()) << listener.error();
    if (!listener) return p;
    p.listener = std::move(*listener);
    Result<UniqueFd> client = Connect(path_);
    EXPECT_TRUE(client.has_value()) << client.error();
    if (!client) return p;
    p.client = std::move(*client);
    // A unix connect completes synchronously, so the connection is queued.
    Result<UniqueFd> server = Accept(p.listener.get());
    EXPECT_TRUE(server.has_value()) << server.error();
    if (!server) return p;
    p.server = std::move(*server);
    EXPECT_TRUE(p.server.valid());
    return p;
  }

  std::string dir_;
  std::string path_;
};

TEST_F(SeqpacketTest, RoundTripKeepsMessageBoundaries) {
  Pair p = MakePair();
  ASSERT_TRUE(p.server.valid());
  const std::vector<std::vector<uint8_t>> messages = {Bytes(1, 1), Bytes(1000, 2), Bytes(60000, 3)};
  for (const auto& m : messages) ASSERT_TRUE(SendMessage(p.client.get(), m).ok());
  for (const auto& m : messages) {
    Result<ReceivedMessage> r = ReceiveMessage(p.server.get(), 64 * 1024);
    ASSERT_TRUE(r.has_value()) << r.error();
    EXPECT_FALSE(r->truncated);
    EXPECT_FALSE(r->eof);
    EXPECT_TRUE(r->fds.empty());
    EXPECT_EQ(r->bytes, m);
  }
  // Exactly three: nothing else is queued.
  Result<ReceivedMessage> none = ReceiveMessage(p.server.get(), 64 * 1024);
  ASSERT_FALSE(none.has_value());
  EXPECT_EQ(none.error().code(), StatusCode::kUnavailable);

  // And the other direction, server to client.
  const std::vector<uint8_t> reply = Bytes(17, 9);
  ASSERT_TRUE(SendMessage(p.server.get(), reply).ok());
  Result<ReceivedMessage> r = ReceiveMessage(p.client.get(), 100);
  ASSERT_TRUE(r.has_value()) << r.error();
  EXPECT_EQ(r->bytes, reply);
}

TEST_F(SeqpacketTest, MessageOfExactlyMaxBytesIsNotTruncated) {
  Pair p = MakePair();
  ASSERT_TRUE(p.server.valid());
  const std::vector<uint8_t> m = Bytes(256, 4);
  ASSERT_TRUE(SendMessage(p.client.get(), m).ok());
  Result<ReceivedMessage> r = ReceiveMessage(p.server.get(), 256);
  ASSERT_TRUE(r.has_value()) << r.error();
  EXPECT_FALSE(r->truncated);
  EXPECT_EQ(r->bytes, m);
}

TEST_F(SeqpacketTest, LargerMessageIsTruncatedAndNextOneIsIntact) {
  Pair p = MakePair();
  ASSERT_TRUE(p.server.valid());
  const std::vector<uint8_t> big = Bytes(257, 5);
  const std::vector<uint8_t> next = Bytes(10, 6);
  ASSERT_TRUE(SendMessage(p.client.get(), big).ok());
  ASSERT_TRUE(SendMessage(p.client.get(), next).ok());

  Result<ReceivedMessage> r = ReceiveMessage(p.server.get(), 256);
  ASSERT_TRUE(r.has_value()) << r.error();
  EXPECT_TRUE(r->truncated);
  EXPECT_FALSE(r->eof);
  EXPECT_LE(r->bytes.size(), 256u);

  // SEQPACKET discards the rest of a truncated message: no desync.
  Result<ReceivedMessage> r2 = ReceiveMessage(p.server.get(), 256);
  ASSERT_TRUE(r2.has_value()) << r2.error();
  EXPECT_FALSE(r2->truncated);
  EXPECT_EQ(r2->bytes, next);
}

TEST_F(SeqpacketTest, ZeroMaxBytesReportsTruncationNotEof) {
  Pair p = MakePair();
  ASSERT_TRUE(p.server.valid());
  ASSERT_TRUE(SendMessage(p.client.get(), Bytes(3, 1)).ok());
  Result<ReceivedMessage> r = ReceiveMessage(p.server.get(), 0);
  ASSERT_TRUE(r.has_value()) << r.error();
  EXPECT_TRUE(r->truncated);
  EXPECT_FALSE(r->eof);
}

TEST_F(SeqpacketTest, PassesOneDescriptor) {
  Pair p = MakePair();
  ASSERT_TRUE(p.server.valid());
  UniqueFd memfd = MakeMemfd("hello through SCM_RIGHTS");
  ASSERT_TRUE(memfd.valid());
  const int fds[] = {memfd.get()};
  ASSERT_TRUE(SendMessage(p.client.get(), Bytes(8, 1), fds).ok());
  // The sender keeps its descriptor.
  EXPECT_TRUE(FdIsOpen(memfd.get()));

  Result<ReceivedMessage> r = ReceiveMessage(p.server.get(), 64);
  ASSERT_TRUE(r.has_value()) << r.error();
  EXPECT_FALSE(r->truncated);
  EXPECT_EQ(r->bytes, Bytes(8, 1));
  ASSERT_EQ(r->fds.size(), 1u);
  ASSERT_TRUE(r->fds[0].valid());
  EXPECT_NE(r->fds[0].get(), memfd.get());
  EXPECT_EQ(ReadAll(r->fds[0].get()), "hello through SCM_RIGHTS");
  // MSG_CMSG_CLOEXEC took effect.
  EXPECT_EQ(::fcntl(r->fds[0].get(), F_GETFD) & FD_CLOEXEC, FD_CLOEXEC);
}

TEST_F(SeqpacketTest, PassesSeveralDescriptorsInOrder) {
  Pair p = MakePair();
  ASSERT_TRUE(p.server.valid());
  std::vector<UniqueFd> memfds;
  std::vector<int> raw;
  for (size_t i = 0; i < kMaxFdsPerMessage; ++i) {
    memfds.push_back(MakeMemfd("file " + std::to_string(i)));
    ASSERT_TRUE(memfds.back().valid());
    raw.push_back(memfds.back().get());
  }
  ASSERT_TRUE(SendMessage(p.client.get(), Bytes(4, 2), raw).ok());

  Result<ReceivedMessage> r = ReceiveMessage(p.server.get(), 64);
  ASSERT_TRUE(r.has_value()) << r.error();
  EXPECT_FALSE(r->truncated);
  ASSERT_EQ(r->fds.size(), kMaxFdsPerMessage);
  for (size_t i = 0; i < kMaxFdsPerMessage; ++i) {
    EXPECT_EQ(ReadAll(r->fds[i].get()), "file " + std::to_string(i));
  }
}

TEST_F(SeqpacketTest, TooManyDescriptorsIsTruncatedWithoutLeak) {
  const int before = CountOpenFds();
  if (before < 0) GTEST_SKIP() << "/proc/self/fd is not available";
  {
    Pair p = MakePair();
    ASSERT_TRUE(p.server.valid());
    std::vector<UniqueFd> memfds;
    std::vector<int> raw;
    for (size_t i = 0; i < kMaxFdsPerMessage + 4; ++i) {
      memfds.push_back(MakeMemfd("x"));
      ASSERT_TRUE(memfds.back().valid());
      raw.push_back(memfds.back().get());
    }
    const std::vector<uint8_t> m = Bytes(5, 3);
    ASSERT_EQ(RawSendWithFds(p.client.get(), m, raw), 5) << std::strerror(errno);
    // The sender's copies are not needed in flight: the message holds its own
    // references, and they must not hide a leak on the receiving side.
    memfds.clear();
    const int in_flight = CountOpenFds();

    Result<ReceivedMessage> r = ReceiveMessage(p.server.get(), 64);
    ASSERT_TRUE(r.has_value()) << r.error();
    EXPECT_TRUE(r->truncated);  // MSG_CTRUNC
    EXPECT_EQ(r->bytes, m);
    EXPECT_LE(r->fds.size(), kMaxFdsPerMessage);
    // Exactly what was taken is open; the kernel dropped the excess.
    EXPECT_EQ(CountOpenFds(), in_flight + static_cast<int>(r->fds.size()));
  }
  EXPECT_EQ(CountOpenFds(), before);
}

TEST_F(SeqpacketTest, ReceivedDescriptorsCloseWhenMessageIsDropped) {
  Pair p = MakePair();
  ASSERT_TRUE(p.server.valid());
  UniqueFd a = MakeMemfd("a");
  UniqueFd b = MakeMemfd("b");
  const int fds[] = {a.get(), b.get()};
  ASSERT_TRUE(SendMessage(p.client.get(), Bytes(1, 0), fds).ok());
  const int before = CountOpenFds();

  std::vector<int> received;
  {
    Result<ReceivedMessage> r = ReceiveMessage(p.server.get(), 64);
    ASSERT_TRUE(r.has_value()) << r.error();
    ASSERT_EQ(r->fds.size(), 2u);
    for (const UniqueFd& fd : r->fds) {
      received.push_back(fd.get());
      EXPECT_TRUE(FdIsOpen(fd.get()));
    }
  }
  for (int fd : received) EXPECT_FALSE(FdIsOpen(fd)) << fd;
  if (before >= 0) {
    EXPECT_EQ(CountOpenFds(), before);
  }
}

TEST_F(SeqpacketTest, EofAfterPeerCloses) {
  Pair p = MakePair();
  ASSERT_TRUE(p.server.valid());
  p.client.Reset();
  Result<ReceivedMessage> r = ReceiveMessage(p.server.get(), 64);
  ASSERT_TRUE(r.has_value()) << r.error();
  EXPECT_TRUE(r->eof);
  EXPECT_FALSE(r->truncated);
  EXPECT_TRUE(r->bytes.empty());
  // EOF is sticky.
  Result<ReceivedMessage> again = ReceiveMessage(p.server.get(), 64);
  ASSERT_TRUE(again.has_value()) << again.error();
  EXPECT_TRUE(again->eof);
}

TEST_F(SeqpacketTest, MessagesSentBeforeCloseArriveBeforeEof) {
  Pair p = MakePair();
  ASSERT_TRUE(p.server.valid());
  ASSERT_TRUE(SendMessage(p.client.get(), Bytes(3, 7)).ok());
  p.client.Reset();
  Result<ReceivedMessage> r = ReceiveMessage(p.server.get(), 64);
  ASSERT_TRUE(r.has_value()) << r.error();
  EXPECT_FALSE(r->eof);
  EXPECT_EQ(r->bytes, Bytes(3, 7));
  Result<ReceivedMessage> r2 = ReceiveMessage(p.server.get(), 64);
  ASSERT_TRUE(r2.has_value()) << r2.error();
  EXPECT_TRUE(r2->eof);
}

TEST_F(SeqpacketTest, PeerClosingWithUnreadDataIsEof) {
  Pair p = MakePair();
  ASSERT_TRUE(p.server.valid());
  // The server never reads this; closing it then resets the client (ECONNRESET).
  ASSERT_TRUE(SendMessage(p.client.get(), Bytes(3, 1)).ok());
  p.server.Reset();
  Result<ReceivedMessage> r = ReceiveMessage(p.client.get(), 64);
  ASSERT_TRUE(r.has_value()) << r.error();
  EXPECT_TRUE(r->eof);
  EXPECT_TRUE(r->bytes.empty());
}

TEST_F(SeqpacketTest, LastMessageBeforeResetIsNotLost) {
  Pair p = MakePair();
  ASSERT_TRUE(p.server.valid());
  // The daemon's pattern for a bad client: reply with an error, then close,
  // while the client's next request sits unread. Linux reports ECONNRESET
  // ahead of the reply; the reply must still arrive, then EOF.
  ASSERT_TRUE(SendMessage(p.client.get(), Bytes(3, 1)).ok());
  const std::vector<uint8_t> reply = Bytes(9, 2);
  ASSERT_TRUE(SendMessage(p.server.get(), reply).ok());
  p.server.Reset();
  Result<ReceivedMessage> r = ReceiveMessage(p.client.get(), 64);
  ASSERT_TRUE(r.has_value()) << r.error();
  EXPECT_FALSE(r->eof);
  EXPECT_EQ(r->bytes, reply);
  Result<ReceivedMessage> r2 = ReceiveMessage(p.client.get(), 64);
  ASSERT_TRUE(r2.has_value()) << r2.error();
  EXPECT_TRUE(r2->eof);
}

TEST_F(SeqpacketTest, ZeroLengthMessageReadsAsEof) {
  Pair p = MakePair();
  ASSERT_TRUE(p.server.valid());
  // Documented ambiguity: an empty message cannot be told from a shutdown,
  // which is why SendMessage refuses to send one.
  ASSERT_EQ(::send(p.client.get(), "", 0, MSG_NOSIGNAL), 0) << std::strerror(errno);
  Result<ReceivedMessage> r = ReceiveMessage(p.server.get(), 64);
  ASSERT_TRUE(r.has_value()) << r.error();
  EXPECT_TRUE(r->eof);
}

TEST_F(SeqpacketTest, SendRefusesEmptyMessage) {
  Pair p = MakePair();
  ASSERT_TRUE(p.server.valid());
  const Status s = SendMessage(p.client.get(), {});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
}

TEST_F(SeqpacketTest, SendToClosedPeerIsEpipeNotSignal) {
  Pair p = MakePair();
  ASSERT_TRUE(p.server.valid());
  p.server.Reset();
  // Block SIGPIPE so that one raised would stay pending for us to see instead
  // of killing the test binary.
  sigset_t pipe_set;
  sigemptyset(&pipe_set);
  sigaddset(&pipe_set, SIGPIPE);
  sigset_t old_set;
  ASSERT_EQ(::pthread_sigmask(SIG_BLOCK, &pipe_set, &old_set), 0);
  const Status s = SendMessage(p.client.get(), Bytes(3, 1));
  sigset_t pending;
  sigemptyset(&pending);
  ASSERT_EQ(::sigpending(&pending), 0);
  const bool got_sigpipe = sigismember(&pending, SIGPIPE) == 1;
  if (got_sigpipe) {
    const timespec zero{};
    ::sigtimedwait(&pipe_set, nullptr, &zero);  // Consume it before unblocking.
  }
  ASSERT_EQ(::pthread_sigmask(SIG_SETMASK, &old_set, nullptr), 0);

  EXPECT_FALSE(got_sigpipe);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.source(), ErrorSource::kErrno);
  EXPECT_EQ(s.raw_code(), EPIPE) << s;
}

TEST_F(SeqpacketTest, NonblockingReceiveWithNothingPendingIsUnavailable) {
  Pair p = MakePair();
  ASSERT_TRUE(p.server.valid());
  Result<ReceivedMessage> r = ReceiveMessage(p.server.get(), 64);
  ASSERT_FALSE(r.has_value());
  EXPECT_EQ(r.error().code(), StatusCode::kUnavailable) << r.error();
  EXPECT_EQ(r.error().raw_code(), EAGAIN);
}

TEST_F(SeqpacketTest, NonblockingSendWhenFullIsUnavailable) {
  Pair p = MakePair();
  ASSERT_TRUE(p.server.valid());
  const std::vector<uint8_t> m = Bytes(4096, 1);
  Status s;
  // The send buffer is a few hundred KiB; the bound only guards against a hang.
  for (int i = 0; i < 100000 && s.ok(); ++i) s = SendMessage(p.server.get(), m);
  ASSERT_FALSE(s.ok()) << "send buffer never filled";
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s;
  EXPECT_EQ(s.raw_code(), EAGAIN);
}

TEST_F(SeqpacketTest, SocketsAreCloexecAndListenerAndAcceptedAreNonblocking) {
  Pair p = MakePair();
  ASSERT_TRUE(p.server.valid());
  for (int fd : {p.listener.get(), p.client.get(), p.server.get()}) {
    EXPECT_EQ(::fcntl(fd, F_GETFD) & FD_CLOEXEC, FD_CLOEXEC) << fd;
    int type = 0;
    socklen_t len = sizeof(type);
    ASSERT_EQ(::getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &len), 0);
    EXPECT_EQ(type, SOCK_SEQPACKET);
  }
  EXPECT_NE(::fcntl(p.listener.get(), F_GETFL) & O_NONBLOCK, 0);
  EXPECT_NE(::fcntl(p.server.get(), F_GETFL) & O_NONBLOCK, 0);
  EXPECT_EQ(::fcntl(p.client.get(), F_GETFL) & O_NONBLOCK, 0);
}

TEST_F(SeqpacketTest, AcceptWithNothingPendingReturnsInvalidFd) {
  Result<UniqueFd> listener = Listen(path_, 0600);
  ASSERT_TRUE(listener.has_value()) << listener.error();
  Result<UniqueFd> accepted = Accept(listener->get());
  ASSERT_TRUE(accepted.has_value()) << accepted.error();
  EXPECT_FALSE(accepted->valid());
}

TEST_F(SeqpacketTest, AcceptOnNonListeningSocketIsError) {
  Pair p = MakePair();
  ASSERT_TRUE(p.server.valid());
  Result<UniqueFd> accepted = Accept(p.server.get());
  ASSERT_FALSE(accepted.has_value());
  EXPECT_EQ(accepted.error().raw_code(), EINVAL) << accepted.error();
}

TEST_F(SeqpacketTest, PeerCredentialsAreOurs) {
  Pair p = MakePair();
  ASSERT_TRUE(p.server.valid());
  for (int fd : {p.server.get(), p.client.get()}) {
    Result<PeerCredentials> cred = GetPeerCredentials(fd);
    ASSERT_TRUE(cred.has_value()) << cred.error();
    EXPECT_EQ(cred->pid, ::getpid());
    EXPECT_EQ(cred->uid, ::getuid());
    EXPECT_EQ(cred->gid, ::getgid());
  }
}

TEST_F(SeqpacketTest, PeerCredentialsOfNonSocketIsError) {
  UniqueFd memfd = MakeMemfd("");
  ASSERT_TRUE(memfd.valid());
  Result<PeerCredentials> cred = GetPeerCredentials(memfd.get());
  ASSERT_FALSE(cred.has_value());
  EXPECT_EQ(cred.error().raw_code(), ENOTSOCK);
}

TEST_F(SeqpacketTest, StaleSocketFileIsReplaced) {
  {
    Result<UniqueFd> old = Listen(path_, 0600);
    ASSERT_TRUE(old.has_value()) << old.error();
  }  // The "crashed daemon": its socket file stays behind.
  ASSERT_TRUE(std::filesystem::is_socket(path_));
  Result<UniqueFd> stale = Connect(path_);
  ASSERT_FALSE(stale.has_value());
  EXPECT_EQ(stale.error().code(), StatusCode::kUnavailable);
  EXPECT_EQ(stale.error().raw_code(), ECONNREFUSED);

  Result<UniqueFd> listener = Listen(path_, 0600);
  ASSERT_TRUE(listener.has_value()) << listener.error();
  Result<UniqueFd> client = Connect(path_);
  ASSERT_TRUE(client.has_value()) << client.error();
  Result<UniqueFd> server = Accept(listener->get());
  ASSERT_TRUE(server.has_value()) << server.error();
  EXPECT_TRUE(server->valid());
}

TEST_F(SeqpacketTest, LiveListenerIsAlreadyExistsAndKeepsWorking) {
  Result<UniqueFd> live = Listen(path_, 0600);
  ASSERT_TRUE(live.has_value()) << live.error();

  Result<UniqueFd> second = Listen(path_, 0600);
  ASSERT_FALSE(second.has_value());
  EXPECT_EQ(second.error().code(), StatusCode::kAlreadyExists) << second.error();
  EXPECT_NE(second.error().message().find(path_), std::string::npos) << second.error();

  // The live daemon first sees the probe, which hangs up at once...
  Result<UniqueFd> probe = Accept(live->get());
  ASSERT_TRUE(probe.has_value()) << probe.error();
  ASSERT_TRUE(probe->valid());
  Result<ReceivedMessage> r = ReceiveMessage(probe->get(), 64);
  ASSERT_TRUE(r.has_value()) << r.error();
  EXPECT_TRUE(r->eof);

  // ...and its socket file is still there and still works.
  Result<UniqueFd> client = Connect(path_);
  ASSERT_TRUE(client.has_value()) << client.error();
  Result<UniqueFd> server = Accept(live->get());
  ASSERT_TRUE(server.has_value()) << server.error();
  EXPECT_TRUE(server->valid());
}

TEST_F(SeqpacketTest, LiveListenerWithFullBacklogIsAlreadyExists) {
  Result<UniqueFd> live = Listen(path_, 0600, /*backlog=*/0);
  ASSERT_TRUE(live.has_value()) << live.error();
  // Fill the backlog with non-blocking connects until the kernel says EAGAIN.
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path_.data(), path_.size());
  std::vector<UniqueFd> pending;
  bool full = false;
  for (int i = 0; i < 64 && !full; ++i) {
    UniqueFd fd(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
    ASSERT_TRUE(fd.valid());
    if (::connect(fd.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) == 0) {
      pending.push_back(std::move(fd));
    } else {
      ASSERT_EQ(errno, EAGAIN) << std::strerror(errno);
      full = true;
    }
  }
  ASSERT_TRUE(full);
  // The probe must neither block nor take EAGAIN for "nobody home".
  Result<UniqueFd> second = Listen(path_, 0600);
  ASSERT_FALSE(second.has_value());
  EXPECT_EQ(second.error().code(), StatusCode::kAlreadyExists) << second.error();
  EXPECT_TRUE(std::filesystem::is_socket(path_));
}

TEST_F(SeqpacketTest, RegularFileAtPathIsAlreadyExistsAndUntouched) {
  {
    std::ofstream f(path_);
    f << "precious";
  }
  Result<UniqueFd> listener = Listen(path_, 0600);
  ASSERT_FALSE(listener.has_value());
  EXPECT_EQ(listener.error().code(), StatusCode::kAlreadyExists) << listener.error();
  ASSERT_TRUE(std::filesystem::is_regular_file(path_));
  UniqueFd f(::open(path_.c_str(), O_RDONLY | O_CLOEXEC));
  ASSERT_TRUE(f.valid()) << std::strerror(errno);
  EXPECT_EQ(ReadAll(f.get()), "precious");
}

TEST_F(SeqpacketTest, SymlinkAtPathIsAlreadyExistsAndUntouched) {
  const std::string target = dir_ + "/target";
  {
    std::ofstream f(target);
    f << "x";
  }
  ASSERT_EQ(::symlink(target.c_str(), path_.c_str()), 0) << std::strerror(errno);
  Result<UniqueFd> listener = Listen(path_, 0600);
  ASSERT_FALSE(listener.has_value());
  EXPECT_EQ(listener.error().code(), StatusCode::kAlreadyExists) << listener.error();
  EXPECT_TRUE(std::filesystem::is_symlink(path_));
  EXPECT_TRUE(std::filesystem::is_regular_file(target));
}

TEST_F(SeqpacketTest, ConnectToMissingPathIsUnavailableWithEnoent) {
  Result<UniqueFd> client = Connect(dir_ + "/nobody.sock");
  ASSERT_FALSE(client.has_value());
  EXPECT_EQ(client.error().code(), StatusCode::kUnavailable) << client.error();
  EXPECT_EQ(client.error().source(), ErrorSource::kErrno);
  EXPECT_EQ(client.error().raw_code(), ENOENT);
  EXPECT_NE(client.error().message().find("nobody.sock"), std::string::npos) << client.error();
}

TEST_F(SeqpacketTest, ListenInMissingDirectoryKeepsErrnoAndNamesPath) {
  const std::string path = dir_ + "/no/such/dir.sock";
  Result<UniqueFd> listener = Listen(path, 0600);
  ASSERT_FALSE(listener.has_value());
  EXPECT_EQ(listener.error().raw_code(), ENOENT) << listener.error();
  EXPECT_NE(listener.error().message().find(path), std::string::npos) << listener.error();
}

TEST_F(SeqpacketTest, PathTooLongIsInvalidArgument) {
  const std::string too_long = dir_ + "/" + std::string(sizeof(sockaddr_un{}.sun_path), 'x');
  Result<UniqueFd> listener = Listen(too_long, 0600);
  ASSERT_FALSE(listener.has_value());
  EXPECT_EQ(listener.error().code(), StatusCode::kInvalidArgument) << listener.error();
  Result<UniqueFd> client = Connect(too_long);
  ASSERT_FALSE(client.has_value());
  EXPECT_EQ(client.error().code(), StatusCode::kInvalidArgument) << client.error();
}

TEST_F(SeqpacketTest, PathAtTheLimitWorksAndOneMoreIsRefused) {
  const size_t limit = sizeof(sockaddr_un{}.sun_path) - 1;
  ASSERT_LT(dir_.size() + 2, limit);
  const std::string longest = dir_ + "/" + std::string(limit - dir_.size() - 1, 'y');
  ASSERT_EQ(longest.size(), limit);
  Result<UniqueFd> listener = Listen(longest, 0600);
  ASSERT_TRUE(listener.has_value()) << listener.error();
  Result<UniqueFd> client = Connect(longest);
  ASSERT_TRUE(client.has_value()) << client.error();

  Result<UniqueFd> over = Listen(longest + "z", 0600);
  ASSERT_FALSE(over.has_value());
  EXPECT_EQ(over.error().code(), StatusCode::kInvalidArgument);
}

TEST_F(SeqpacketTest, EmptyPathAndBadModeAreInvalidArgument) {
  Result<UniqueFd> empty = Listen("", 0600);
  ASSERT_FALSE(empty.has_value());
  EXPECT_EQ(empty.error().code(), StatusCode::kInvalidArgument);
  Result<UniqueFd> bad_mode = Listen(path_, 010600);
  ASSERT_FALSE(bad_mode.has_value());
  EXPECT_EQ(bad_mode.error().code(), StatusCode::kInvalidArgument);
  EXPECT_FALSE(std::filesystem::exists(path_));
}

// Socket file mode × process umask: chmod after bind makes the mode exact
// whatever the umask would have given.
class SocketModeTest : public SeqpacketTest,
                       public ::testing::WithParamInterface<std::tuple<mode_t, mode_t>> {};

TEST_P(SocketModeTest, FileModeIsExactlyTheRequestedMode) {
  const auto [mode, mask] = GetParam();
  const mode_t old_mask = ::umask(mask);
  Result<UniqueFd> listener = Listen(path_, mode);
  ::umask(old_mask);
  ASSERT_TRUE(listener.has_value()) << listener.error();
  struct stat st {};
  ASSERT_EQ(::stat(path_.c_str(), &st), 0) << std::strerror(errno);
  EXPECT_TRUE(S_ISSOCK(st.st_mode));
  EXPECT_EQ(st.st_mode & 07777, mode);
}

INSTANTIATE_TEST_SUITE_P(ModesAndUmasks, SocketModeTest,
                         ::testing::Combine(::testing::Values(mode_t{0660}, mode_t{0600}),
                                            ::testing::Values(mode_t{0}, mode_t{022},
                                                              mode_t{077})));

}  // namespace
}  // namespace kvtier::ipc
