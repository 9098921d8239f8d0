// fio, the baseline and the neighbour of kvtier-bench's disk workloads: a
// run timed against kvtierd's disk tier (`disk`), and a writer beside a
// trace replay (`trace --contend`). Called from the bench's main thread.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <string_view>

#include "kvtier/client.h"

namespace kvtier::bench {

// The bandwidth of direction `rw` ("read" or "write") in fio's JSON output,
// in MB/s (1e6 bytes), all jobs together; 0 when it is not there.
double FioMbps(std::string_view json, std::string_view rw);

// How the device was driven during a run, kvtierd's I/O threads or fio's
// jobs alike: the mean number of operations in flight as each started, the
// mean operation size, syncs per GB moved, and the share of the threads'
// time spent idle (waiting for work or completions).
struct IoShape {
  double depth = 0;
  double size_kib = 0;
  double syncs_per_gb = 0;
  double idle_pct = 0;
};

// kvtierd's I/O threads between two Stats (their disk_io_* counters): the
// size and syncs of the reads with `read`, else of the writes; the depth
// and idle share of all their operations.
IoShape IoShapeBetween(const DaemonStats& before, const DaemonStats& after, bool read);

struct FioRun {
  double mbps = 0;  // all jobs together; 0 if fio failed
  // fio's own figures: depth from its iodepth_level buckets (each counted
  // at its lower bound: 16 stands for 16-31), size its block size, syncs
  // one per job (end_fsync) on writes, idle 100% less its jobs' CPU.
  IoShape shape;
};

// fio's run: `jobs` jobs of `queue_depth` each (one per kvtierd I/O thread,
// each with its own ring of that depth), over disjoint parts of one file,
// and for writes an fsync at the end inside the timed run, since a
// demotion counts only once it is durable. With `huge_pages`, fio's buffers
// are 2 MiB hugetlb pages (--mem=shmhuge), as kvtierd's host tier asks for:
// see FioHugePages.
FioRun Fio(const std::string& file, const std::string& rw, uint64_t size_bytes, uint64_t block_bytes,
           uint32_t queue_depth, uint32_t jobs, bool huge_pages = false);

// The hugetlb pages fio's buffers need for `jobs` jobs of `queue_depth`
// blocks of `block_bytes`, reserved while this lives. kvtierd's host tier is
// in 2 MiB pages (MADV_HUGEPAGE), so a 2 MiB block is one segment for the
// disk's DMA; fio's own buffers are 4 KiB pages, which on this project's
// virtio disk cost fio 35-50% of its read rate: without the same pages fio
// is no measure of the disk. fio can only have huge pages from hugetlb, so
// what is missing of vm.nr_hugepages is added (root only) and put back.
class FioHugePages {
 public:
  FioHugePages(uint32_t jobs, uint32_t queue_depth, uint64_t block_bytes);
  ~FioHugePages();
  FioHugePages(const FioHugePages&) = delete;
  FioHugePages& operator=(const FioHugePages&) = delete;

  bool ok() const { return why_.empty(); }
  // What was reserved, or why there are none.
  const std::string& description() const { return ok() ? description_ : why_; }

 private:
  long restore_ = -1;  // vm.nr_hugepages to put back, or -1
  std::string description_;
  std::string why_;
};

// fio writing to a file of its own in `dir`, from construction until Stop
// (or destruction): sequential 1 MiB O_DIRECT writes at queue depth 8 over
// 1 GiB, as fast as it can (a contended disk).
class BackgroundFio {
 public:
  explicit BackgroundFio(const std::string& dir);
  ~BackgroundFio() { Stop(); }
  BackgroundFio(const BackgroundFio&) = delete;
  BackgroundFio& operator=(const BackgroundFio&) = delete;

  bool running() const { return pid_ > 0; }
  // Stops fio (SIGINT: it ends its jobs and reports) and returns what it
  // wrote, in MB/s; 0 when it did not run or report.
  double Stop();

 private:
  std::string file_;
  std::string output_;
  pid_t pid_ = -1;
  double mbps_ = 0;
};

}  // namespace kvtier::bench
