#include "tools/bench_fio.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <utility>

namespace kvtier::bench {

namespace {

// The number after `"key" :` at or after `from` in fio's JSON, or 0.
double JsonNumber(std::string_view json, std::string_view key, size_t from = 0) {
  const size_t at = json.find("\"" + std::string(key) + "\"", from);
  if (at == std::string_view::npos) return 0;
  const size_t colon = json.find(':', at);
  if (colon == std::string_view::npos) return 0;
  return std::strtod(std::string(json.substr(colon + 1, 32)).c_str(), nullptr);
}

// The mean depth of fio's "iodepth_level" buckets (percent of the run at
// depths 1, 2, 4-7, 8-15, ...), each at its lower bound.
double FioDepth(std::string_view json) {
  const size_t at = json.find("\"iodepth_level\"");
  if (at == std::string_view::npos) return 0;
  double sum = 0, weight = 0;
  for (const auto& [key, depth] : {std::pair{"1", 1.0}, {"2", 2.0}, {"4", 4.0}, {"8", 8.0}, {"16", 16.0},
                                   {"32", 32.0}, {">=64", 64.0}}) {
    const double pct = JsonNumber(json, key, at);
    sum += pct * depth;
    weight += pct;
  }
  return weight > 0 ? sum / weight : 0;
}

}  // namespace

double FioMbps(std::string_view json, std::string_view rw) {
  // "read": {... "bw_bytes" : N ...}, "write": {...}: the section of this direction.
  const size_t at = json.find("\"" + std::string(rw) + "\" : {");
  return at == std::string_view::npos ? 0 : JsonNumber(json, "bw_bytes", at) / 1e6;
}


IoShape IoShapeBetween(const DaemonStats& before, const DaemonStats& after, bool read) {
  auto d = [&](const char* name) { return static_cast<double>(after.Counter(name) - before.Counter(name)); };
  const double ops = d(read ? "disk_io_reads" : "disk_io_writes");
  const double bytes = d(read ? "disk_io_read_bytes" : "disk_io_write_bytes");
  const double all_ops = d("disk_io_reads") + d("disk_io_writes") + d("disk_io_syncs");
  IoShape s;
  s.depth = all_ops > 0 ? d("disk_io_depth_sum") / all_ops : 0;
  s.size_kib = ops > 0 ? bytes / ops / 1024 : 0;
  s.syncs_per_gb = !read && bytes > 0 ? d("disk_io_syncs") / (bytes / 1e9) : 0;
  const double thread_us = d("disk_io_thread_us");
  s.idle_pct = thread_us > 0 ? 100 * d("disk_io_idle_us") / thread_us : 0;
  return s;
}

FioRun Fio(const std::string& file, const std::string& rw, uint64_t size_bytes, uint64_t block_bytes,
           uint32_t queue_depth, uint32_t jobs, bool huge_pages) {
  const uint64_t per_job = size_bytes / jobs / block_bytes * block_bytes;
  const std::string cmd =
      "fio --name=kvtier-baseline --filename=" + file + " --rw=" + rw +
      " --size=" + std::to_string(per_job) + " --offset_increment=" + std::to_string(per_job) +
      " --numjobs=" + std::to_string(jobs) +
      " --group_reporting --bs=" + std::to_string(block_bytes) +
      " --iodepth=" + std::to_string(queue_depth) + (rw == "write" ? " --end_fsync=1" : "") +
      " --ioengine=io_uring --direct=1" + (huge_pages ? " --mem=shmhuge" : "") +
      " --output-format=json 2>/dev/null";
  FILE* p = ::popen(cmd.c_str(), "r");
  if (p == nullptr) return {};
  std::string out;
  char buf[4096];
  for (size_t n; (n = std::fread(buf, 1, sizeof(buf), p)) > 0;) out.append(buf, n);
  ::pclose(p);
  FioRun run;
  run.mbps = FioMbps(out, rw);
  run.shape.depth = FioDepth(out);
  run.shape.size_kib = static_cast<double>(block_bytes) / 1024;
  run.shape.syncs_per_gb = rw == "write" ? static_cast<double>(jobs) / (static_cast<double>(per_job * jobs) / 1e9) : 0;
  run.shape.idle_pct = 100 - (JsonNumber(out, "usr_cpu") + JsonNumber(out, "sys_cpu"));
  return run;
}

namespace {

constexpr char kNrHugePages[] = "/proc/sys/vm/nr_hugepages";

// A number from /proc/meminfo ("HugePages_Free:   12"), or -1.
long MeminfoValue(const std::string& key) {
  std::ifstream in("/proc/meminfo");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind(key + ":", 0) == 0) return std::strtol(line.c_str() + key.size() + 1, nullptr, 10);
  }
  return -1;
}

bool WriteNrHugePages(long pages) {
  std::ofstream out(kNrHugePages);
  out << pages << '\n';
  out.flush();
  return static_cast<bool>(out);
}

}  // namespace

FioHugePages::FioHugePages(uint32_t jobs, uint32_t queue_depth, uint64_t block_bytes) {
  constexpr uint64_t kHugePage = 2 << 20;
  if (MeminfoValue("Hugepagesize") != static_cast<long>(kHugePage >> 10)) {
    why_ = "4 KiB pages: this kernel's huge pages are not 2 MiB";
    return;
  }
  // Each job's buffers (depth x block, rounded up) and fio's alignment page.
  const uint64_t per_job = (uint64_t{queue_depth} * block_bytes + kHugePage - 1) / kHugePage + 1;
  const auto needed = static_cast<long>(jobs * per_job);
  const long free = MeminfoValue("HugePages_Free");
  const long total = MeminfoValue("HugePages_Total");
  if (free >= needed) {
    description_ = "2 MiB pages (" + std::to_string(free) + " hugetlb pages were free)";
    return;
  }
  if (free < 0 || total < 0 || !WriteNrHugePages(total + needed - free)) {
    why_ = "4 KiB pages: no " + std::to_string(needed) + " free hugetlb pages, and " + kNrHugePages +
           " cannot be raised (not root)";
    return;
  }
  restore_ = total;
  if (MeminfoValue("HugePages_Free") < needed) {
    why_ = "4 KiB pages: the kernel found no " + std::to_string(needed) + " free 2 MiB pages";
    return;
  }
  description_ = "2 MiB pages (" + std::to_string(needed - free) + " hugetlb pages reserved for the bench)";
}

FioHugePages::~FioHugePages() {
  if (restore_ >= 0) (void)WriteNrHugePages(restore_);
}

BackgroundFio::BackgroundFio(const std::string& dir) : file_(dir + "/contend.fio"), output_(dir + "/contend.json") {
  std::filesystem::create_directories(dir);
  pid_ = ::fork();
  if (pid_ == 0) {
    const std::string filename = "--filename=" + file_;
    const std::string output = "--output=" + output_;
    ::execlp("fio", "fio", "--name=kvtier-contend", filename.c_str(), "--rw=write", "--bs=1M", "--size=1G",
             "--iodepth=8", "--ioengine=io_uring", "--direct=1", "--time_based", "--runtime=3600",
             "--output-format=json", output.c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
}

double BackgroundFio::Stop() {
  if (pid_ <= 0) return mbps_;
  ::kill(pid_, SIGINT);
  int status = 0;
  ::waitpid(pid_, &status, 0);
  pid_ = -1;
  std::ifstream in(output_);
  std::stringstream text;
  text << in.rdbuf();
  mbps_ = FioMbps(text.str(), "write");
  std::error_code ec;
  std::filesystem::remove(file_, ec);
  std::filesystem::remove(output_, ec);
  return mbps_;
}

}  // namespace kvtier::bench
