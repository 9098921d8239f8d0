#include "tools/bench_redis.h"

#include <fcntl.h>
#include <hiredis/hiredis.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <thread>
#include <vector>

#include "common/block_pattern.h"
#include "common/unique_fd.h"
#include "tools/bench_report.h"

namespace kvtier::bench {
namespace {

struct ReplyFree {
  void operator()(redisReply* r) const { freeReplyObject(r); }
};
using ReplyPtr = std::unique_ptr<redisReply, ReplyFree>;

Status ContextError(const redisContext* c, std::string_view what) {
  return Status(StatusCode::kIoError, std::string("redis ") + std::string(what) + ": " + c->errstr);
}

// The next reply of a pipeline (writing what is still buffered first).
Result<ReplyPtr> NextReply(redisContext* c, std::string_view what) {
  void* raw = nullptr;
  if (redisGetReply(c, &raw) != REDIS_OK || raw == nullptr) return Err(ContextError(c, what));
  ReplyPtr reply(static_cast<redisReply*>(raw));
  if (reply->type == REDIS_REPLY_ERROR) {
    return Err(StatusCode::kInternal,
               "redis " + std::string(what) + ": " + std::string(reply->str, reply->len));
  }
  return reply;
}

// redis-server on PATH, else /usr/bin/redis-server.
Result<std::string> FindRedisServer() {
  if (const char* path = std::getenv("PATH"); path != nullptr) {
    std::stringstream dirs(path);
    for (std::string dir; std::getline(dirs, dir, ':');) {
      const std::string exe = (dir.empty() ? "." : dir) + "/redis-server";
      if (::access(exe.c_str(), X_OK) == 0) return exe;
    }
  }
  if (::access("/usr/bin/redis-server", X_OK) == 0) return std::string("/usr/bin/redis-server");
  return Err(
      StatusCode::kNotFound,
      "redis-server is neither on PATH nor at /usr/bin/redis-server: install Debian's redis-server "
      "package (tools/setup-deps.sh does)");
}

std::string Tail(const std::string& file, size_t max_bytes) {
  std::ifstream in(file);
  std::string s((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return s.size() > max_bytes ? s.substr(s.size() - max_bytes) : s;
}

std::vector<uint32_t> Iota(uint32_t first, uint32_t n) {
  std::vector<uint32_t> v(n);
  for (uint32_t i = 0; i < n; ++i) v[i] = first + i;
  return v;
}

// The ceiling of what a client could get out of this Redis: RESP written
// by hand with writev straight from the engine's blocks, and bulk replies
// read straight into them; no client-side copy, no 16 KiB reads. Not how
// users talk to Redis (the hiredis pipeline is); shown next to it so the
// comparison says how much of Redis' figure is its client library.
class RespSocket {
 public:
  static Result<RespSocket> Connect(const std::string& path) {
    UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (!fd) return Err(Status::FromErrno(errno, "socket"));
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    if (path.size() >= sizeof(addr.sun_path))
      return Err(InvalidArgument("socket path too long: " + path));
    std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
    if (::connect(fd.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0) {
      return Err(Status::FromErrno(errno, "connect " + path));
    }
    return RespSocket(std::move(fd));
  }

  Status SetAll(std::span<const std::string_view> keys,
                std::span<const std::span<const uint8_t>> values) {
    std::vector<std::string> heads(keys.size());
    std::vector<iovec> iov;
    iov.reserve(3 * keys.size());
    static const char kCrlf[] = "\r\n";
    for (size_t i = 0; i < keys.size(); ++i) {
      heads[i] = "*3\r\n$3\r\nSET\r\n$" + std::to_string(keys[i].size()) + "\r\n" +
                 std::string(keys[i]) + "\r\n$" + std::to_string(values[i].size()) + "\r\n";
      iov.push_back({heads[i].data(), heads[i].size()});
      iov.push_back({const_cast<uint8_t*>(values[i].data()), values[i].size()});
      iov.push_back({const_cast<char*>(kCrlf), 2});
    }
    KVTIER_RETURN_IF_ERROR(WriteAll(iov));
    for (size_t i = 0; i < keys.size(); ++i) {
      KVTIER_ASSIGN_OR_RETURN(const std::string line, ReadLine());
      if (line != "+OK") return Status(StatusCode::kInternal, "redis SET (raw): " + line);
    }
    return Status::Ok();
  }

  Status GetAll(std::span<const std::string_view> keys, std::span<const std::span<uint8_t>> out) {
    std::string commands;
    for (const std::string_view key : keys) {
      commands +=
          "*2\r\n$3\r\nGET\r\n$" + std::to_string(key.size()) + "\r\n" + std::string(key) + "\r\n";
    }
    std::vector<iovec> iov = {{commands.data(), commands.size()}};
    KVTIER_RETURN_IF_ERROR(WriteAll(iov));
    for (size_t i = 0; i < keys.size(); ++i) {
      KVTIER_ASSIGN_OR_RETURN(const std::string line, ReadLine());
      if (line != "$" + std::to_string(out[i].size())) {
        return Status(StatusCode::kCorruption,
                      "redis GET (raw): key " + std::to_string(i) + ": " + line);
      }
      KVTIER_RETURN_IF_ERROR(ReadInto(out[i]));
      KVTIER_ASSIGN_OR_RETURN(const std::string end, ReadLine());
      if (!end.empty())
        return Status(StatusCode::kCorruption, "redis GET (raw): no CRLF after a value");
    }
    return Status::Ok();
  }

 private:
  explicit RespSocket(UniqueFd fd) : fd_(std::move(fd)), buf_(64 << 10) {}

  Status WriteAll(std::vector<iovec>& iov) {
    for (size_t i = 0; i < iov.size();) {
      const int n_iov = static_cast<int>(std::min<size_t>(iov.size() - i, 1024));
      ssize_t n = ::writev(fd_.get(), iov.data() + i, n_iov);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) return Status::FromErrno(errno, "writev to redis");
      for (; n > 0;) {
        const size_t take = std::min(static_cast<size_t>(n), iov[i].iov_len);
        iov[i].iov_base = static_cast<char*>(iov[i].iov_base) + take;
        iov[i].iov_len -= take;
        n -= static_cast<ssize_t>(take);
        if (iov[i].iov_len == 0) ++i;
      }
      while (i < iov.size() && iov[i].iov_len == 0) ++i;
    }
    return Status::Ok();
  }
  Status Fill() {
    if (pos_ > 0) {
      std::memmove(buf_.data(), buf_.data() + pos_, len_ - pos_);
      len_ -= pos_;
      pos_ = 0;
    }
    const ssize_t n = ::read(fd_.get(), buf_.data() + len_, buf_.size() - len_);
    if (n < 0 && errno == EINTR) return Status::Ok();
    if (n < 0) return Status::FromErrno(errno, "read from redis");
    if (n == 0) return Status(StatusCode::kUnavailable, "redis closed the connection");
    len_ += static_cast<size_t>(n);
    return Status::Ok();
  }
  // One reply line without its CRLF.
  Result<std::string> ReadLine() {
    while (true) {
      const char* begin = buf_.data() + pos_;
      const void* nl = std::memchr(begin, '\n', len_ - pos_);
      if (nl != nullptr) {
        const size_t n = static_cast<size_t>(static_cast<const char*>(nl) - begin);
        std::string line(begin, n > 0 && begin[n - 1] == '\r' ? n - 1 : n);
        pos_ += n + 1;
        return line;
      }
      if (len_ - pos_ == buf_.size())
        return Err(StatusCode::kCorruption, "redis: reply line too long");
      KVTIER_RETURN_IF_ERROR(Fill());
    }
  }
  // What is buffered first, the rest read straight into `out`.
  Status ReadInto(std::span<uint8_t> out) {
    const size_t buffered = std::min(out.size(), len_ - pos_);
    std::memcpy(out.data(), buf_.data() + pos_, buffered);
    pos_ += buffered;
    for (size_t done = buffered; done < out.size();) {
      const ssize_t n = ::read(fd_.get(), out.data() + done, out.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) return Status::FromErrno(errno, "read from redis");
      if (n == 0) return Status(StatusCode::kUnavailable, "redis closed the connection");
      done += static_cast<size_t>(n);
    }
    return Status::Ok();
  }

  UniqueFd fd_;
  std::vector<char> buf_;
  size_t pos_ = 0, len_ = 0;
};

}  // namespace

std::string_view RedisKey(const BlockKey& key) {
  return {reinterpret_cast<const char*>(key.bytes.data()), key.bytes.size()};
}

// ---- RedisServer

Result<std::unique_ptr<RedisServer>> RedisServer::Start(const Options& options) {
  KVTIER_ASSIGN_OR_RETURN(const std::string exe, FindRedisServer());
  char tmpl[] = "/tmp/kvtier-bench-redis-XXXXXX";
  if (::mkdtemp(tmpl) == nullptr) return Err(Status::FromErrno(errno, "mkdtemp for redis-server"));
  const std::string dir = tmpl, socket = dir + "/redis.sock", log = dir + "/redis.log";
  std::vector<std::string> args = {exe,
                                   "--port",
                                   "0",
                                   "--unixsocket",
                                   socket,
                                   "--unixsocketperm",
                                   "700",
                                   "--save",
                                   "",
                                   "--appendonly",
                                   "no",
                                   "--maxmemory",
                                   std::to_string(options.maxmemory_bytes),
                                   "--maxmemory-policy",
                                   "noeviction",
                                   "--dir",
                                   dir,
                                   "--logfile",
                                   log,
                                   "--daemonize",
                                   "no"};
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) return Err(Status::FromErrno(errno, "fork for redis-server"));
  if (pid == 0) {
    // Dies with the bench, however the bench ends.
    ::prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (::getppid() != parent) ::_exit(1);
    const int out = ::open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
    const int in = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (out >= 0) {
      ::dup2(out, STDOUT_FILENO);
      ::dup2(out, STDERR_FILENO);
    }
    if (in >= 0) ::dup2(in, STDIN_FILENO);
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  std::unique_ptr<RedisServer> server(new RedisServer(dir, pid));
  const auto deadline = Clock::now() + std::chrono::seconds(10);
  while (true) {
    int wstatus = 0;
    if (::waitpid(pid, &wstatus, WNOHANG) == pid) {
      server->pid_ = -1;
      return Err(StatusCode::kUnavailable,
                 "redis-server (" + exe + ") exited at start; its log ends:\n" + Tail(log, 2000));
    }
    if (auto c = RedisConnection::Connect(server->socket_); c) {
      const std::string_view info[] = {"INFO", "server"};
      if (auto r = (*c)->Command(info); r) {
        const size_t at = r->find("redis_version:");
        if (at != std::string::npos) {
          server->version_ = r->substr(at + 14, r->find_first_of("\r\n", at) - at - 14);
        }
        return server;
      }
    }
    if (Clock::now() > deadline) {
      return Err(StatusCode::kUnavailable, "redis-server did not answer on " + server->socket_ +
                                               " within 10 s; its log ends:\n" + Tail(log, 2000));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

RedisServer::~RedisServer() {
  if (pid_ > 0) {
    ::kill(pid_, SIGTERM);
    ::waitpid(pid_, nullptr, 0);
  }
  if (std::getenv("KVTIER_KEEP_TEST_DIRS") == nullptr) {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
}

// ---- RedisConnection

Result<std::unique_ptr<RedisConnection>> RedisConnection::Connect(const std::string& socket_path) {
  redisContext* c = redisConnectUnix(socket_path.c_str());
  if (c == nullptr) return Err(StatusCode::kResourceExhausted, "redis: cannot allocate a context");
  if (c->err != 0) {
    Status s(StatusCode::kUnavailable, "redis: connect to " + socket_path + ": " + c->errstr);
    redisFree(c);
    return Err(std::move(s));
  }
  return std::unique_ptr<RedisConnection>(new RedisConnection(c));
}

RedisConnection::~RedisConnection() { redisFree(context_); }

Status RedisConnection::AppendArgv(std::span<const std::string_view> argv) {
  std::vector<const char*> ptrs;
  std::vector<size_t> lens;
  ptrs.reserve(argv.size());
  lens.reserve(argv.size());
  for (std::string_view a : argv) {
    ptrs.push_back(a.data());
    lens.push_back(a.size());
  }
  if (redisAppendCommandArgv(context_, static_cast<int>(argv.size()), ptrs.data(), lens.data()) !=
      REDIS_OK) {
    return ContextError(context_, "append");
  }
  return Status::Ok();
}

Result<std::string> RedisConnection::Command(std::span<const std::string_view> argv) {
  KVTIER_RETURN_IF_ERROR(AppendArgv(argv));
  KVTIER_ASSIGN_OR_RETURN(ReplyPtr reply, NextReply(context_, argv.empty() ? "command" : argv[0]));
  if (reply->type == REDIS_REPLY_INTEGER) return std::to_string(reply->integer);
  if (reply->type == REDIS_REPLY_NIL) return std::string();
  return std::string(reply->str, reply->len);
}

Status RedisConnection::PipelinedSet(std::span<const std::string_view> keys,
                                     std::span<const std::span<const uint8_t>> values) {
  for (size_t i = 0; i < keys.size(); ++i) {
    const std::string_view argv[] = {
        "SET", keys[i], {reinterpret_cast<const char*>(values[i].data()), values[i].size()}};
    KVTIER_RETURN_IF_ERROR(AppendArgv(argv));
  }
  // Read every reply even after an error, so the connection stays in step.
  Status first;
  for (size_t i = 0; i < keys.size(); ++i) {
    auto reply = NextReply(context_, "SET");
    if (!reply && first.ok()) first = reply.error();
    if (!reply && reply.error().code() == StatusCode::kIoError) return first;
  }
  return first;
}

Status RedisConnection::PipelinedGet(std::span<const std::string_view> keys,
                                     std::span<const std::span<uint8_t>> out) {
  for (const std::string_view key : keys) {
    const std::string_view argv[] = {"GET", key};
    KVTIER_RETURN_IF_ERROR(AppendArgv(argv));
  }
  Status first;
  for (size_t i = 0; i < keys.size(); ++i) {
    auto reply = NextReply(context_, "GET");
    if (!reply) {
      if (first.ok()) first = reply.error();
      if (reply.error().code() == StatusCode::kIoError) return first;
      continue;
    }
    const redisReply& r = **reply;
    if (r.type == REDIS_REPLY_STRING && r.len == out[i].size()) {
      std::memcpy(out[i].data(), r.str, r.len);
    } else if (first.ok()) {
      first =
          r.type == REDIS_REPLY_NIL
              ? Status(StatusCode::kNotFound, "redis GET: key " + std::to_string(i) + " missing")
              : Status(StatusCode::kCorruption, "redis GET: key " + std::to_string(i) +
                                                    ": reply of type " + std::to_string(r.type) +
                                                    ", " + std::to_string(r.len) + " bytes");
    }
  }
  return first;
}

Result<uint32_t> RedisConnection::PipelinedExists(std::span<const std::string_view> keys) {
  for (const std::string_view key : keys) {
    const std::string_view argv[] = {"EXISTS", key};
    KVTIER_RETURN_IF_ERROR(AppendArgv(argv));
  }
  uint32_t leading = 0;
  bool in_prefix = true;
  Status first;
  for (size_t i = 0; i < keys.size(); ++i) {
    auto reply = NextReply(context_, "EXISTS");
    if (!reply) {
      if (first.ok()) first = reply.error();
      if (reply.error().code() == StatusCode::kIoError) break;
      continue;
    }
    in_prefix = in_prefix && (*reply)->type == REDIS_REPLY_INTEGER && (*reply)->integer == 1;
    leading += in_prefix ? 1 : 0;
  }
  if (!first.ok()) return Err(std::move(first));
  return leading;
}

Result<uint64_t> RedisConnection::CountExisting(std::span<const std::string_view> keys) {
  std::vector<std::string_view> argv = {"EXISTS"};
  argv.insert(argv.end(), keys.begin(), keys.end());
  KVTIER_RETURN_IF_ERROR(AppendArgv(argv));
  KVTIER_ASSIGN_OR_RETURN(ReplyPtr reply, NextReply(context_, "EXISTS"));
  if (reply->type != REDIS_REPLY_INTEGER)
    return Err(StatusCode::kInternal, "redis EXISTS: not an integer reply");
  return static_cast<uint64_t>(reply->integer);
}

// ---- lookup's baseline

Result<RedisLookupTimes> RedisLookupMicros(std::span<const BlockKey> keys, uint32_t reps) {
  KVTIER_ASSIGN_OR_RETURN(std::unique_ptr<RedisServer> server, RedisServer::Start({}));
  KVTIER_ASSIGN_OR_RETURN(std::unique_ptr<RedisConnection> redis,
                          RedisConnection::Connect(server->socket_path()));
  std::vector<std::string_view> redis_keys;
  for (const BlockKey& k : keys) redis_keys.push_back(RedisKey(k));
  const uint8_t one = 1;
  const std::vector<std::span<const uint8_t>> values(keys.size(),
                                                     std::span<const uint8_t>(&one, 1));
  KVTIER_RETURN_IF_ERROR(redis->PipelinedSet(redis_keys, values));
  RedisLookupTimes times;
  times.version = server->version();
  times.pipelined_us.reserve(reps);
  times.count_us.reserve(reps);
  // Up to 100 untimed round trips first, as kvtier's side has.
  for (uint32_t i = 0; i < std::min(reps, 100u); ++i) {
    KVTIER_ASSIGN_OR_RETURN(const uint32_t found, redis->PipelinedExists(redis_keys));
    (void)found;
  }
  for (uint32_t i = 0; i < reps; ++i) {
    const auto t0 = Clock::now();
    KVTIER_ASSIGN_OR_RETURN(const uint32_t found, redis->PipelinedExists(redis_keys));
    const auto t1 = Clock::now();
    if (found != keys.size()) {
      return Err(StatusCode::kInternal, "redis EXISTS found " + std::to_string(found) + " of " +
                                            std::to_string(keys.size()) + " keys");
    }
    times.pipelined_us.push_back(Seconds(t1 - t0) * 1e6);
  }
  for (uint32_t i = 0; i < reps; ++i) {
    const auto t0 = Clock::now();
    KVTIER_ASSIGN_OR_RETURN(const uint64_t found, redis->CountExisting(redis_keys));
    const auto t1 = Clock::now();
    if (found != keys.size())
      return Err(StatusCode::kInternal, "redis EXISTS counted " + std::to_string(found));
    times.count_us.push_back(Seconds(t1 - t0) * 1e6);
  }
  return times;
}

// ---- the workload

namespace {

// One way of moving a rep's blocks: store them from the engine's blocks,
// load them into others. Figures per rep, after the warm-up.
struct Side {
  const char* name;
  std::function<Status()> store, load, after;  // `after`: untimed cleanup
  std::vector<double> store_gbps{}, load_gbps{};
  uint64_t bad = 0;
};

}  // namespace

int RedisWorkload(kvtier::Client& client, const Layout& layout, uint32_t blocks, uint32_t reps,
                  const std::string& daemon, const std::string& json) {
  const uint64_t block_bytes = layout.block_bytes();
  const uint64_t op_bytes = uint64_t{blocks} * block_bytes;
  // Blocks [0, blocks) are the engine's to store; [blocks, 2 blocks) receive
  // the loads, each side's in turn.
  auto cache = kvtier::ShmKvCache::Create(layout, 2 * blocks);
  if (!cache) {
    std::fprintf(stderr, "kvtier-bench: %s\n", cache.error().ToString().c_str());
    return 1;
  }
  auto id = client.RegisterKvCache(*cache);
  if (!id) {
    std::fprintf(stderr, "kvtier-bench: register: %s\n", id.error().ToString().c_str());
    return 1;
  }
  // One rep's blocks at a time (FLUSHALL after each side), with room for
  // Redis' own overhead per key and its allocator.
  auto server = RedisServer::Start({.maxmemory_bytes = 2 * op_bytes + (uint64_t{512} << 20)});
  if (!server) {
    std::fprintf(stderr, "kvtier-bench: %s\n", server.error().ToString().c_str());
    return 1;
  }
  auto redis = RedisConnection::Connect((*server)->socket_path());
  auto raw = RespSocket::Connect((*server)->socket_path());
  if (!redis || !raw) {
    std::fprintf(stderr, "kvtier-bench: %s\n",
                 (!redis ? redis.error() : raw.error()).ToString().c_str());
    return 1;
  }
  const std::string redis_name = "Redis " + (*server)->version();
  std::printf(
      "config:   %u blocks of %.1f MiB per op (%.0f MiB), store then load, %u reps (+1 warm-up)\n",
      blocks, static_cast<double>(block_bytes) / (1 << 20),
      static_cast<double>(op_bytes) / (1 << 20), reps);
  std::printf("kvtier:   Store then Load through kvtierd, engine blocks in a memfd ShmKvCache\n");
  std::printf(
      "redis:    %s started by kvtier-bench on unix socket %s, no persistence;\n"
      "          baseline: hiredis, one connection, pipelined SET of every block then pipelined "
      "GET,\n"
      "          each value copied into the cache block a load fills;\n"
      "          ceiling:  hand-rolled RESP, writev from and read() into the cache blocks "
      "(informational)\n",
      redis_name.c_str(), (*server)->socket_path().c_str());
  std::fflush(stdout);

  std::vector<std::span<const uint8_t>> sources(blocks);
  std::vector<std::span<uint8_t>> targets(blocks);
  for (uint32_t i = 0; i < blocks; ++i) {
    sources[i] = cache->block(i);
    targets[i] = cache->block(blocks + i);
  }
  std::vector<kvtier::BlockKey> keys;
  std::vector<std::string_view> redis_keys;
  const auto flush_redis = [&]() -> Status {
    const std::string_view flush[] = {"FLUSHALL"};
    auto r = (*redis)->Command(flush);
    return r ? Status::Ok() : r.error();
  };
  const auto op_status = [&](const char* what, const Result<OpResult>& r) -> Status {
    if (!r) return r.error().WithContext(what);
    if (r->blocks != blocks) {
      return Status(StatusCode::kInternal, std::string(what) + ": " + std::to_string(r->blocks) +
                                               " of " + std::to_string(blocks) + " blocks");
    }
    return Status::Ok();
  };
  Side sides[] = {
      {.name = "kvtier",
       .store = [&] { return op_status("kvtier store", client.Store(*id, keys, Iota(0, blocks))); },
       .load =
           [&] { return op_status("kvtier load", client.Load(*id, keys, Iota(blocks, blocks))); },
       // Keeps the host tier from filling across reps (best effort: a
       // shared daemon may not let this client evict).
       .after =
           [&] {
             (void)client.Evict();
             return Status::Ok();
           }},
      {.name = "redis",
       .store = [&] { return (*redis)->PipelinedSet(redis_keys, sources); },
       .load = [&] { return (*redis)->PipelinedGet(redis_keys, targets); },
       .after = flush_redis},
      {.name = "ceiling",
       .store = [&] { return raw->SetAll(redis_keys, sources); },
       .load = [&] { return raw->GetAll(redis_keys, targets); },
       .after = flush_redis},
  };
  constexpr size_t kSides = std::size(sides);
  const double gb = static_cast<double>(op_bytes) / 1e9;
  for (uint32_t rep = 0; rep <= reps; ++rep) {
    auto computed = client.ComputeKeys(*id, kvtier::PseudoTokens(rep + 1, size_t{blocks} * 16));
    if (!computed) {
      std::fprintf(stderr, "kvtier-bench: keys: %s\n", computed.error().ToString().c_str());
      return 1;
    }
    keys = std::move(*computed);
    redis_keys.assign(blocks, {});
    for (uint32_t i = 0; i < blocks; ++i) redis_keys[i] = RedisKey(keys[i]);
    for (uint32_t i = 0; i < blocks; ++i) kvtier::FillFromKey(keys[i], cache->block(i));
    std::string line =
        rep == 0 ? "warm-up: " : "rep " + std::to_string(rep) + "/" + std::to_string(reps) + ":";
    // Rotate which side goes first, so none always finds the source blocks
    // fresh in the CPU caches or follows another's cleanup.
    for (size_t k = 0; k < kSides; ++k) {
      Side& side = sides[(rep + k) % kSides];
      std::memset(cache->block(blocks).data(), 0,
                  op_bytes);  // a load that copies nothing fails verification
      const auto t0 = Clock::now();
      Status st = side.store();
      const auto t1 = Clock::now();
      if (st.ok()) st = side.load();
      const auto t2 = Clock::now();
      if (!st.ok()) {
        std::fprintf(stderr, "kvtier-bench: %s: %s\n", side.name, st.ToString().c_str());
        return 1;
      }
      for (uint32_t i = 0; i < blocks; ++i) side.bad += !kvtier::MatchesKey(keys[i], targets[i]);
      if (Status after = side.after(); !after.ok()) {
        std::fprintf(stderr, "kvtier-bench: %s: %s\n", side.name, after.ToString().c_str());
        return 1;
      }
      if (rep > 0) {  // rep 0 warms up: first touches of the arenas and of Redis' memory
        side.store_gbps.push_back(gb / Seconds(t1 - t0));
        side.load_gbps.push_back(gb / Seconds(t2 - t1));
      }
      char figures[96];
      std::snprintf(figures, sizeof(figures), " %s store %.2f load %.2f GB/s;", side.name,
                    gb / Seconds(t1 - t0), gb / Seconds(t2 - t1));
      line += figures;
    }
    line.pop_back();
    std::printf("%s\n", line.c_str());
    std::fflush(stdout);
  }

  const Side& kv = sides[0];
  const Side& rd = sides[1];
  const Side& ceiling = sides[2];
  const std::string base = redis_name + ", hiredis, unix socket, pipelined";
  const std::string ceiling_name = redis_name + " ceiling: hand-rolled RESP, no client copies";
  const std::vector<Comparison> cs = {
      {"store 2 MiB blocks (engine -> kvtier/Redis)", Median(kv.store_gbps), Median(rd.store_gbps),
       base + " SET", "GB/s", /*lower_is_better=*/false, /*target=*/5},
      {"load 2 MiB blocks (kvtier/Redis -> engine)", Median(kv.load_gbps), Median(rd.load_gbps),
       base + " GET, copied into the cache", "GB/s", /*lower_is_better=*/false, /*target=*/5},
      {"store vs Redis' ceiling", Median(kv.store_gbps), Median(ceiling.store_gbps), ceiling_name,
       "GB/s"},
      {"load vs Redis' ceiling", Median(kv.load_gbps), Median(ceiling.load_gbps), ceiling_name,
       "GB/s"},
  };
  PrintComparisons(cs);
  const uint64_t total = uint64_t{blocks} * (reps + 1);
  std::printf(
      "verified: loaded blocks byte-exact: kvtier %lu, Redis %lu, Redis ceiling %lu, of %lu each\n",
      total - kv.bad, total - rd.bad, total - ceiling.bad, total);
  if (!json.empty() &&
      !WriteJson(
          json,
          {{"workload", "redis"},
           {"blocks", std::to_string(blocks)},
           {"block_bytes", std::to_string(block_bytes)},
           {"reps", std::to_string(reps)},
           {"daemon", daemon},
           {"redis_version", (*server)->version()},
           {"redis",
            "unix socket, --save '' --appendonly no, noeviction, one connection, pipelined"}},
          cs)) {
    std::fprintf(stderr, "kvtier-bench: cannot write %s\n", json.c_str());
    return 1;
  }
  return kv.bad == 0 && rd.bad == 0 && ceiling.bad == 0 ? 0 : 1;
}

}  // namespace kvtier::bench
