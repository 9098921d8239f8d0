// Internals shared by the IoEngine implementations (io_engine.cc: the thread
// pool, RunToCompletion and Create; io_uring_engine.cc: the io_uring engine):
// the retry rules, the bookkeeping of requests cut into chunks, and the
// policy that picks which chunk starts next (PickNextChunk). Not part
// of the tiers API; include only from those two files and their tests.
//
// Op and Chunk are thread-compatible: each is touched only by the scheduler
// that owns it (an io_uring thread, or the thread pool under its mutex).
#pragma once

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "common/status.h"
#include "tiers/disk/io_engine.h"

namespace kvtier::io_internal {

// Consecutive EINTR/EAGAIN answers tolerated for one transfer.
inline constexpr int kMaxRetries = 100;
// The most one system call or SQE is asked to move: an SQE's length is 32
// bits, Linux moves at most MAX_RW_COUNT (2 GiB - 4 KiB) per call, and one
// registered buffer may be at most 1 GiB. A multiple of 4096, so the pieces
// of an O_DIRECT request stay aligned.
inline constexpr uint64_t kMaxTransferBytes = uint64_t{1} << 30;

inline std::string Describe(IoOp op, int fd, uint64_t offset, uint64_t length) {
  const char* verb = op == IoOp::kRead ? "read" : op == IoOp::kWrite ? "write" : "fdatasync";
  std::string out = verb;
  out += " fd " + std::to_string(fd);
  if (op != IoOp::kSync) {
    out += " offset " + std::to_string(offset) + " length " + std::to_string(length);
  }
  return out;
}

// What to do after one transfer attempt that asked for `requested` (> 0)
// bytes and got `res` (bytes moved, or -errno). RunToCompletion and the
// io_uring completion path both use it, so the two engines cannot drift apart.
// `what()` names the operation; it is called only to build an error, keeping
// string work off the success path.
struct Step {
  enum Kind { kProgress, kRetry, kFail };
  Kind kind = kFail;
  uint64_t bytes = 0;  // kProgress: bytes moved
  Status error;        // kFail
};

template <typename What>
Step ClassifyTransfer(int64_t res, uint64_t requested, int* consecutive_retries, int max_retries,
                      const What& what) {
  if (res > 0) {
    if (static_cast<uint64_t>(res) > requested) {
      return {Step::kFail, 0,
              Internal(what() + ": moved " + std::to_string(res) + " bytes, asked for " +
                       std::to_string(requested))};
    }
    *consecutive_retries = 0;
    return {Step::kProgress, static_cast<uint64_t>(res), Status()};
  }
  if (res == 0) {
    // A silent short read would hand the caller stale bytes as data.
    return {
        Step::kFail, 0,
        Status(StatusCode::kIoError, what() + ": unexpected end of file (0 bytes transferred, " +
                                         std::to_string(requested) + " left)")};
  }
  const int err = static_cast<int>(-res);
  if (err == EINTR || err == EAGAIN) {
    if (++*consecutive_retries <= max_retries) return {Step::kRetry, 0, Status()};
    return {Step::kFail, 0,
            Status::FromErrno(
                err, what() + ": still failing after " + std::to_string(max_retries) + " retries")};
  }
  return {Step::kFail, 0, Status::FromErrno(err, what())};
}

// One submitted request and how far it got. A request is cut into chunks
// (writes at max_write_chunk_bytes, reads at kMaxTransferBytes, a sync is one
// chunk of 0 bytes); several chunks of one request may be in flight at once.
// Accessed only by its scheduler: the io_uring thread that owns it, or the
// thread pool under its mutex.
struct Op {
  explicit Op(IoRequest r) : request(std::move(r)) {}

  IoRequest request;
  uint64_t started_bytes = 0;  // handed to the kernel so far
  bool sync_started = false;
  uint32_t in_flight = 0;  // chunks started and not yet completed
  bool queued = true;      // still owned by its queue; else by its chunks
  Status error;            // the first error; no chunk starts after it
};

inline bool IsRead(const Op& op) { return op.request.op == IoOp::kRead; }

inline bool HasChunksToStart(const Op& op) {
  if (!op.error.ok()) return false;
  if (op.request.op == IoOp::kSync) return !op.sync_started;
  return op.started_bytes < op.request.length;
}

// Which kind of chunk a scheduler starts next.
enum class Turn : uint8_t {
  kNone,   // nothing startable
  kRead,   // the front read's next chunk
  kWrite,  // the front write's or sync's next chunk
};

struct Pick {
  Turn turn = Turn::kNone;
  // The caller's new count of read chunks started in a row while a write or
  // sync could have started instead.
  uint32_t reads_in_a_row = 0;
};

// The scheduling policy of both engines, in one pure function so that they
// cannot drift apart. `read_ready` / `write_ready`: a read / a write or sync
// chunk could start now (queued, and the engine has room for it).
// Reads go first, so that a read waits for at most one write chunk; but while
// both could start, at most `reads_per_write` read chunks start in a row
// (counted in `reads_in_a_row`) before a write or sync chunk does. So of
// every reads_per_write + 1 chunks started while both kinds wait, at least
// one is a write or sync, and a sustained read load cannot starve demotions
// or group commits. Reads started while no write could start are not
// counted: writes that cannot start lose no share to them.
// REQUIRES: reads_per_write >= 1 (0 would queue every read behind writes).
constexpr Pick PickNextChunk(bool read_ready, bool write_ready, uint32_t reads_in_a_row,
                             uint32_t reads_per_write) {
  if (!write_ready) return {read_ready ? Turn::kRead : Turn::kNone, reads_in_a_row};
  if (!read_ready || reads_in_a_row >= reads_per_write) return {Turn::kWrite, 0};
  return {Turn::kRead, reads_in_a_row + 1};
}

// IoEngineStats as one engine thread counts them: updated by that thread,
// read by any (relaxed atomics). A wait under way counts as idle so far.
class IoCounters {
 public:
  void Started(IoOp op, uint64_t bytes, uint32_t depth) {
    ops_[static_cast<size_t>(op)].fetch_add(1, std::memory_order_relaxed);
    if (op != IoOp::kSync) bytes_[static_cast<size_t>(op)].fetch_add(bytes, std::memory_order_relaxed);
    depth_sum_.fetch_add(depth, std::memory_order_relaxed);
  }
  // Around the thread's waits for work or completions.
  void WaitBegins() { wait_start_ns_.store(Now(), std::memory_order_relaxed); }
  void WaitEnds() {
    const uint64_t start = wait_start_ns_.exchange(0, std::memory_order_relaxed);
    idle_ns_.fetch_add(Now() - start, std::memory_order_relaxed);
  }
  // Adds this thread's figures to `s`.
  void AddTo(IoEngineStats* s) const {
    // Idle first, then a wait under way: a wait that ends in between is
    // missed here (and counted by the next), never counted twice.
    const uint64_t idle = idle_ns_.load(std::memory_order_relaxed);
    const uint64_t waiting_since = wait_start_ns_.load(std::memory_order_relaxed);
    const uint64_t now = Now();
    s->idle_ns += idle + (waiting_since != 0 && now > waiting_since ? now - waiting_since : 0);
    s->thread_ns += now - start_ns_;
    s->reads += ops_[static_cast<size_t>(IoOp::kRead)].load(std::memory_order_relaxed);
    s->writes += ops_[static_cast<size_t>(IoOp::kWrite)].load(std::memory_order_relaxed);
    s->syncs += ops_[static_cast<size_t>(IoOp::kSync)].load(std::memory_order_relaxed);
    s->read_bytes += bytes_[static_cast<size_t>(IoOp::kRead)].load(std::memory_order_relaxed);
    s->write_bytes += bytes_[static_cast<size_t>(IoOp::kWrite)].load(std::memory_order_relaxed);
    s->depth_sum += depth_sum_.load(std::memory_order_relaxed);
  }

 private:
  static uint64_t Now() {
    return static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
            .count());
  }

  std::atomic<uint64_t> ops_[3] = {};
  std::atomic<uint64_t> bytes_[2] = {};
  std::atomic<uint64_t> depth_sum_ = 0;
  std::atomic<uint64_t> idle_ns_ = 0;
  std::atomic<uint64_t> wait_start_ns_ = 0;  // 0: not waiting
  const uint64_t start_ns_ = Now();
};

// A piece of an Op: bytes [begin, begin + length) of its request.
struct Chunk {
  Op* op = nullptr;
  uint64_t begin = 0;
  uint64_t length = 0;
  uint64_t moved = 0;  // io_uring: bytes of this chunk done so far
  int retries = 0;     // io_uring: consecutive EINTR/EAGAIN
};

// REQUIRES: HasChunksToStart(*op).
inline Chunk TakeChunk(Op* op, uint64_t max_write_chunk_bytes) {
  Chunk chunk;
  chunk.op = op;
  if (op->request.op == IoOp::kSync) {
    op->sync_started = true;
  } else {
    const uint64_t max = IsRead(*op) ? kMaxTransferBytes : max_write_chunk_bytes;
    chunk.begin = op->started_bytes;
    chunk.length = std::min(max, op->request.length - op->started_bytes);
    op->started_bytes += chunk.length;
  }
  ++op->in_flight;
  return chunk;
}

// Runs `done` once, with the full length or the first error.
// REQUIRES: op->in_flight == 0 and no chunk left to start.
inline void FinishOp(std::unique_ptr<Op> op) {
  if (!op->request.done) return;
  if (op->error.ok()) {
    op->request.done(op->request.op == IoOp::kSync ? uint64_t{0} : op->request.length);
  } else {
    op->request.done(Err(std::move(op->error)));
  }
}

inline void CancelOp(IoRequest request) {
  if (request.done) {
    request.done(Err(StatusCode::kCancelled,
                     "I/O engine is shutting down: " +
                         Describe(request.op, request.fd, request.offset, request.length)));
  }
}

// Creates the io_uring engine. Errors: kUnimplemented, errno kept, where
// io_uring cannot be used here (no kernel support, seccomp, sysctl, memlock);
// the errno of eventfd otherwise. REQUIRES: options validated by Create.
Result<std::unique_ptr<IoEngine>> CreateUringEngine(const IoEngine::Options& options);

}  // namespace kvtier::io_internal
