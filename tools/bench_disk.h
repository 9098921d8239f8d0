// kvtier-bench disk: demotion (host -> disk) and promotion (disk -> host,
// disk -> engine) of 2 MiB blocks through kvtierd, next to fio with the same
// bytes, block size, queues and depth (writes ending in an fsync) and a
// file-per-block store; the median of several repetitions. Each part follows
// the same preconditioning write, and fio and kvtier take turns going
// first; fio's spread is printed.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "kvtier/client.h"

namespace kvtier::bench {

struct DiskConfig {
  uint32_t blocks = 256;
  uint32_t queue_depth = 32;
  uint32_t io_threads = 2;
  std::string dir;
  // kvtierd's segment file, when the bench started the daemon (a fresh
  // segment, which fills from its first region): fio then also reads the
  // records kvtier just read, at the same offsets of the same file.
  std::string segment_file = {};
  // Set by Disk, not the command line: fio's buffers in 2 MiB pages.
  bool fio_huge_pages = false;
};

// `reps` repetitions, each against the daemon `connect(rep)` returns, every
// repetition's ratios printed and the medians compared (JSON to `json`
// unless empty). Returns the process exit code.
int Disk(const std::function<std::unique_ptr<kvtier::Client>(uint32_t rep)>& connect,
         const DiskConfig& config, uint32_t reps, const std::string& json);

}  // namespace kvtier::bench
