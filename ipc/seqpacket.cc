#include "ipc/seqpacket.h"

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstring>
#include <memory>
#include <string_view>
#include <utility>

#include "common/check.h"

// Wire rule: kvtier never sends an empty message. On SOCK_SEQPACKET a
// zero-length read is how the kernel reports an orderly shutdown, and a
// zero-length message from the peer reads exactly the same, so ReceiveMessage
// treats both as EOF and SendMessage refuses to produce one.

namespace kvtier::ipc {
namespace {

// Room for kMaxFdsPerMessage descriptors in one SCM_RIGHTS header. A peer that
// attaches more gets MSG_CTRUNC; the kernel drops the excess itself.
constexpr size_t kControlBytes = CMSG_SPACE(sizeof(int) * kMaxFdsPerMessage);

// Like FromErrno, but with a code chosen by the caller; errno stays in raw_code.
Status ErrnoWithCode(StatusCode code, int err, std::string_view context) {
  return Status(code, Status::FromErrno(err, context).message(), ErrorSource::kErrno, err);
}

// Runs `syscall` until it fails with something other than EINTR.
template <typename F>
auto RetryOnEintr(F syscall) {
  for (;;) {
    auto rc = syscall();
    if (rc >= 0 || errno != EINTR) return rc;
  }
}

Result<sockaddr_un> MakeAddress(const std::string& path) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  // An empty path would mean an unnamed or abstract socket, and an embedded
  // NUL would silently cut the path the kernel sees.
  if (path.empty() || path.find('\0') != std::string::npos) {
    return Err(InvalidArgument("unix socket path is empty or contains NUL: '" + path + "'"));
  }
  // sun_path needs room for the terminating NUL; the kernel would otherwise
  // accept a path we cannot name back.
  if (path.size() >= sizeof(addr.sun_path)) {
    return Err(InvalidArgument("unix socket path is " + std::to_string(path.size()) +
                               " bytes, the limit is " + std::to_string(sizeof(addr.sun_path) - 1) +
                               ": " + path));
  }
  std::memcpy(addr.sun_path, path.data(), path.size());
  return addr;
}

const sockaddr* AsSockaddr(const sockaddr_un& addr) {
  return reinterpret_cast<const sockaddr*>(&addr);
}

Result<UniqueFd> NewSocket(int extra_flags, std::string_view context) {
  UniqueFd fd(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | extra_flags, 0));
  if (!fd.valid()) return Err(Status::FromErrno(errno, context));
  return fd;
}

// Clears the way for bind(): nothing at `path` is fine; a socket whose owner
// is gone (connect says ECONNREFUSED) is removed; anything else is left alone.
Status RemoveStaleSocket(const std::string& path, const sockaddr_un& addr) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return Status::Ok();
    return Status::FromErrno(errno, "lstat " + path);
  }
  if (!S_ISSOCK(st.st_mode)) {
    return Status(StatusCode::kAlreadyExists,
                  path + " exists and is not a socket; not removing it");
  }
  // Non-blocking so that a live listener with a full backlog answers EAGAIN
  // instead of blocking us. A live daemon sees this probe as a connection
  // that closes at once, which it must tolerate from any client anyway.
  KVTIER_ASSIGN_OR_RETURN(UniqueFd probe, NewSocket(SOCK_NONBLOCK, "probe socket for " + path));
  if (::connect(probe.get(), AsSockaddr(addr), sizeof(addr)) == 0 || errno == EAGAIN) {
    return Status(StatusCode::kAlreadyExists, "another daemon is listening on " + path);
  }
  if (errno != ECONNREFUSED) {
    // E.g. EPROTOTYPE: a stream socket that may well be alive; not ours to delete.
    return Status::FromErrno(errno, "probing existing socket " + path);
  }
  if (::unlink(path.c_str()) != 0 && errno != ENOENT) {
    return Status::FromErrno(errno, "removing stale socket " + path);
  }
  return Status::Ok();
}

}  // namespace

Result<UniqueFd> Listen(const std::string& path, uint32_t mode, int backlog) {
  KVTIER_ASSIGN_OR_RETURN(const sockaddr_un addr, MakeAddress(path));
  if ((mode & ~uint32_t{07777}) != 0) {
    return Err(InvalidArgument("socket mode " + std::to_string(mode) +
                               " has bits outside 07777: " + path));
  }
  KVTIER_RETURN_IF_ERROR(RemoveStaleSocket(path, addr));
  KVTIER_ASSIGN_OR_RETURN(UniqueFd fd, NewSocket(SOCK_NONBLOCK, "socket for " + path));
  if (::bind(fd.get(), AsSockaddr(addr), sizeof(addr)) != 0) {
    // Another daemon won the race between our probe and bind.
    if (errno == EADDRINUSE) {
      return Err(ErrnoWithCode(StatusCode::kAlreadyExists, errno, "bind " + path));
    }
    return Err(Status::FromErrno(errno, "bind " + path));
  }
  // From here on the file is ours: remove it on failure rather than leave a
  // stale socket. Until listen() nobody can connect (ECONNREFUSED), so the
  // window in which bind's umask-derived mode applies exposes nothing.
  // fchmod() on a socket does not reach the file, hence chmod by path; the
  // socket directory must not be writable by others.
  auto fail = [&path](std::string_view what) {
    const int err = errno;
    ::unlink(path.c_str());
    return Err(Status::FromErrno(err, std::string(what) + " " + path));
  };
  if (::chmod(path.c_str(), static_cast<mode_t>(mode)) != 0) return fail("chmod");
  if (::listen(fd.get(), backlog) != 0) return fail("listen on");
  return fd;
}

Result<UniqueFd> Connect(const std::string& path) {
  KVTIER_ASSIGN_OR_RETURN(const sockaddr_un addr, MakeAddress(path));
  KVTIER_ASSIGN_OR_RETURN(UniqueFd fd, NewSocket(0, "socket for " + path));
  // Retrying is safe for AF_UNIX only: an interrupted unix connect has not
  // started a connection (unlike TCP, where a retry gets EALREADY).
  if (RetryOnEintr([&] { return ::connect(fd.get(), AsSockaddr(addr), sizeof(addr)); }) != 0) {
    const int err = errno;
    if (err == ECONNREFUSED || err == ENOENT) {
      return Err(ErrnoWithCode(StatusCode::kUnavailable, err, "connect to " + path));
    }
    return Err(Status::FromErrno(err, "connect to " + path));
  }
  return fd;
}

Result<UniqueFd> Accept(int listen_fd) {
  for (;;) {
    UniqueFd fd(::accept4(listen_fd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC));
    if (fd.valid()) return fd;
    // ECONNABORTED concerns only the connection that went away; others may
    // still be queued.
    if (errno == EINTR || errno == ECONNABORTED) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return UniqueFd();
    return Err(Status::FromErrno(errno, "accept on fd " + std::to_string(listen_fd)));
  }
}

Result<PeerCredentials> GetPeerCredentials(int fd) {
  ucred cred{};
  socklen_t len = sizeof(cred);
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
    return Err(Status::FromErrno(errno, "SO_PEERCRED on fd " + std::to_string(fd)));
  }
  if (len != sizeof(cred)) {
    return Err(Internal("SO_PEERCRED on fd " + std::to_string(fd) + " returned " +
                        std::to_string(len) + " bytes"));
  }
  return PeerCredentials{.pid = cred.pid, .uid = cred.uid, .gid = cred.gid};
}

Status SendMessage(int fd, std::span<const uint8_t> bytes, std::span<const int> fds) {
  KVTIER_CHECK_MSG(fds.size() <= kMaxFdsPerMessage,
                   "SendMessage: " + std::to_string(fds.size()) + " fds");
  if (bytes.empty()) {
    return InvalidArgument("SendMessage: empty messages are not allowed (they read as EOF)");
  }
  iovec iov{};
  // sendmsg does not write through iov_base; the cast only satisfies its type.
  iov.iov_base = const_cast<uint8_t*>(bytes.data());
  iov.iov_len = bytes.size();
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;

  alignas(cmsghdr) unsigned char control[kControlBytes] = {};
  if (!fds.empty()) {
    msg.msg_control = control;
    msg.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
    cmsghdr* cmsg = CMSG_FIRSTHDR(&msg);
    cmsg->cmsg_level = SOL_SOCKET;
    cmsg->cmsg_type = SCM_RIGHTS;
    cmsg->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
    // memcpy: CMSG_DATA is not guaranteed to be aligned for int.
    std::memcpy(CMSG_DATA(cmsg), fds.data(), sizeof(int) * fds.size());
  }

  // MSG_NOSIGNAL: a vanished peer is an EPIPE Status, not a SIGPIPE that
  // kills the daemon. (Linux's SEQPACKET path raises none today; the stream
  // path does, and the contract should not rest on that detail.)
  const ssize_t n = RetryOnEintr([&] { return ::sendmsg(fd, &msg, MSG_NOSIGNAL); });
  if (n < 0) {
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      return ErrnoWithCode(StatusCode::kUnavailable, errno,
                           "sendmsg on fd " + std::to_string(fd) + " (would block)");
    }
    return Status::FromErrno(
        errno, "sendmsg of " + std::to_string(bytes.size()) + " bytes on fd " + std::to_string(fd));
  }
  if (static_cast<size_t>(n) != bytes.size()) {
    return Internal("sendmsg on fd " + std::to_string(fd) + " sent " + std::to_string(n) + " of " +
                    std::to_string(bytes.size()) + " bytes on a SOCK_SEQPACKET socket");
  }
  return Status::Ok();
}

Result<ReceivedMessage> ReceiveMessage(int fd, size_t max_bytes) {
  ReceivedMessage out;
  // Receive into a reusable per-thread buffer and copy out only what
  // arrived: zero-filling a max_bytes vector (megabytes) for every small
  // request would dominate a lookup's latency.
  thread_local std::unique_ptr<uint8_t[]> scratch;
  thread_local size_t scratch_bytes = 0;
  if (scratch_bytes < max_bytes) {
    scratch.reset(new uint8_t[max_bytes]);
    scratch_bytes = max_bytes;
  }
  iovec iov{};
  iov.iov_base = scratch.get();
  iov.iov_len = max_bytes;
  alignas(cmsghdr) unsigned char control[kControlBytes] = {};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;

  // MSG_CMSG_CLOEXEC: received descriptors must not leak into a child that
  // another thread forks before we wrap them.
  auto receive = [&] {
    msg.msg_controllen = sizeof(control);
    msg.msg_flags = 0;
    return RetryOnEintr([&] { return ::recvmsg(fd, &msg, MSG_CMSG_CLOEXEC); });
  };
  ssize_t n = receive();
  // ECONNRESET means the peer closed with data of ours unread. Linux reports
  // it once, *before* any messages the peer sent us first (say, an error
  // reply followed by a close), and has already shut the socket down, so
  // reading again yields those messages and then a plain 0 (EOF).
  if (n < 0 && errno == ECONNRESET) {
    n = receive();
    if (n < 0 && (errno == ECONNRESET || errno == EAGAIN || errno == EWOULDBLOCK)) {
      out.bytes.clear();
      out.eof = true;
      return out;
    }
  }
  if (n < 0) {
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      return Err(ErrnoWithCode(StatusCode::kUnavailable, errno,
                               "recvmsg on fd " + std::to_string(fd) + " (nothing to read)"));
    }
    return Err(Status::FromErrno(errno, "recvmsg on fd " + std::to_string(fd)));
  }

  // Take every descriptor first, whatever else is wrong with the message, so
  // that all of them are closed unless the caller keeps them.
  const unsigned char* const control_end = control + msg.msg_controllen;
  for (cmsghdr* cmsg = CMSG_FIRSTHDR(&msg); cmsg != nullptr; cmsg = CMSG_NXTHDR(&msg, cmsg)) {
    if (cmsg->cmsg_level != SOL_SOCKET || cmsg->cmsg_type != SCM_RIGHTS) continue;
    const unsigned char* data = CMSG_DATA(cmsg);
    // Bound by both the header's length and the buffer, in case a truncated
    // header claims more than was written.
    const unsigned char* data_end = reinterpret_cast<const unsigned char*>(cmsg) + cmsg->cmsg_len;
    if (data_end > control_end) data_end = control_end;
    for (; data + sizeof(int) <= data_end; data += sizeof(int)) {
      int received = -1;
      std::memcpy(&received, data, sizeof(int));
      out.fds.emplace_back(received);
    }
  }

  out.bytes.assign(scratch.get(), scratch.get() + std::min(static_cast<size_t>(n), max_bytes));
  out.truncated = (msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) != 0;
  // MSG_TRUNC first: with max_bytes == 0 a non-empty message also reads 0 bytes.
  if (n == 0 && (msg.msg_flags & MSG_TRUNC) == 0) out.eof = true;
  return out;
}

}  // namespace kvtier::ipc
