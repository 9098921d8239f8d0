#include "tools/bench_disk.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "common/block_pattern.h"
#include "tiers/disk/record.h"
#include "tools/bench_engine.h"
#include "tools/bench_fio.h"
#include "tools/bench_report.h"

namespace kvtier::bench {
namespace {

// One file per block, each fsynced before it counts as stored; read back
// after dropping those files from the page cache. Returns MB/s.
std::pair<double, double> FilePerBlock(const std::string& dir, uint32_t blocks,
                                       uint64_t block_bytes) {
  std::filesystem::create_directories(dir);
  std::vector<uint8_t> data(block_bytes, 0x5a);
  const auto t0 = Clock::now();
  for (uint32_t i = 0; i < blocks; ++i) {
    const std::string path = dir + "/" + std::to_string(i) + ".blk";
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0 || ::write(fd, data.data(), data.size()) != static_cast<ssize_t>(data.size()) ||
        ::fsync(fd) != 0) {
      if (fd >= 0) ::close(fd);
      return {0, 0};
    }
    ::close(fd);
  }
  const double write_s = Seconds(Clock::now() - t0);
  for (uint32_t i = 0; i < blocks; ++i) {
    const int fd = ::open((dir + "/" + std::to_string(i) + ".blk").c_str(), O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
      ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
      ::close(fd);
    }
  }
  const auto r0 = Clock::now();
  for (uint32_t i = 0; i < blocks; ++i) {
    const int fd = ::open((dir + "/" + std::to_string(i) + ".blk").c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0 || ::read(fd, data.data(), data.size()) != static_cast<ssize_t>(data.size())) {
      if (fd >= 0) ::close(fd);
      return {0, 0};
    }
    ::close(fd);
  }
  const double read_s = Seconds(Clock::now() - r0);
  std::filesystem::remove_all(dir);
  const double mb = static_cast<double>(blocks) * static_cast<double>(block_bytes) / 1e6;
  return {mb / write_s, mb / read_s};
}

// Polls the daemon until `counter` reaches `target`. Every 500 us: often
// enough to time 0.2 s to 0.5%, rarely enough that the polls do not compete
// with the demotions for the event loop on a small machine.
bool WaitForCounter(kvtier::Client& client, const char* counter, uint64_t target) {
  for (;;) {
    auto st = client.Stats();
    if (!st) return false;
    if (st->Counter(counter) >= target) return true;
    std::this_thread::sleep_for(std::chrono::microseconds(500));
  }
}

// One repetition's figures, in MB/s of record bytes (header and payload,
// what goes to the disk), next to its baselines.
struct DiskRep {
  double write = 0, promote = 0, load = 0;
  double fio_write = 0, fio_read = 0, fpb_write = 0, fpb_read = 0;
  // fio reading kvtier's own records in its segment, just before or just
  // after the promotion: the same blocks of the device, seconds apart.
  double fio_read_same = 0;
  uint64_t group_commits = 0;
  uint64_t mismatches = 0;
  bool load_first = false;  // the load read the records back before the promotion
  // How kvtierd's I/O threads and fio's jobs drove the device in each part.
  IoShape write_shape, promote_shape, load_shape, fio_write_shape, fio_read_shape, fio_read_same_shape;
};

// fio as `config` drives kvtierd: as many jobs as I/O threads, each at its
// queue depth, with fio's buffers in the pages Disk gave it.
FioRun FioLike(const DiskConfig& config, const std::string& file, const std::string& rw, uint64_t bytes,
               uint64_t record_bytes) {
  return Fio(file, rw, bytes, record_bytes, config.queue_depth, config.io_threads, config.fio_huge_pages);
}

// The same disk state before kvtier's part of a repetition and before
// fio's: a write of as many bytes as either writes, through fio, made
// durable, and removed. What the disk did just before moves fio's figure by
// half (docs/benchmarks.md); each part now follows the same.
void Precondition(const DiskConfig& config, uint64_t bytes, uint64_t record_bytes) {
  const std::string file = config.dir + "/precondition.dat";
  std::filesystem::remove(file);
  (void)FioLike(config, file, "write", bytes, record_bytes);
  std::filesystem::remove(file);
}

// fio reading the records kvtier just wrote, at their offsets in kvtierd's
// segment (a fresh segment fills from offset 0; a read job opens the file
// read-only), when the bench started the daemon.
void FioSameRecords(const DiskConfig& config, uint64_t bytes, uint64_t record_bytes, DiskRep* out) {
  if (config.segment_file.empty() || !std::filesystem::exists(config.segment_file)) return;
  const FioRun same = FioLike(config, config.segment_file, "read", bytes, record_bytes);
  out->fio_read_same = same.mbps;
  out->fio_read_same_shape = same.shape;
}

// Demotion (host -> disk) and promotion (disk -> host -> engine) of 2 MiB
// blocks through a running kvtierd. `rep` keeps each repetition's keys
// apart. Returns false when a request fails.
bool KvtierOnce(kvtier::Client& client, const DiskConfig& config, uint32_t rep, DiskRep* out) {
  const uint32_t blocks = config.blocks;
  const kvtier::Layout layout = Llama8BLayout();
  const uint64_t block_bytes = layout.block_bytes();
  const uint64_t record_bytes = kvtier::RecordBytes(block_bytes);
  const double mb = static_cast<double>(blocks) * static_cast<double>(record_bytes) / 1e6;
  // Room to store from (32 blocks) and to load every block into its own
  // engine block, so that all loads can be in flight at once.
  auto cache = kvtier::ShmKvCache::Create(layout, 32 + blocks);
  if (!cache) return false;
  const std::optional<kvtier::CacheId> registered = Register(client, *cache);
  if (!registered) return false;
  const kvtier::CacheId id = *registered;

  // Store everything into the host tier (no watermark demotion), then flush
  // it to disk and time the writes.
  std::vector<kvtier::BlockKey> keys;
  for (uint32_t i = 0; i < blocks; i += 32) {
    const uint32_t n = std::min(32u, blocks - i);
    const std::vector<kvtier::BlockKey> k =
        client.ComputeKeys(id, Tokens(1000 + uint64_t{rep} * 1000000 + i, n * 16)).value();
    for (uint32_t j = 0; j < n; ++j) kvtier::FillFromKey(k[j], cache->block(j));
    auto r = client.Store(id, k, Iota(0, n));
    if (!r || r->blocks != n) {
      std::fprintf(stderr, "kvtier-bench: store failed\n");
      return false;
    }
    keys.insert(keys.end(), k.begin(), k.end());
  }
  // An untimed load of every block into the engine blocks the timed load
  // fills: their pages are then allocated and kvtierd's page tables over
  // them filled, as in a daemon that has served that engine for a while, so
  // the timed load pays for the disk and the copy, not for first-touch
  // faults (the blanking below faults in the bench's own).
  for (uint32_t i = 0; i < blocks; i += 32) {
    const uint32_t n = std::min(32u, blocks - i);
    auto r = client.Load(id, std::span(keys).subspan(i, n), Iota(32 + i, n));
    if (!r || r->blocks != n) {
      std::fprintf(stderr, "kvtier-bench: warm-up load failed\n");
      return false;
    }
  }
  const kvtier::DaemonStats at_start = client.Stats().value();
  const auto w0 = Clock::now();
  auto flushed = client.Flush();
  if (!flushed || *flushed != blocks) {
    std::fprintf(stderr, "kvtier-bench: flush queued %lu of %u\n", flushed ? *flushed : 0, blocks);
    return false;
  }
  if (!WaitForCounter(client, "disk_demotions", at_start.Counter("disk_demotions") + blocks))
    return false;
  out->write = mb / Seconds(Clock::now() - w0);
  const kvtier::DaemonStats written = client.Stats().value();
  out->write_shape = IoShapeBetween(at_start, written, /*read=*/false);

  // Every block is now on disk only. The promotion and the load each read
  // them all back, from disk only; which goes first alternates every two
  // repetitions, since a read's speed here moves with what the disk did just
  // before it. fio reads the same records before the first in even
  // repetitions and between the two in odd ones: the second read of a block
  // may find it in a cache below the guest (a virtual disk's host), and
  // neither side always gets that.
  out->load_first = rep % 4 >= 2;
  const bool fio_same_first = rep % 2 == 0;
  // Promotion: prefetch them all (disk -> host) and time until every read
  // is done.
  auto promote = [&]() -> bool {
    if (!client.Evict("", kvtier::BlockTier::kHost)) return false;  // clean copies: no write
    const kvtier::DaemonStats before = client.Stats().value();
    const auto p0 = Clock::now();
    for (uint32_t i = 0; i < blocks; i += 512) {
      const uint32_t n = std::min(512u, blocks - i);
      if (!client.Prefetch(id, std::span(keys).subspan(i, n))) return false;
    }
    if (!WaitForCounter(client, "disk_promotions", before.Counter("disk_promotions") + blocks)) return false;
    out->promote = mb / Seconds(Clock::now() - p0);
    out->promote_shape = IoShapeBetween(before, client.Stats().value(), /*read=*/true);
    return true;
  };
  // Load everything into the engine, all requests in flight.
  auto load = [&]() -> bool {
    if (!client.Evict("", kvtier::BlockTier::kHost)) return false;
    const kvtier::DaemonStats before = client.Stats().value();
    // Blank, so that the check below sees what this load wrote, not the
    // warm-up's.
    std::memset(cache->block(32).data(), 0, uint64_t{blocks} * block_bytes);
    const auto r0 = Clock::now();
    std::vector<kvtier::OpHandle> ops;
    for (uint32_t i = 0; i < blocks; i += 32) {
      const uint32_t n = std::min(32u, blocks - i);
      auto op = client.LoadAsync(id, std::span(keys).subspan(i, n), Iota(32 + i, n));
      if (!op) {
        std::fprintf(stderr, "kvtier-bench: load: %s\n", op.error().ToString().c_str());
        return false;
      }
      ops.push_back(*op);
    }
    for (const kvtier::OpHandle& op : ops) {
      auto r = client.Wait(op);
      if (!r || r->blocks == 0) {
        std::fprintf(stderr, "kvtier-bench: a load returned no blocks\n");
        return false;
      }
    }
    out->load = mb / Seconds(Clock::now() - r0);
    out->load_shape = IoShapeBetween(before, client.Stats().value(), /*read=*/true);
    for (uint32_t i = 0; i < blocks; ++i)
      out->mismatches += !kvtier::MatchesKey(keys[i], cache->block(32 + i));
    return true;
  };
  if (fio_same_first) FioSameRecords(config, uint64_t{blocks} * record_bytes, record_bytes, out);
  if (!(out->load_first ? load() : promote())) return false;
  if (!fio_same_first) FioSameRecords(config, uint64_t{blocks} * record_bytes, record_bytes, out);
  if (!(out->load_first ? promote() : load())) return false;
  out->group_commits =
      client.Stats().value().Counter("disk_group_commits") - at_start.Counter("disk_group_commits");
  (void)client.Evict("", kvtier::BlockTier::kHost);  // room for the next repetition
  return true;
}

// fio and a file-per-block store on the same file system, with the same
// bytes, block size, queue depth and number of queues as KvtierOnce (fio
// writes a fresh preallocated file, as a started daemon does; both end
// durable).
void BaselinesOnce(const DiskConfig& config, DiskRep* out) {
  const uint32_t blocks = config.blocks;
  const uint64_t block_bytes = Llama8BLayout().block_bytes();
  const uint64_t record_bytes = kvtier::RecordBytes(block_bytes);
  const std::string fio_file = config.dir + "/fio-baseline.dat";
  std::filesystem::remove(fio_file);
  const uint64_t bytes = uint64_t{blocks} * record_bytes;
  const FioRun write = FioLike(config, fio_file, "write", bytes, record_bytes);
  const FioRun read = FioLike(config, fio_file, "read", bytes, record_bytes);
  out->fio_write = write.mbps;
  out->fio_write_shape = write.shape;
  out->fio_read = read.mbps;
  out->fio_read_shape = read.shape;
  std::filesystem::remove(fio_file);
  std::tie(out->fpb_write, out->fpb_read) =
      FilePerBlock(config.dir + "/file-per-block", blocks, block_bytes);
}

}  // namespace

// `reps` repetitions of DiskOnce, each against the daemon `connect` returns
// (the bench starts a fresh one per repetition unless --socket is given),
// every repetition's ratios printed, and the medians compared.
int Disk(const std::function<std::unique_ptr<kvtier::Client>(uint32_t rep)>& connect,
         const DiskConfig& given, uint32_t reps, const std::string& json) {
  const uint64_t record_bytes = kvtier::RecordBytes(Llama8BLayout().block_bytes());
  const FioHugePages huge_pages(given.io_threads, given.queue_depth, record_bytes);
  DiskConfig config = given;
  config.fio_huge_pages = huge_pages.ok();
  std::printf(
      "config:   %u records of %.1f MiB (a 2 MiB block each, no header: record version 4; %.0f MB), queue depth %u x %u "
      "I/O threads (fio: %u jobs x iodepth %u, end_fsync=1 on writes), %u reps, in %s\n",
      config.blocks, static_cast<double>(record_bytes) / (1 << 20),
      static_cast<double>(config.blocks) * static_cast<double>(record_bytes) / 1e6,
      config.queue_depth, config.io_threads, config.io_threads, config.queue_depth, reps,
      config.dir.c_str());
  std::printf("fio:      buffers in %s\n", huge_pages.description().c_str());
  std::fflush(stdout);
  std::vector<DiskRep> runs;
  uint64_t mismatches = 0;
  const uint64_t bytes = uint64_t{config.blocks} * record_bytes;
  for (uint32_t rep = 1; rep <= reps; ++rep) {
    // Each part after the same preconditioning, in turn first: fio's
    // figure moves with what the disk did just before it.
    const bool fio_first = rep % 2 == 0;
    DiskRep r;
    if (fio_first) {
      Precondition(config, bytes, record_bytes);
      BaselinesOnce(config, &r);
    }
    std::unique_ptr<kvtier::Client> client = connect(rep);
    Precondition(config, bytes, record_bytes);
    if (!client || !KvtierOnce(*client, config, rep, &r)) return 1;
    if (!fio_first) {
      Precondition(config, bytes, record_bytes);
      BaselinesOnce(config, &r);
    }
    mismatches += r.mismatches;
    std::printf(
        "rep %u/%u (%s first): demotion %.0f MB/s vs fio write %.0f = %.2fx; promotion %.0f vs fio read %.0f "
        "= %.2fx; "
        "load %.0f = %.2fx (%s first); %lu group commits\n",
        rep, reps, fio_first ? "fio" : "kvtier", r.write, r.fio_write, r.fio_write > 0 ? r.write / r.fio_write : 0,
        r.promote,
        r.fio_read, r.fio_read > 0 ? r.promote / r.fio_read : 0, r.load,
        r.fio_read > 0 ? r.load / r.fio_read : 0, r.load_first ? "load" : "promotion", r.group_commits);
    if (r.fio_read_same > 0) {
      std::printf("  fio reading kvtier's records: %.0f MB/s; promotion %.2fx, load %.2fx of it\n",
                  r.fio_read_same, r.promote / r.fio_read_same, r.load / r.fio_read_same);
    }
    std::fflush(stdout);
    runs.push_back(r);
  }
  auto median = [&runs](auto field) {
    std::vector<double> v;
    for (const DiskRep& r : runs) v.push_back(static_cast<double>(std::invoke(field, r)));
    return Median(v);
  };
  auto median_ratio = [&runs](double DiskRep::*num, double DiskRep::*den) {
    std::vector<double> v;
    for (const DiskRep& r : runs) v.push_back(r.*den > 0 ? r.*num / r.*den : 0);
    return Median(v);
  };
  const std::vector<Comparison> cs = {
      {"demotion write (host -> disk)", median(&DiskRep::write), median(&DiskRep::fio_write),
       "fio io_uring direct write, end_fsync", "MB/s"},
      {"promotion read (disk -> host)", median(&DiskRep::promote), median(&DiskRep::fio_read),
       "fio io_uring direct read", "MB/s"},
      {"load from disk (disk -> engine)", median(&DiskRep::load), median(&DiskRep::fio_read),
       "fio io_uring direct read", "MB/s"},
      {"promotion, same records", median(&DiskRep::promote), median(&DiskRep::fio_read_same),
       "fio reading kvtier's records in its segment", "MB/s"},
      {"load from disk, same records", median(&DiskRep::load), median(&DiskRep::fio_read_same),
       "fio reading kvtier's records in its segment", "MB/s"},
      {"durable write vs file per block", median(&DiskRep::write), median(&DiskRep::fpb_write),
       "file per block, fsync each", "MB/s"},
      {"read vs file per block", median(&DiskRep::promote), median(&DiskRep::fpb_read),
       "file per block, page cache dropped", "MB/s"},
  };
  std::printf("\nmedians of %u reps:\n", reps);
  PrintComparisons(cs);
  auto spread = [&runs](double DiskRep::*field) {
    double lo = 0, hi = 0;
    for (const DiskRep& r : runs) {
      lo = lo == 0 ? r.*field : std::min(lo, r.*field);
      hi = std::max(hi, r.*field);
    }
    return std::pair(lo, hi);
  };
  const auto [fw_lo, fw_hi] = spread(&DiskRep::fio_write);
  const auto [fr_lo, fr_hi] = spread(&DiskRep::fio_read);
  const auto [kw_lo, kw_hi] = spread(&DiskRep::write);
  std::printf("spread over the reps: fio write %.0f-%.0f MB/s, fio read %.0f-%.0f, demotion %.0f-%.0f\n", fw_lo,
              fw_hi, fr_lo, fr_hi, kw_lo, kw_hi);
  std::printf("median of the per-rep ratios: demotion %.2fx, promotion %.2fx, load %.2fx"
              " of fio on its own file\n",
              median_ratio(&DiskRep::write, &DiskRep::fio_write),
              median_ratio(&DiskRep::promote, &DiskRep::fio_read),
              median_ratio(&DiskRep::load, &DiskRep::fio_read));
  if (median(&DiskRep::fio_read_same) > 0) {
    const auto [fs_lo, fs_hi] = spread(&DiskRep::fio_read_same);
    std::printf("  and of fio reading kvtier's own records (%.0f-%.0f MB/s): promotion %.2fx, load %.2fx\n",
                fs_lo, fs_hi, median_ratio(&DiskRep::promote, &DiskRep::fio_read_same),
                median_ratio(&DiskRep::load, &DiskRep::fio_read_same));
  }
  // How each drove the device, medians over the reps.
  auto shape = [&runs](IoShape DiskRep::*part) {
    IoShape m;
    for (auto [field, out] : {std::pair{&IoShape::depth, &m.depth}, {&IoShape::size_kib, &m.size_kib},
                              {&IoShape::syncs_per_gb, &m.syncs_per_gb}, {&IoShape::idle_pct, &m.idle_pct}}) {
      std::vector<double> v;
      for (const DiskRep& r : runs) v.push_back((r.*part).*field);
      *out = Median(v);
    }
    return m;
  };
  std::printf("\nhow the device was driven (medians): mean depth as each operation started, mean operation size,\n"
              "syncs per GB, I/O threads' idle time (fio: its depth buckets' lower bounds, 100%% less its CPU)\n");
  for (const auto& [name, part] : {std::pair{"demotion write", &DiskRep::write_shape},
                                   {"fio write", &DiskRep::fio_write_shape},
                                   {"promotion read", &DiskRep::promote_shape},
                                   {"load read", &DiskRep::load_shape},
                                   {"fio read", &DiskRep::fio_read_shape},
                                   {"fio same records", &DiskRep::fio_read_same_shape}}) {
    const IoShape m = shape(part);
    std::printf("  %-16s depth %5.1f, %7.0f KiB, %5.1f syncs/GB, idle %3.0f%%\n", name, m.depth, m.size_kib,
                m.syncs_per_gb, m.idle_pct);
  }
  std::printf(
      "group commits: median %.0f for %u records; verified %lu of %lu loaded blocks byte-exact\n",
      median(&DiskRep::group_commits), config.blocks, uint64_t{config.blocks} * reps - mismatches,
      uint64_t{config.blocks} * reps);
  if (median(&DiskRep::fio_write) == 0 || median(&DiskRep::fio_read) == 0) {
    std::printf("(fio did not run: install Debian's fio package)\n");
  }
  if (!json.empty() && !WriteJson(json,
                                  {{"workload", "disk"},
                                   {"blocks", std::to_string(config.blocks)},
                                   {"record_bytes", std::to_string(record_bytes)},
                                   {"queue_depth", std::to_string(config.queue_depth)},
                                   {"io_threads", std::to_string(config.io_threads)},
                                   {"reps", std::to_string(reps)},
                                   {"dir", config.dir}},
                                  cs)) {
    std::fprintf(stderr, "kvtier-bench: cannot write %s\n", json.c_str());
    return 1;
  }
  return mismatches == 0 ? 0 : 1;
}

}  // namespace kvtier::bench
