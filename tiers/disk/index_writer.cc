#include "tiers/disk/index_writer.h"

#include <rocksdb/db.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <vector>

namespace kvtier {

namespace {

// The most often DB::Resume is tried while writes fail (it flushes the
// memtables, which fails at once while the volume is still full).
constexpr std::chrono::seconds kResumeEvery{1};

}  // namespace

IndexWriter::IndexWriter(rocksdb::DB* db) : db_(db), thread_([this] { Run(); }) {}

IndexWriter::~IndexWriter() {
  {
    MutexLock lock(&mu_);
    stop_ = true;
  }
  cv_.SignalAll();
  thread_.join();
}

void IndexWriter::Submit(rocksdb::WriteBatch batch, bool sync, Done done, Build build) {
  {
    MutexLock lock(&mu_);
    queue_.push_back(Job{std::move(batch), sync, std::move(done), std::move(build)});
  }
  cv_.Signal();
}

uint64_t IndexWriter::pending() const {
  MutexLock lock(&mu_);
  return queue_.size() + running_;
}

void IndexWriter::Run() {
  while (true) {
    std::deque<Job> jobs;
    {
      MutexLock lock(&mu_);
      while (queue_.empty() && !stop_) cv_.Wait(&mu_);
      if (queue_.empty()) return;  // stopping, and nothing left
      jobs.swap(queue_);
      running_ = jobs.size();
    }
    // Each batch is applied as it comes; the last one of the group is
    // written synced when any job needs it, which syncs the log with every
    // write before it (one fsync for the group). Never a separate SyncWAL:
    // after a failed write, RocksDB 7.8 asserts on one.
    MaybeResume();
    bool need_sync = false;
    for (const Job& job : jobs) need_sync = need_sync || job.sync;
    std::vector<Status> results;
    results.reserve(jobs.size());
    for (size_t i = 0; i < jobs.size(); ++i) {
      if (jobs[i].build) jobs[i].build(&jobs[i].batch);
      rocksdb::WriteOptions options;
      options.sync = need_sync && i + 1 == jobs.size();
      const rocksdb::Status s = db_->Write(options, &jobs[i].batch);
      results.push_back(s.ok() ? Status::Ok()
                               : Status(StatusCode::kIoError,
                                        "writing the disk index: " + s.ToString(),
                                        ErrorSource::kRocksDb, static_cast<int>(s.code())));
    }
    failing_ = std::any_of(results.begin(), results.end(), [](const Status& st) { return !st.ok(); });
    // A synced job is durable only if the group's sync happened: when the
    // last write failed, it did not, so every synced job fails too. (Each of
    // kvtier's batches is well formed, so a write fails only when RocksDB
    // does, which stops it: the earlier writes of the group are then not
    // durable either.)
    const Status synced = results.back();
    for (size_t i = 0; i < jobs.size(); ++i) {
      Status st = std::move(results[i]);
      if (st.ok() && jobs[i].sync && !synced.ok()) st = synced;
      if (jobs[i].done) jobs[i].done(std::move(st));
    }
    MutexLock lock(&mu_);
    running_ = 0;
  }
}

void IndexWriter::MaybeResume() {
  if (!failing_ || std::chrono::steady_clock::now() < next_resume_) return;
  next_resume_ = std::chrono::steady_clock::now() + kResumeEvery;
  // OK at once when RocksDB is not stopped (the failure was the write's own).
  const rocksdb::Status s = db_->Resume();
  if (s.ok()) {
    if (resume_failures_ > 0) spdlog::info("disk index: RocksDB resumed after {} tries", resume_failures_ + 1);
    resume_failures_ = 0;
    return;
  }
  if (resume_failures_++ % 60 == 0) {
    spdlog::warn("disk index: RocksDB cannot resume writes yet ({} tries): {}", resume_failures_, s.ToString());
  }
}

}  // namespace kvtier
