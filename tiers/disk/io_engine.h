// IoEngine: runs positioned reads, writes and fdatasyncs on file descriptors,
// asynchronously. Two implementations, chosen at start-up (and logged):
//   - io_uring: one ring per I/O thread, batched submission, queue depth from
//     the config, registered (fixed) buffers for the host pool;
//   - a preadv/pwritev thread pool, for kernels or seccomp profiles without
//     io_uring.
// Both schedule alike (one policy, PickNextChunk in io_engine_internal.h):
// reads start ahead of writes and syncs, and large writes are split, so a
// read never waits behind a whole write; but while both kinds wait, writes
// and syncs get a guaranteed share (Options::reads_per_write), so a
// sustained read load cannot starve them.
//
// The retry rules (short transfers continue where they stopped; EINTR and
// EAGAIN are retried; any other error is final with its errno) live in one
// pure function, RunToCompletion, tested without a ring.
//
// Thread-safe. Destruction completes everything submitted before it began
// (I/O and done callbacks), answers Submit calls made meanwhile (e.g. from a
// done) with kCancelled, then joins the threads.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>

#include "common/io_engine_kind.h"
#include "common/status.h"

namespace kvtier {

enum class IoOp : uint8_t { kRead, kWrite, kSync };

struct IoRequest {
  IoOp op = IoOp::kRead;
  int fd = -1;                 // borrowed; must stay open until `done`
  uint64_t offset = 0;
  uint8_t* buffer = nullptr;   // must stay valid until `done`
  uint64_t length = 0;
  std::function<void(Result<uint64_t>)> done = nullptr;  // bytes transferred, or the error
};

// What an engine's threads did since it started (IoEngine::stats): device
// operations started (a request split into chunks counts each chunk; a
// short transfer's rest does not count again), their bytes, the operations
// in flight on the starting thread as each started (itself included:
// depth_sum / operations is the mean depth the device saw from it), and
// the threads' time waiting for work or completions against their lifetime.
struct IoEngineStats {
  uint64_t reads = 0;
  uint64_t writes = 0;
  uint64_t syncs = 0;
  uint64_t read_bytes = 0;
  uint64_t write_bytes = 0;
  uint64_t depth_sum = 0;
  uint64_t idle_ns = 0;
  uint64_t thread_ns = 0;
};

class IoEngine {
 public:
  struct Options {
    IoEngineKind kind = IoEngineKind::kAuto;  // kAuto: io_uring if it works here, else threads
    uint32_t threads = 2;
    uint32_t queue_depth = 64;
    // Writes larger than this are split, so that reads can run in between.
    uint64_t max_write_chunk_bytes = 1 << 20;
    // While reads and writes (or syncs) both wait, at most this many read
    // chunks start in a row before a write or sync chunk does: writes and
    // syncs get at least 1 / (reads_per_write + 1) of the chunks started
    // then, and queued reads give up one turn, to one write chunk of at most
    // max_write_chunk_bytes, per reads_per_write reads started. Default 4:
    // writes keep at least a fifth of the starts under a sustained read
    // load, and reads keep the rest. At least 1 (Create refuses 0).
    uint32_t reads_per_write = 4;
  };

  // Errors: kUnimplemented when io_uring was asked for and is unavailable
  // (the message says why: kernel, seccomp, memlock).
  static Result<std::unique_ptr<IoEngine>> Create(const Options& options);
  virtual ~IoEngine() = default;

  // "io_uring" or "threadpool".
  virtual const char* name() const = 0;

  // Registers `buffers` (e.g. the host pool) for fixed-buffer I/O where the
  // engine supports it; requests whose buffer lies inside one use it. The
  // memory must outlive the engine. Safe to skip: then plain I/O is used.
  virtual Status RegisterBuffers(std::span<const std::span<uint8_t>> buffers) = 0;

  // Queues `request`; its done runs once, on an engine thread, with the full
  // length (0 for a sync) or the first error. Reads are started ahead of
  // queued writes and syncs, except that while both wait, a write or sync
  // chunk starts after every Options::reads_per_write read chunks; a sync
  // covers the writes whose done ran before it was submitted. A read or
  // write of length 0 completes with 0 without a system call (a way to run a
  // callback on an engine thread). During destruction, done runs inline with
  // kCancelled instead.
  virtual void Submit(IoRequest request) = 0;

  // Thread-safe; each figure exact, the set taken a few operations apart.
  virtual IoEngineStats stats() const = 0;
};

// One transfer attempt: returns bytes moved (>= 0) or -errno.
using TransferFn = std::function<ssize_t(uint64_t offset, uint8_t* buffer, uint64_t length)>;

// Calls `transfer` until `length` bytes moved: continues after short
// transfers, retries -EINTR and -EAGAIN (at most `max_retries` times in a
// row), and fails with the errno of any other error. A transfer of 0 bytes
// before the end is an error (kIoError, "unexpected end of file"), never a
// silent short read. `what` names the operation in errors.
Result<uint64_t> RunToCompletion(const TransferFn& transfer, uint64_t offset, uint8_t* buffer,
                                 uint64_t length, const std::string& what, int max_retries = 100);

}  // namespace kvtier
