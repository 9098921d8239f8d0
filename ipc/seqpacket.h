// SOCK_SEQPACKET unix-socket primitives: listening, connecting, and sending
// and receiving one message (with optional file descriptors via SCM_RIGHTS).
//
// Messages keep their boundaries; a message larger than the receiver's buffer
// is reported as truncated (never silently cut), and descriptors that arrive
// with a message are always taken into UniqueFds (closed unless kept), so a
// hostile peer cannot leak descriptors into the daemon.
//
// Free functions; thread-safe as the underlying syscalls are. Sockets are
// created non-blocking (listener, accepted sockets) or blocking (Connect), all
// close-on-exec.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "common/status.h"
#include "common/unique_fd.h"

namespace kvtier::ipc {

// At most this many descriptors travel with one message.
inline constexpr size_t kMaxFdsPerMessage = 16;

// Creates a listening SOCK_SEQPACKET socket at `path` (an existing socket file
// there is removed first, but only if it is a socket nobody listens on: a live
// daemon's socket is an error, kAlreadyExists), then chmods it to `mode`.
// The socket is non-blocking. Errors keep errno and name the path.
Result<UniqueFd> Listen(const std::string& path, uint32_t mode, int backlog = 128);

// Connects a blocking SOCK_SEQPACKET socket to `path`.
// Errors: kUnavailable when nobody listens (ECONNREFUSED, ENOENT), others
// keep errno.
Result<UniqueFd> Connect(const std::string& path);

// Accepts one connection (non-blocking, close-on-exec). Returns an invalid
// UniqueFd when no connection is pending (EAGAIN).
Result<UniqueFd> Accept(int listen_fd);

struct PeerCredentials {
  pid_t pid = 0;
  uid_t uid = 0;
  gid_t gid = 0;
};
// SO_PEERCRED of a connected unix socket.
Result<PeerCredentials> GetPeerCredentials(int fd);

// Sends one message with `fds` attached (borrowed; the caller keeps them).
// An empty message is refused (kInvalidArgument): on SOCK_SEQPACKET the
// receiver could not tell it from EOF.
// Retries EINTR. On a non-blocking socket returns kUnavailable for EAGAIN.
// REQUIRES: fds.size() <= kMaxFdsPerMessage.
Status SendMessage(int fd, std::span<const uint8_t> bytes, std::span<const int> fds = {});

struct ReceivedMessage {
  std::vector<uint8_t> bytes;
  std::vector<UniqueFd> fds;  // owned; closed when dropped
  bool truncated = false;     // the message (or its descriptors) did not fit: reject it
  bool eof = false;           // orderly shutdown by the peer; bytes is empty
};

// Receives one message of at most `max_bytes`. Retries EINTR. On a
// non-blocking socket with nothing to read returns kUnavailable (EAGAIN).
// ECONNRESET is returned as eof, like an orderly shutdown (after any message
// still queued). A zero-length message reads as eof.
Result<ReceivedMessage> ReceiveMessage(int fd, size_t max_bytes);

}  // namespace kvtier::ipc
