// IndexWriter: the disk index's RocksDB writes, on a thread of their own.
//
// The event loop never waits for a write-ahead-log fsync: DiskTier hands
// every index change (group commits' puts, reclaims' deletes, forgotten
// blocks) to Submit and learns the outcome through `done`. Jobs run in the
// order they were submitted, so a delete submitted before a put of the same
// key always lands first. Jobs that queue up while one runs are written one
// after the other and share one WAL sync (a group commit of the index).
//
// A failed write may leave RocksDB stopped: a hard background error (ENOSPC
// on its log, say) fails every later write until DB::Resume clears it, which
// RocksDB does not do by itself. While writes fail, the writer tries Resume
// before a group, at most once per kResumeEvery: once the cause is gone
// (space is back), writes go on.
//
// Thread-safe. The destructor runs every job submitted before it began,
// then joins the thread.
#pragma once

#include <rocksdb/write_batch.h>

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <thread>

#include "common/mutex.h"
#include "common/status.h"

namespace rocksdb {
class DB;
}  // namespace rocksdb

namespace kvtier {

class IndexWriter {
 public:
  // Runs on the writer thread with the job's outcome: for a synced job, Ok
  // only once the batch and everything submitted before it are durable.
  using Done = std::function<void(Status)>;
  // Runs on the writer thread just before the job's batch is written, after
  // every job submitted before it: adds to the batch what depends on the
  // index as it is then (it may read `db`).
  using Build = std::function<void(rocksdb::WriteBatch*)>;

  // `db` is borrowed and must outlive the writer.
  explicit IndexWriter(rocksdb::DB* db);
  ~IndexWriter();
  IndexWriter(const IndexWriter&) = delete;
  IndexWriter& operator=(const IndexWriter&) = delete;

  void Submit(rocksdb::WriteBatch batch, bool sync, Done done, Build build = nullptr);

  // Jobs submitted and not yet done.
  uint64_t pending() const;

 private:
  struct Job {
    rocksdb::WriteBatch batch;
    bool sync = false;
    Done done;
    Build build;
  };
  void Run();
  // Before a group, while the last one failed: DB::Resume, when due.
  void MaybeResume();

  rocksdb::DB* const db_;
  // The writer thread's own.
  bool failing_ = false;
  uint64_t resume_failures_ = 0;
  std::chrono::steady_clock::time_point next_resume_{};
  mutable Mutex mu_;
  CondVar cv_;
  std::deque<Job> queue_ KVTIER_GUARDED_BY(mu_);
  uint64_t running_ KVTIER_GUARDED_BY(mu_) = 0;
  bool stop_ KVTIER_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace kvtier
