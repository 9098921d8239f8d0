// IoEngine: RunToCompletion, Create, and the pread/pwrite thread pool. The
// io_uring engine is in io_uring_engine.cc; what both share is in
// io_engine_internal.h.
//
// Both engines keep reads ahead of writes and syncs, and cut writes into
// chunks of max_write_chunk_bytes, so a read submitted while a large write is
// running waits for at most one chunk, never for the whole write; and both
// let a write or sync chunk through after every reads_per_write reads while
// both kinds wait (PickNextChunk), so writes are never starved. Everything
// submitted before destruction runs to completion; Submit during destruction
// is answered kCancelled, inline.
#include "tiers/disk/io_engine.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <deque>
#include <thread>
#include <utility>
#include <vector>

#include "common/mutex.h"
#include "tiers/disk/io_engine_internal.h"

namespace kvtier {
namespace {

using io_internal::CancelOp;
using io_internal::Chunk;
using io_internal::ClassifyTransfer;
using io_internal::Describe;
using io_internal::FinishOp;
using io_internal::HasChunksToStart;
using io_internal::IoCounters;
using io_internal::IsRead;
using io_internal::kMaxRetries;
using io_internal::kMaxTransferBytes;
using io_internal::Op;
using io_internal::Pick;
using io_internal::PickNextChunk;
using io_internal::Step;
using io_internal::TakeChunk;
using io_internal::Turn;

// Thread-safe. One mutex for the whole pool: this is the fallback engine, and
// blocking system calls, not the lock, bound its throughput.
class ThreadPoolEngine final : public IoEngine {
 public:
  explicit ThreadPoolEngine(const Options& options)
      : max_write_chunk_bytes_(options.max_write_chunk_bytes),
        reads_per_write_(options.reads_per_write),
        counters_(options.threads) {
    for (uint32_t i = 0; i < options.threads; ++i) threads_.emplace_back([this, i] { Work(&counters_[i]); });
  }

  ~ThreadPoolEngine() override {
    {
      MutexLock lock(&mu_);
      stopping_ = true;
    }
    work_cv_.SignalAll();
    for (std::thread& t : threads_) t.join();
  }

  const char* name() const override { return "threadpool"; }

  IoEngineStats stats() const override {
    IoEngineStats s;
    for (const IoCounters& c : counters_) c.AddTo(&s);
    return s;
  }

  // pread/pwrite take any buffer: nothing to register.
  Status RegisterBuffers(std::span<const std::span<uint8_t>>) override { return Status::Ok(); }

  void Submit(IoRequest request) override {
    {
      MutexLock lock(&mu_);
      if (!stopping_) {
        auto op = std::make_unique<Op>(std::move(request));
        (IsRead(*op) ? reads_ : writes_).push_back(std::move(op));
        work_cv_.Signal();
        return;
      }
    }
    CancelOp(std::move(request));
  }

 private:
  void Work(IoCounters* counters) {
    mu_.Lock();
    for (;;) {
      // Ops with nothing (left) to start, empty or failed while queued, go
      // first: they need no thread and count as no turn.
      std::deque<std::unique_ptr<Op>>* done_queue =
          !reads_.empty() && !HasChunksToStart(*reads_.front())     ? &reads_
          : !writes_.empty() && !HasChunksToStart(*writes_.front()) ? &writes_
                                                                    : nullptr;
      if (done_queue != nullptr) {
        PopLocked(done_queue);
        continue;
      }
      const Pick pick =
          PickNextChunk(!reads_.empty(), !writes_.empty(), reads_in_a_row_, reads_per_write_);
      if (pick.turn == Turn::kNone) {
        if (stopping_) break;
        counters->WaitBegins();
        work_cv_.Wait(&mu_);
        counters->WaitEnds();
        continue;
      }
      reads_in_a_row_ = pick.reads_in_a_row;
      std::deque<std::unique_ptr<Op>>* queue = pick.turn == Turn::kRead ? &reads_ : &writes_;
      Op* op = queue->front().get();
      const Chunk chunk = TakeChunk(op, max_write_chunk_bytes_);
      if (!HasChunksToStart(*op)) PopLocked(queue);
      counters->Started(op->request.op, chunk.length, ++busy_);
      // The request's fields never change once queued: read them unlocked.
      mu_.Unlock();
      Status status = Execute(op->request, chunk);
      mu_.Lock();
      --busy_;
      --op->in_flight;
      if (!status.ok() && op->error.ok()) op->error = std::move(status);
      if (!op->queued && op->in_flight == 0) FinishLocked(std::unique_ptr<Op>(op));
    }
    mu_.Unlock();
  }

  // Takes the front op off `queue`; from here its chunks own it, and the last
  // one to complete finishes it.
  void PopLocked(std::deque<std::unique_ptr<Op>>* queue) KVTIER_REQUIRES(mu_) {
    std::unique_ptr<Op> op = std::move(queue->front());
    queue->pop_front();
    op->queued = false;
    if (op->in_flight == 0) {
      FinishLocked(std::move(op));
    } else {
      (void)op.release();  // owned by its chunks in flight
    }
  }

  // Runs done without the lock: it may Submit more work.
  void FinishLocked(std::unique_ptr<Op> op) KVTIER_REQUIRES(mu_) {
    mu_.Unlock();
    FinishOp(std::move(op));
    mu_.Lock();
  }

  static Status Execute(const IoRequest& request, const Chunk& chunk) {
    const std::string what = Describe(request.op, request.fd, request.offset, request.length);
    if (request.op == IoOp::kSync) {
      for (int attempt = 0;; ++attempt) {
        if (fdatasync(request.fd) == 0) return Status::Ok();
        const int err = errno;
        if (err != EINTR || attempt >= kMaxRetries) return Status::FromErrno(err, what);
      }
    }
    const int fd = request.fd;
    const bool read = request.op == IoOp::kRead;
    auto transfer = [fd, read](uint64_t offset, uint8_t* buffer, uint64_t length) -> ssize_t {
      const size_t n = static_cast<size_t>(std::min(length, kMaxTransferBytes));
      const ssize_t moved = read ? pread(fd, buffer, n, static_cast<off_t>(offset))
                                 : pwrite(fd, buffer, n, static_cast<off_t>(offset));
      return moved < 0 ? -errno : moved;
    };
    Result<uint64_t> moved = RunToCompletion(transfer, request.offset + chunk.begin,
                                             request.buffer + chunk.begin, chunk.length, what);
    return moved ? Status::Ok() : moved.error();
  }

  const uint64_t max_write_chunk_bytes_;
  const uint32_t reads_per_write_;
  std::vector<IoCounters> counters_;  // a thread's each; thread-safe
  Mutex mu_;
  CondVar work_cv_;  // signalled when work is queued or stopping_ is set
  std::deque<std::unique_ptr<Op>> reads_ KVTIER_GUARDED_BY(mu_);
  std::deque<std::unique_ptr<Op>> writes_ KVTIER_GUARDED_BY(mu_);  // and syncs
  // Read chunks started in a row while writes waited (PickNextChunk).
  uint32_t reads_in_a_row_ KVTIER_GUARDED_BY(mu_) = 0;
  bool stopping_ KVTIER_GUARDED_BY(mu_) = false;
  uint32_t busy_ KVTIER_GUARDED_BY(mu_) = 0;  // threads in a system call: the depth the device sees
  std::vector<std::thread> threads_;
};

}  // namespace

Result<uint64_t> RunToCompletion(const TransferFn& transfer, uint64_t offset, uint8_t* buffer,
                                 uint64_t length, const std::string& what, int max_retries) {
  uint64_t moved = 0;
  int retries = 0;
  while (moved < length) {
    const ssize_t res = transfer(offset + moved, buffer + moved, length - moved);
    Step step = ClassifyTransfer(res, length - moved, &retries, max_retries,
                                 [&what]() -> const std::string& { return what; });
    switch (step.kind) {
      case Step::kProgress:
        moved += step.bytes;
        break;
      case Step::kRetry:
        break;
      case Step::kFail:
        return Err(std::move(step.error));
    }
  }
  return moved;
}

Result<std::unique_ptr<IoEngine>> IoEngine::Create(const Options& options) {
  if (options.threads == 0) return Err(InvalidArgument("IoEngine: threads must be at least 1"));
  if (options.queue_depth == 0 || options.queue_depth > 4096) {
    return Err(InvalidArgument("IoEngine: queue_depth must be in [1, 4096], got " +
                               std::to_string(options.queue_depth)));
  }
  if (options.reads_per_write == 0) {
    // A write first whenever one waits would queue reads behind writes.
    return Err(InvalidArgument("IoEngine: reads_per_write must be at least 1"));
  }
  if (options.max_write_chunk_bytes == 0 || options.max_write_chunk_bytes % 4096 != 0 ||
      options.max_write_chunk_bytes > kMaxTransferBytes) {
    // Chunks of an O_DIRECT write must stay 4 KiB aligned.
    return Err(InvalidArgument(
        "IoEngine: max_write_chunk_bytes must be a multiple of 4096 in (0, 1 GiB], got " +
        std::to_string(options.max_write_chunk_bytes)));
  }
  switch (options.kind) {
    case IoEngineKind::kThreadPool:
      return std::unique_ptr<IoEngine>(std::make_unique<ThreadPoolEngine>(options));
    case IoEngineKind::kIoUring:
      return io_internal::CreateUringEngine(options);
    case IoEngineKind::kAuto: {
      Result<std::unique_ptr<IoEngine>> uring = io_internal::CreateUringEngine(options);
      if (uring || uring.error().code() != StatusCode::kUnimplemented) return uring;
      // io_uring is unavailable here (the caller logs name()): threads.
      return std::unique_ptr<IoEngine>(std::make_unique<ThreadPoolEngine>(options));
    }
  }
  return Err(InvalidArgument("IoEngine: unknown engine kind"));
}

}  // namespace kvtier