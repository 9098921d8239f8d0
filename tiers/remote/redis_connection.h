// RedisConnection: one blocking hiredis connection to a Redis node (TCP or a
// unix socket), with connect and I/O timeouts and ACL authentication, that
// pipelines: append any number of commands, then read their replies in order.
//
// A connection whose socket failed or timed out is broken for good (hiredis
// cannot resynchronise it): every later call fails with kUnavailable, and its
// owner drops it and connects again.
//
// Owned and used by one thread at a time (the remote tier's I/O threads,
// kvtier-bench); thread-compatible.
#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "common/status.h"
#include "tiers/remote/cluster_slots.h"

struct redisContext;
struct redisReply;
struct redisReplyObjectFunctions;

namespace kvtier {

struct RedisReplyDeleter {
  void operator()(redisReply* reply) const;
};
// A reply as hiredis parsed it (type, str/len, integer, element array).
using RedisReply = std::unique_ptr<redisReply, RedisReplyDeleter>;

// The text of an error reply, or empty for a reply of another type.
std::string_view RedisErrorText(const redisReply& reply);

// Takes a string reply's bytes where hiredis parsed them (its read buffer),
// for the caller to copy where they belong: large values are not copied into
// a reply first. The reply then comes back as an empty string.
class RedisValueSink {
 public:
  virtual void Take(std::span<const uint8_t> value) = 0;
  // The longest value it takes: a longer one is refused by its length,
  // before its bytes are read (RedisConnection::Next).
  virtual uint64_t max_bytes() const = 0;

 protected:
  ~RedisValueSink() = default;
};

struct RedisConnectionOptions {
  NodeAddress address;        // TCP, unless unix_socket is set
  std::string unix_socket = {};
  std::string user = {};      // ACL user; empty: "default"
  std::string password = {};  // empty: no AUTH
  std::chrono::milliseconds connect_timeout{1000};
  std::chrono::milliseconds io_timeout{1000};
};

// hiredis writes with plain write(): a node that closed its end raises
// SIGPIPE in the writing thread. Threads that use a connection must ignore
// or block SIGPIPE (kvtierd ignores it; RemoteTier's I/O threads block it).
class RedisConnection {
 public:
  // Connects, then AUTHs when a password is set. Errors: kUnavailable when
  // the node cannot be reached in time; kUnauthenticated when AUTH is refused.
  static Result<std::unique_ptr<RedisConnection>> Connect(const RedisConnectionOptions& options);
  ~RedisConnection();
  RedisConnection(const RedisConnection&) = delete;
  RedisConnection& operator=(const RedisConnection&) = delete;

  // Queues a command (binary-safe arguments; copied). Errors: kUnavailable
  // once broken.
  Status Append(std::span<const std::string_view> argv);
  using Deadline = std::chrono::steady_clock::time_point;
  // Queues a command whose last argument is the concatenation of `parts`
  // (a value's header and payload), written to the socket at once with
  // sendmsg: the parts are not copied (hiredis would copy the whole value
  // into its buffer). What is queued before it is written first. The writes
  // never block: a node that takes the bytes slowly, however steadily, fails
  // it at `deadline`. Errors: kUnavailable when the write fails or the
  // deadline passes (the connection is broken from then on).
  Status AppendWithParts(std::span<const std::string_view> argv, std::span<const std::string_view> parts,
                         Deadline deadline);
  // Writes what is queued, each write waiting at most until `deadline`.
  // Errors: kUnavailable when the connection fails or `deadline` passes
  // first (it is broken from then on).
  Status Flush(Deadline deadline);
  // Sends what is queued if needed and reads the next reply, by `deadline`
  // (default: io_timeout from now). An error reply (MOVED, ASK, OOM, ...)
  // is a reply, not an error. A string reply goes to `sink` when one is
  // given (other types do not). Errors: kUnavailable when the connection
  // fails or the deadline passes (however slowly bytes trickle in);
  // kResourceExhausted for a string longer than the sink's max_bytes, found
  // by its length before its bytes are read. The connection is broken from
  // then on.
  Result<RedisReply> Next(RedisValueSink* sink = nullptr,
                          std::optional<Deadline> deadline = std::nullopt);
  // Append, then Next.
  Result<RedisReply> Command(std::span<const std::string_view> argv);

  bool broken() const { return broken_; }
  // "host:port" or the socket path, for messages.
  const std::string& name() const { return name_; }

 private:
  RedisConnection(redisContext* context, std::string name, std::chrono::milliseconds io_timeout);
  Status Broken(std::string_view what);
  // kUnavailable, "<what>: timed out"; broken from then on.
  Status TimedOut(std::string_view what);
  // Waits until the socket takes bytes, or `deadline` passes (TimedOut).
  Status AwaitWritable(Deadline deadline, std::string_view what);
  // The length of the string reply being read, once its header is in the
  // reader's buffer; nullopt before (or for another type).
  std::optional<uint64_t> PendingStringLength() const;

  redisContext* context_;  // owned
 public:
  // What the reader's privdata points at: the sink of the reply being read,
  // and hiredis' own reply functions (for everything else).
  struct SinkState {
    RedisValueSink* sink = nullptr;
    const redisReplyObjectFunctions* hiredis = nullptr;
  };

 private:
  // hiredis' functions with createString routed to the sink.
  std::unique_ptr<redisReplyObjectFunctions> functions_;
  SinkState sink_state_;
  std::string name_;
  std::chrono::milliseconds io_timeout_;
  bool broken_ = false;
};

}  // namespace kvtier
