#include "tiers/remote/redis_connection.h"

#include <hiredis/hiredis.h>
#include <hiredis/sds.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <vector>

namespace kvtier {
namespace {

// A reply buffer kept between replies at most (bytes).
constexpr size_t kKeptReplyBuffer = size_t{8} << 20;

// The reader's createString: a top-level string reply goes to the sink of
// the reply being read (RedisConnection::Next), which copies it where it
// belongs; the reply itself is then an empty string.
void* CreateString(const redisReadTask* task, char* str, size_t len) {
  const auto* state = static_cast<const RedisConnection::SinkState*>(task->privdata);
  if (state->sink != nullptr && task->parent == nullptr && task->type == REDIS_REPLY_STRING) {
    state->sink->Take(std::span(reinterpret_cast<const uint8_t*>(str), len));
    return state->hiredis->createString(task, str, 0);
  }
  return state->hiredis->createString(task, str, len);
}

timeval ToTimeval(std::chrono::milliseconds ms) {
  timeval tv{};
  tv.tv_sec = static_cast<time_t>(ms.count() / 1000);
  tv.tv_usec = static_cast<suseconds_t>((ms.count() % 1000) * 1000);
  return tv;
}

}  // namespace

void RedisReplyDeleter::operator()(redisReply* reply) const { freeReplyObject(reply); }

std::string_view RedisErrorText(const redisReply& reply) {
  if (reply.type != REDIS_REPLY_ERROR) return {};
  return {reply.str, reply.len};
}

Result<std::unique_ptr<RedisConnection>> RedisConnection::Connect(const RedisConnectionOptions& options) {
  const timeval connect_timeout = ToTimeval(options.connect_timeout);
  const std::string name = options.unix_socket.empty() ? options.address.ToString() : options.unix_socket;
  redisContext* c = options.unix_socket.empty()
                        ? redisConnectWithTimeout(options.address.host.c_str(), options.address.port, connect_timeout)
                        : redisConnectUnixWithTimeout(options.unix_socket.c_str(), connect_timeout);
  if (c == nullptr) return Err(StatusCode::kResourceExhausted, "redis: cannot allocate a context");
  std::unique_ptr<RedisConnection> conn(new RedisConnection(c, name, options.io_timeout));
  if (c->err != 0) return Err(StatusCode::kUnavailable, "redis " + name + ": connect: " + c->errstr);
  if (redisSetTimeout(c, ToTimeval(options.io_timeout)) != REDIS_OK) {
    return Err(StatusCode::kUnavailable, "redis " + name + ": setting the I/O timeout: " + c->errstr);
  }
  // Blocks are large: the reply buffer is kept between replies, up to
  // kKeptReplyBuffer, instead of freed whenever more than 16 KiB of it is
  // unused (grown again, and its pages faulted in again, for every value).
  // A larger one (a larger block) goes once it is empty, so a connection
  // holds at most that much between batches.
  c->reader->maxbuf = kKeptReplyBuffer;
  // String replies may go to a sink (Next): hiredis' functions, with
  // createString wrapped.
  conn->sink_state_.hiredis = c->reader->fn;
  conn->functions_ = std::make_unique<redisReplyObjectFunctions>(*c->reader->fn);
  conn->functions_->createString = CreateString;
  c->reader->fn = conn->functions_.get();
  c->reader->privdata = &conn->sink_state_;
  if (!options.password.empty()) {
    std::vector<std::string_view> argv = {"AUTH"};
    if (!options.user.empty()) argv.push_back(options.user);
    argv.push_back(options.password);
    KVTIER_ASSIGN_OR_RETURN(RedisReply reply, conn->Command(argv));
    if (reply->type == REDIS_REPLY_ERROR) {
      return Err(StatusCode::kUnauthenticated, "redis " + name + ": AUTH refused: " +
                                                   std::string(RedisErrorText(*reply)));
    }
  }
  return conn;
}

RedisConnection::RedisConnection(redisContext* context, std::string name,
                                 std::chrono::milliseconds io_timeout)
    : context_(context), name_(std::move(name)), io_timeout_(io_timeout) {}

RedisConnection::~RedisConnection() { redisFree(context_); }

Status RedisConnection::Broken(std::string_view what) {
  broken_ = true;
  return Status(StatusCode::kUnavailable, "redis " + name_ + ": " + std::string(what) + ": " +
                                              (context_->err != 0 ? context_->errstr : "connection lost"));
}

Status RedisConnection::Append(std::span<const std::string_view> argv) {
  if (broken_) return Status(StatusCode::kUnavailable, "redis " + name_ + ": the connection failed before");
  std::vector<const char*> ptrs;
  std::vector<size_t> lens;
  ptrs.reserve(argv.size());
  lens.reserve(argv.size());
  for (const std::string_view a : argv) {
    ptrs.push_back(a.data());
    lens.push_back(a.size());
  }
  if (redisAppendCommandArgv(context_, static_cast<int>(argv.size()), ptrs.data(), lens.data()) != REDIS_OK) {
    return Broken("append");
  }
  return Status::Ok();
}

Status RedisConnection::TimedOut(std::string_view what) {
  broken_ = true;
  return Unavailable("redis " + name_ + ": " + std::string(what) + ": timed out");
}

Status RedisConnection::AwaitWritable(Deadline deadline, std::string_view what) {
  while (true) {
    const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return TimedOut(what);
    pollfd pfd{.fd = context_->fd, .events = POLLOUT, .revents = 0};
    const int ready = ::poll(&pfd, 1, static_cast<int>(std::min<int64_t>(left.count(), INT_MAX)));
    if (ready < 0 && errno != EINTR) {
      const int error = errno;
      broken_ = true;
      return Unavailable("redis " + name_ + ": " + std::string(what) + ": poll: " + std::strerror(error));
    }
    // (POLLERR, POLLHUP: the write that follows says what went wrong.)
    if (ready > 0) return Status::Ok();
  }
}

Status RedisConnection::AppendWithParts(std::span<const std::string_view> argv,
                                        std::span<const std::string_view> parts, Deadline deadline) {
  if (broken_) return Status(StatusCode::kUnavailable, "redis " + name_ + ": the connection failed before");
  // What hiredis holds goes first, so that commands stay in order.
  KVTIER_RETURN_IF_ERROR(Flush(deadline));
  // RESP: *<args>\r\n, each argument $<len>\r\n<bytes>\r\n; the last one in parts.
  size_t value_bytes = 0;
  for (const std::string_view p : parts) value_bytes += p.size();
  std::string head = "*" + std::to_string(argv.size() + 1) + "\r\n";
  for (const std::string_view a : argv) {
    head += "$" + std::to_string(a.size()) + "\r\n";
    head += a;
    head += "\r\n";
  }
  head += "$" + std::to_string(value_bytes) + "\r\n";
  static constexpr char kEnd[] = "\r\n";
  std::vector<iovec> iov;
  iov.reserve(parts.size() + 2);
  iov.push_back({head.data(), head.size()});
  for (const std::string_view p : parts) iov.push_back({const_cast<char*>(p.data()), p.size()});
  iov.push_back({const_cast<char*>(kEnd), 2});
  size_t at = 0;  // the first iovec not fully written
  while (at < iov.size()) {
    msghdr msg{};
    msg.msg_iov = iov.data() + at;
    msg.msg_iovlen = std::min<size_t>(iov.size() - at, IOV_MAX);
    // MSG_NOSIGNAL: a peer that closed is EPIPE here, never SIGPIPE.
    // MSG_DONTWAIT: a full socket waits in AwaitWritable, by the deadline;
    // a blocking send would wait its send timeout again after each piece
    // the node takes.
    const ssize_t n = ::sendmsg(context_->fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        KVTIER_RETURN_IF_ERROR(AwaitWritable(deadline, "writing a value"));
        continue;
      }
      const int error = errno;
      broken_ = true;
      return Unavailable("redis " + name_ + ": sendmsg: " + std::strerror(error));
    }
    size_t left = static_cast<size_t>(n);
    while (at < iov.size() && left >= iov[at].iov_len) left -= iov[at++].iov_len;
    if (at < iov.size()) {
      iov[at].iov_base = static_cast<char*>(iov[at].iov_base) + left;
      iov[at].iov_len -= left;
    }
  }
  return Status::Ok();
}

Status RedisConnection::Flush(Deadline deadline) {
  if (broken_) {
    return Status(StatusCode::kUnavailable, "redis " + name_ + ": the connection failed before");
  }
  if (std::chrono::steady_clock::now() >= deadline) return TimedOut("writing");
  // Nothing queued, as for most replies read (Next): no system call.
  while (sdslen(context_->obuf) > 0) {
    // hiredis writes with a blocking write(): its send timeout is what is
    // left of the deadline, so that no write waits past it.
    KVTIER_RETURN_IF_ERROR(AwaitWritable(deadline, "writing"));
    const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    const timeval timeout = ToTimeval(std::max(left, std::chrono::milliseconds(1)));  // 0 would be none
    if (::setsockopt(context_->fd, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof(timeout)) != 0) {
      return Broken("setting the send timeout");
    }
    int done = 0;  // (the buffer, whole or not: the loop's condition says)
    if (redisBufferWrite(context_, &done) != REDIS_OK) {
      return std::chrono::steady_clock::now() >= deadline ? TimedOut("writing") : Broken("write");
    }
  }
  return Status::Ok();
}

std::optional<uint64_t> RedisConnection::PendingStringLength() const {
  const redisReader& r = *context_->reader;
  // hiredis takes the type byte first ('$': rstack[0] a string from then on),
  // and the length line once it is whole.
  size_t at = r.pos;
  if (r.ridx == -1) {
    if (at >= r.len || r.buf[at] != '$') return std::nullopt;
    ++at;
  } else {
#if HIREDIS_MAJOR >= 1
    const int top_type = r.tasks > 0 ? r.task[0]->type : -1;
#else
    const int top_type = r.rstack[0].type;
#endif
    if (r.ridx != 0 || top_type != REDIS_REPLY_STRING) return std::nullopt;
  }
  uint64_t length = 0;
  for (size_t i = at; i < r.len && i < at + 21; ++i) {
    if (r.buf[i] == '\r') return i > at ? std::optional<uint64_t>(length) : std::nullopt;
    if (r.buf[i] == '-') return std::nullopt;  // $-1: nil
    // Anything else: hiredis reports the protocol error.
    if (r.buf[i] < '0' || r.buf[i] > '9') return std::nullopt;
    length = length * 10 + static_cast<uint64_t>(r.buf[i] - '0');
  }
  return std::nullopt;
}

Result<RedisReply> RedisConnection::Next(RedisValueSink* sink, std::optional<Deadline> deadline) {
  if (broken_) return Err(StatusCode::kUnavailable, "redis " + name_ + ": the connection failed before");
  const Deadline until = deadline.value_or(std::chrono::steady_clock::now() + io_timeout_);
  KVTIER_RETURN_IF_ERROR(Flush(until));
  // hiredis starts parsing a reply only within redisGetReplyFromReader: its
  // task takes the reader's privdata, sink_state_, then.
  sink_state_.sink = sink;
  void* reply = nullptr;
  while (true) {
    if (redisGetReplyFromReader(context_, &reply) != REDIS_OK) {
      sink_state_.sink = nullptr;
      return Err(Broken("reading a reply"));
    }
    if (reply != nullptr) break;
    if (sink != nullptr) {
      if (const std::optional<uint64_t> length = PendingStringLength();
          length && *length > sink->max_bytes()) {
        sink_state_.sink = nullptr;
        broken_ = true;  // the rest of it is never read
        return Err(StatusCode::kResourceExhausted,
                   "redis " + name_ + ": a value of " + std::to_string(*length) +
                       " bytes, more than the " + std::to_string(sink->max_bytes()) +
                       " it can be: refused unread");
      }
    }
    // Bytes may trickle in: the deadline bounds the reply, not each read.
    const auto left =
        std::chrono::ceil<std::chrono::milliseconds>(until - std::chrono::steady_clock::now());
    pollfd pfd{.fd = context_->fd, .events = POLLIN, .revents = 0};
    const int ready =
        left.count() > 0
            ? ::poll(&pfd, 1, static_cast<int>(std::min<int64_t>(left.count(), INT_MAX)))
            : 0;
    if (ready < 0 && errno == EINTR) continue;
    if (ready <= 0) {
      sink_state_.sink = nullptr;
      return Err(TimedOut("reading a reply"));
    }
    if (redisBufferRead(context_) != REDIS_OK) {
      sink_state_.sink = nullptr;
      return Err(Broken("reading a reply"));
    }
  }
  sink_state_.sink = nullptr;
  return RedisReply(static_cast<redisReply*>(reply));
}

Result<RedisReply> RedisConnection::Command(std::span<const std::string_view> argv) {
  KVTIER_RETURN_IF_ERROR(Append(argv));
  return Next();
}

}  // namespace kvtier
