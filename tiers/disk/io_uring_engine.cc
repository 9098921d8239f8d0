// The io_uring IoEngine: one ring per I/O thread, each fed through a
// mutex-protected queue and an eventfd the ring itself watches (a read on it
// stays armed), so io_uring_submit_and_wait wakes for new work and for
// completions alike, without polling. Chunks are batched into the SQ and
// submitted with one system call per round.
#include <liburing.h>
#include <sys/eventfd.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <deque>
#include <functional>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "common/check.h"
#include "common/mutex.h"
#include "common/unique_fd.h"
#include "tiers/disk/io_engine_internal.h"

namespace kvtier::io_internal {
namespace {

// Owns one io_uring. Move-only; the struct lives on the heap so moving the
// wrapper never moves the ring liburing set up.
class Ring {
 public:
  // Errors: the io_uring_queue_init errno, raw.
  static Result<Ring> Create(unsigned entries) {
    auto ring = std::make_unique<io_uring>();
    const int ret = io_uring_queue_init(entries, ring.get(), 0);
    if (ret < 0) return Err(Status::FromErrno(-ret, "io_uring_queue_init"));
    return Ring(std::move(ring));
  }
  Ring(Ring&&) noexcept = default;
  Ring& operator=(Ring&& other) noexcept {
    if (this != &other) {
      Reset();
      ring_ = std::move(other.ring_);
    }
    return *this;
  }
  ~Ring() { Reset(); }

  io_uring* get() { return ring_.get(); }

 private:
  explicit Ring(std::unique_ptr<io_uring> ring) : ring_(std::move(ring)) {}
  void Reset() {
    if (ring_) io_uring_queue_exit(ring_.get());
    ring_.reset();
  }
  std::unique_ptr<io_uring> ring_;
};

// Why io_uring cannot be used here, as kUnimplemented with the errno kept.
Status Unavailable(int err, std::string_view during) {
  std::string why;
  switch (err) {
    case ENOSYS:
      why = "the kernel has no io_uring";
      break;
    case EPERM:
    case EACCES:
      why = "io_uring is blocked (seccomp profile, or the kernel.io_uring_disabled sysctl)";
      break;
    case ENOMEM:
      why = "not enough locked memory for the ring (raise RLIMIT_MEMLOCK)";
      break;
    default:
      why = "io_uring setup failed";
  }
  return Status(StatusCode::kUnimplemented,
                std::string(during) + ": " + why + ": " + std::strerror(err), ErrorSource::kErrno,
                err);
}

// user_data values that are not Chunk pointers (which are 8-aligned).
constexpr uint64_t kEventTag = 1;
constexpr uint64_t kCancelTag = 2;

// One I/O thread and the ring it owns. Enqueue, RunOnThread and Stop are
// thread-safe; everything under "Owned by the I/O thread" is touched only by
// Run (and by closures RunOnThread runs there).
class UringWorker {
 public:
  UringWorker(Ring ring, UniqueFd event_fd, const IoEngine::Options& options)
      : queue_depth_(options.queue_depth),
        // Half the slots are kept from writes, so a read never waits for a
        // write chunk to complete before it can be submitted.
        write_slots_(std::max<uint32_t>(1, options.queue_depth / 2)),
        max_write_chunk_bytes_(options.max_write_chunk_bytes),
        reads_per_write_(options.reads_per_write),
        ring_(std::move(ring)),
        event_fd_(std::move(event_fd)) {}

  UringWorker(const UringWorker&) = delete;
  UringWorker& operator=(const UringWorker&) = delete;

  void Start() {
    thread_ = std::thread([this] { Run(); });
  }

  // Hands `op` to the thread. Returns it back if the worker is stopping.
  std::unique_ptr<Op> Enqueue(std::unique_ptr<Op> op) KVTIER_EXCLUDES(mu_) {
    {
      MutexLock lock(&mu_);
      if (stopping_) return op;
      incoming_.push_back(std::move(op));
    }
    Wake();
    return nullptr;
  }

  // Runs `fn` on the I/O thread, between submissions, and waits for it.
  // Called from the I/O thread itself (a done callback), runs it inline.
  void RunOnThread(const std::function<void()>& fn) KVTIER_EXCLUDES(mu_) {
    if (std::this_thread::get_id() == thread_.get_id()) {
      fn();
      return;
    }
    Mutex done_mu;
    CondVar done_cv;
    bool done = false;
    {
      MutexLock lock(&mu_);
      controls_.push_back([&] {
        fn();
        MutexLock done_lock(&done_mu);
        done = true;
        done_cv.SignalAll();
      });
    }
    Wake();
    MutexLock lock(&done_mu);
    while (!done) done_cv.Wait(&done_mu);
  }

  // Stops accepting work (Enqueue returns it from now on).
  void BeginStop() KVTIER_EXCLUDES(mu_) {
    {
      MutexLock lock(&mu_);
      stopping_ = true;
    }
    Wake();
  }

  // Waits until everything enqueued completed and the thread exited.
  // What this thread did (IoEngine::stats); thread-safe.
  const IoCounters& counters() const { return counters_; }

  void Join() {
    if (thread_.joinable()) thread_.join();
  }

  // On the I/O thread (through RunOnThread): registers `iovecs` with this
  // worker's ring. Errors: the io_uring_register_buffers errno.
  Status RegisterOnThread(const std::vector<iovec>& iovecs) {
    const int ret =
        io_uring_register_buffers(ring_.get(), iovecs.data(), static_cast<unsigned>(iovecs.size()));
    if (ret < 0) {
      return Status::FromErrno(-ret,
                               "io_uring_register_buffers (" + std::to_string(iovecs.size()) +
                                   " buffers; ENOMEM usually means RLIMIT_MEMLOCK is too low)");
    }
    fixed_.clear();
    for (size_t i = 0; i < iovecs.size(); ++i) {
      const auto start = reinterpret_cast<uintptr_t>(iovecs[i].iov_base);
      fixed_.push_back({start, start + iovecs[i].iov_len, static_cast<int>(i)});
    }
    std::sort(fixed_.begin(), fixed_.end(),
              [](const FixedRegion& a, const FixedRegion& b) { return a.start < b.start; });
    return Status::Ok();
  }

  // On the I/O thread: drops the registration (after a partial failure).
  void UnregisterOnThread() {
    if (fixed_.empty()) return;
    fixed_.clear();
    (void)io_uring_unregister_buffers(ring_.get());  // nothing useful to do if it fails
  }

 private:
  struct FixedRegion {
    uintptr_t start = 0;
    uintptr_t end = 0;
    int index = 0;
  };

  void Wake() {
    // The ring keeps a read on the eventfd armed, so this wakes
    // io_uring_wait_cqe. A write to an eventfd only fails if the counter would
    // overflow, which 2^64 wake-ups cannot reach.
    const uint64_t one = 1;
    ssize_t n;
    do {
      n = write(event_fd_.get(), &one, sizeof(one));
    } while (n < 0 && errno == EINTR);
  }

  void Run() {
    ArmEventRead();
    for (;;) {
      std::deque<std::unique_ptr<Op>> incoming;
      std::deque<std::function<void()>> controls;
      bool stopping;
      {
        MutexLock lock(&mu_);
        incoming.swap(incoming_);
        controls.swap(controls_);
        stopping = stopping_;
      }
      for (auto& control : controls) control();
      for (auto& op : incoming) (IsRead(*op) ? reads_ : writes_).push_back(std::move(op));
      StartChunks();
      // stopping_ was set before this pass looked at incoming_, and Enqueue
      // refuses work after it: nothing can arrive any more.
      if (stopping && reads_.empty() && writes_.empty() && in_flight_ == 0) break;
      SubmitAndWait();
      ReapCompletions();
      // The ring is refilled before what completed is handed back: a done
      // callback (a read record's checksum, its post to the loop) then runs
      // while the device works on the next chunks. A virtio disk completes
      // a whole ring at once, and the checks of 32 records left it idle.
      StartChunks();
      if (io_uring_sq_ready(ring_.get()) > 0) (void)io_uring_submit(ring_.get());  // else by SubmitAndWait
      RunFinished();
    }
    CancelEventRead();
  }

  // Hands back the ops whose last chunk completed, in completion order.
  void RunFinished() {
    for (std::unique_ptr<Op>& op : finished_) FinishOp(std::move(op));
    finished_.clear();
  }

  // Fills the SQ in PickNextChunk's order: reads first, a write or sync
  // chunk after every reads_per_write_ reads while both wait; writes and
  // syncs within write_slots_, at most queue_depth_ chunks in flight.
  // Submitted by the next SubmitAndWait, in one system call.
  void StartChunks() {
    for (;;) {
      // Ops with nothing (left) to start need no slot and count as no turn.
      if (PopIfStarted(&reads_) || PopIfStarted(&writes_)) continue;
      const bool room = in_flight_ < queue_depth_;
      const Pick pick = PickNextChunk(room && !reads_.empty(),
                                      room && !writes_.empty() && writes_in_flight_ < write_slots_,
                                      reads_in_a_row_, reads_per_write_);
      if (pick.turn == Turn::kNone) return;
      reads_in_a_row_ = pick.reads_in_a_row;
      Op* op = (pick.turn == Turn::kRead ? reads_ : writes_).front().get();
      auto chunk = std::make_unique<Chunk>(TakeChunk(op, max_write_chunk_bytes_));
      ++in_flight_;
      counters_.Started(op->request.op, chunk->length, in_flight_);
      if (!IsRead(*op)) ++writes_in_flight_;
      PrepareChunk(chunk.release());  // owned by the SQE until its completion
    }
  }

  // Takes the front op off `queue` once all its chunks started (or it has
  // none, or failed while queued); the last chunk to complete finishes it.
  // Returns whether it took one.
  bool PopIfStarted(std::deque<std::unique_ptr<Op>>* queue) {
    if (queue->empty() || HasChunksToStart(*queue->front())) return false;
    std::unique_ptr<Op> owned = std::move(queue->front());
    queue->pop_front();
    owned->queued = false;
    if (owned->in_flight == 0) {
      FinishOp(std::move(owned));
    } else {
      (void)owned.release();  // owned by its chunks; the last one finishes it
    }
    return true;
  }

  io_uring_sqe* GetSqe() {
    io_uring_sqe* sqe = io_uring_get_sqe(ring_.get());
    if (sqe == nullptr) {
      // Cannot happen with at most queue_depth_ + 2 SQEs per round and a
      // larger SQ, but submitting makes room if it ever does.
      (void)io_uring_submit(ring_.get());
      sqe = io_uring_get_sqe(ring_.get());
    }
    KVTIER_CHECK_MSG(sqe != nullptr, "io_uring submission queue full");
    return sqe;
  }

  // The registered buffer holding [p, p + length), or -1.
  int FixedIndex(const uint8_t* p, uint64_t length) const {
    const auto start = reinterpret_cast<uintptr_t>(p);
    auto it = std::upper_bound(fixed_.begin(), fixed_.end(), start,
                               [](uintptr_t s, const FixedRegion& r) { return s < r.start; });
    if (it == fixed_.begin()) return -1;
    --it;
    return start + length <= it->end ? it->index : -1;
  }

  // Queues an SQE for what is left of `chunk`.
  void PrepareChunk(Chunk* chunk) {
    io_uring_sqe* sqe = GetSqe();
    const IoRequest& r = chunk->op->request;
    const uint64_t skip = chunk->begin + chunk->moved;
    const uint64_t offset = r.offset + skip;
    uint8_t* buffer = r.buffer + skip;
    const auto length = static_cast<unsigned>(chunk->length - chunk->moved);  // <= 1 GiB
    const int fixed = r.op == IoOp::kSync ? -1 : FixedIndex(buffer, length);
    switch (r.op) {
      case IoOp::kRead:
        if (fixed >= 0) {
          io_uring_prep_read_fixed(sqe, r.fd, buffer, length, offset, fixed);
        } else {
          io_uring_prep_read(sqe, r.fd, buffer, length, offset);
        }
        break;
      case IoOp::kWrite:
        if (fixed >= 0) {
          io_uring_prep_write_fixed(sqe, r.fd, buffer, length, offset, fixed);
        } else {
          io_uring_prep_write(sqe, r.fd, buffer, length, offset);
        }
        break;
      case IoOp::kSync:
        io_uring_prep_fsync(sqe, r.fd, IORING_FSYNC_DATASYNC);
        break;
    }
    io_uring_sqe_set_data64(sqe, reinterpret_cast<uintptr_t>(chunk));
  }

  void ArmEventRead() {
    io_uring_sqe* sqe = GetSqe();
    io_uring_prep_read(sqe, event_fd_.get(), &event_value_, sizeof(event_value_), 0);
    io_uring_sqe_set_data64(sqe, kEventTag);
    event_armed_ = true;
  }

  void SubmitAndWait() {
    counters_.WaitBegins();
    const int ret = io_uring_submit_and_wait(ring_.get(), 1);
    counters_.WaitEnds();
    // EINTR: a signal; EAGAIN: the kernel was short of memory for requests;
    // EBUSY: completions must be reaped first. Each is retried by the loop,
    // after reaping whatever completed.
    KVTIER_CHECK_MSG(ret >= 0 || ret == -EINTR || ret == -EAGAIN || ret == -EBUSY,
                     std::string("io_uring_submit_and_wait: ") + std::strerror(-ret));
  }

  void ReapCompletions() {
    io_uring_cqe* cqe = nullptr;
    while (io_uring_peek_cqe(ring_.get(), &cqe) == 0) {
      const uint64_t data = io_uring_cqe_get_data64(cqe);
      const int res = cqe->res;
      io_uring_cqe_seen(ring_.get(), cqe);
      if (data == kEventTag) {
        // The wake-up itself carries nothing: new work is in incoming_.
        event_armed_ = false;
        if (!cancelling_) ArmEventRead();
      } else if (data != kCancelTag) {
        Complete(reinterpret_cast<Chunk*>(data), res);
      }
    }
  }

  void Complete(Chunk* chunk, int res) {
    Op* op = chunk->op;
    const IoRequest& r = op->request;
    Status error;
    if (r.op == IoOp::kSync) {
      if ((res == -EINTR || res == -EAGAIN) && ++chunk->retries <= kMaxRetries) {
        PrepareChunk(chunk);
        return;
      }
      if (res < 0) error = Status::FromErrno(-res, Describe(r.op, r.fd, r.offset, r.length));
    } else {
      const uint64_t left = chunk->length - chunk->moved;
      const uint64_t at = r.offset + chunk->begin + chunk->moved;
      Step step = ClassifyTransfer(res, left, &chunk->retries, kMaxRetries,
                                   [&] { return Describe(r.op, r.fd, at, left); });
      if (step.kind == Step::kProgress) chunk->moved += step.bytes;
      if (step.kind == Step::kRetry ||
          (step.kind == Step::kProgress && chunk->moved < chunk->length)) {
        PrepareChunk(chunk);  // the rest of a short transfer, or a retry
        return;
      }
      if (step.kind == Step::kFail) error = std::move(step.error);
    }
    std::unique_ptr<Chunk> owned(chunk);
    --in_flight_;
    if (!IsRead(*op)) --writes_in_flight_;
    --op->in_flight;
    if (!error.ok() && op->error.ok()) op->error = std::move(error);
    if (!op->queued && op->in_flight == 0) finished_.emplace_back(op);  // run by RunFinished
  }

  // The eventfd read must not outlive the ring's user memory: cancel it and
  // wait for its completion before the thread (and then the ring) goes.
  void CancelEventRead() {
    cancelling_ = true;
    if (!event_armed_) return;
    io_uring_sqe* sqe = GetSqe();
    io_uring_prep_cancel64(sqe, kEventTag, 0);
    io_uring_sqe_set_data64(sqe, kCancelTag);
    while (event_armed_) {
      SubmitAndWait();
      ReapCompletions();
      RunFinished();
    }
  }

  const uint32_t queue_depth_;
  const uint32_t write_slots_;
  const uint64_t max_write_chunk_bytes_;
  const uint32_t reads_per_write_;

  Mutex mu_;
  std::deque<std::unique_ptr<Op>> incoming_ KVTIER_GUARDED_BY(mu_);
  std::deque<std::function<void()>> controls_ KVTIER_GUARDED_BY(mu_);
  bool stopping_ KVTIER_GUARDED_BY(mu_) = false;

  // Owned by the I/O thread.
  Ring ring_;
  UniqueFd event_fd_;  // also written by Wake, from any thread
  uint64_t event_value_ = 0;
  bool event_armed_ = false;
  bool cancelling_ = false;
  std::deque<std::unique_ptr<Op>> reads_;
  std::deque<std::unique_ptr<Op>> writes_;  // and syncs
  std::vector<std::unique_ptr<Op>> finished_;  // completed by ReapCompletions, for RunFinished
  uint32_t in_flight_ = 0;                  // chunks in the kernel
  uint32_t writes_in_flight_ = 0;
  uint32_t reads_in_a_row_ = 0;     // read chunks started while a write could (PickNextChunk)
  std::vector<FixedRegion> fixed_;  // sorted by start
  IoCounters counters_;             // written by the I/O thread, read by any

  std::thread thread_;
};

// Thread-safe.
class UringEngine final : public IoEngine {
 public:
  explicit UringEngine(std::vector<std::unique_ptr<UringWorker>> workers)
      : workers_(std::move(workers)) {
    for (auto& worker : workers_) worker->Start();
  }

  ~UringEngine() override {
    // Refuse new work everywhere first, so a done callback on one worker
    // cannot hand work to a worker that already exited.
    for (auto& worker : workers_) worker->BeginStop();
    for (auto& worker : workers_) worker->Join();
  }

  const char* name() const override { return "io_uring"; }

  Status RegisterBuffers(std::span<const std::span<uint8_t>> buffers) override {
    std::vector<iovec> iovecs;
    for (std::span<uint8_t> buffer : buffers) {
      // The kernel limits one registered buffer to 1 GiB.
      for (uint64_t at = 0; at < buffer.size(); at += kMaxTransferBytes) {
        iovecs.push_back(
            {buffer.data() + at, std::min<uint64_t>(kMaxTransferBytes, buffer.size() - at)});
      }
    }
    if (iovecs.empty()) return InvalidArgument("RegisterBuffers: no memory to register");
    MutexLock lock(&register_mu_);
    if (registered_) {
      return Status(StatusCode::kFailedPrecondition,
                    "RegisterBuffers: buffers are already registered with this engine");
    }
    std::vector<Status> results(workers_.size());
    for (size_t i = 0; i < workers_.size(); ++i) {
      UringWorker* worker = workers_[i].get();
      worker->RunOnThread([&, i, worker] { results[i] = worker->RegisterOnThread(iovecs); });
    }
    for (const Status& status : results) {
      if (status.ok()) continue;
      // All or nothing, so that no ring pins memory the caller was told is
      // not registered.
      for (auto& worker : workers_) {
        UringWorker* w = worker.get();
        w->RunOnThread([w] { w->UnregisterOnThread(); });
      }
      return status;
    }
    registered_ = true;
    return Status::Ok();
  }

  void Submit(IoRequest request) override {
    // Relaxed: the counter only spreads requests over the rings.
    const uint32_t i = next_.fetch_add(1, std::memory_order_relaxed) % workers_.size();
    std::unique_ptr<Op> refused = workers_[i]->Enqueue(std::make_unique<Op>(std::move(request)));
    if (refused) CancelOp(std::move(refused->request));
  }

  IoEngineStats stats() const override {
    IoEngineStats s;
    for (const auto& worker : workers_) worker->counters().AddTo(&s);
    return s;
  }

 private:
  std::vector<std::unique_ptr<UringWorker>> workers_;
  std::atomic<uint32_t> next_{0};
  Mutex register_mu_;  // one RegisterBuffers at a time
  bool registered_ KVTIER_GUARDED_BY(register_mu_) = false;
};

}  // namespace

Result<std::unique_ptr<IoEngine>> CreateUringEngine(const IoEngine::Options& options) {
  // A small ring first, to tell "no io_uring here" apart from other failures.
  Result<Ring> probe_ring = Ring::Create(4);
  if (!probe_ring) return Err(Unavailable(probe_ring.error().raw_code(), "io_uring_queue_init"));
  io_uring_probe* probe = io_uring_get_probe_ring(probe_ring->get());
  if (probe == nullptr) {
    return Err(StatusCode::kUnimplemented,
               "io_uring: the kernel cannot list its opcodes (Linux 5.6 or newer is needed)");
  }
  struct Needed {
    int opcode;
    const char* name;
  };
  const Needed needed[] = {{IORING_OP_READ, "IORING_OP_READ"},
                           {IORING_OP_WRITE, "IORING_OP_WRITE"},
                           {IORING_OP_READ_FIXED, "IORING_OP_READ_FIXED"},
                           {IORING_OP_WRITE_FIXED, "IORING_OP_WRITE_FIXED"},
                           {IORING_OP_FSYNC, "IORING_OP_FSYNC"},
                           {IORING_OP_ASYNC_CANCEL, "IORING_OP_ASYNC_CANCEL"}};
  for (const Needed& n : needed) {
    if (!io_uring_opcode_supported(probe, n.opcode)) {
      io_uring_free_probe(probe);
      return Err(StatusCode::kUnimplemented, std::string("io_uring: the kernel lacks ") + n.name +
                                                 " (Linux 5.6 or newer is needed)");
    }
  }
  io_uring_free_probe(probe);

  std::vector<std::unique_ptr<UringWorker>> workers;
  for (uint32_t i = 0; i < options.threads; ++i) {
    // Room for queue_depth chunks, the eventfd read and its cancellation.
    Result<Ring> ring = Ring::Create(options.queue_depth + 2);
    if (!ring) return Err(Unavailable(ring.error().raw_code(), "io_uring_queue_init"));
    // Blocking on purpose: io_uring answers a read on a non-blocking file
    // with -EAGAIN instead of waiting for it.
    UniqueFd event_fd(eventfd(0, EFD_CLOEXEC));
    if (!event_fd) return Err(Status::FromErrno(errno, "eventfd"));
    workers.push_back(
        std::make_unique<UringWorker>(std::move(*ring), std::move(event_fd), options));
  }
  return std::unique_ptr<IoEngine>(std::make_unique<UringEngine>(std::move(workers)));
}

}  // namespace kvtier::io_internal
