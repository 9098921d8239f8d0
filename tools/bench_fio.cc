#include "tools/bench_fio.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace kvtier::bench {

double FioMbps(std::string_view json, std::string_view rw) {
  // "read": {... "bw_bytes" : N ...}, "write": {...}: the section of this direction.
  const std::string section = "\"" + std::string(rw) + "\" : {";
  const size_t at = json.find(section);
  const size_t bw = at == std::string_view::npos ? at : json.find("\"bw_bytes\"", at);
  if (bw == std::string_view::npos) return 0;
  const size_t colon = json.find(':', bw);
  if (colon == std::string_view::npos) return 0;
  return std::strtod(std::string(json.substr(colon + 1, 32)).c_str(), nullptr) / 1e6;
}

double Fio(const std::string& file, const std::string& rw, uint64_t size_bytes, uint64_t block_bytes,
           uint32_t queue_depth, uint32_t jobs) {
  const uint64_t per_job = size_bytes / jobs / block_bytes * block_bytes;
  const std::string cmd =
      "fio --name=kvtier-baseline --filename=" + file + " --rw=" + rw +
      " --size=" + std::to_string(per_job) + " --offset_increment=" + std::to_string(per_job) +
      " --numjobs=" + std::to_string(jobs) +
      " --group_reporting --bs=" + std::to_string(block_bytes) +
      " --iodepth=" + std::to_string(queue_depth) + (rw == "write" ? " --end_fsync=1" : "") +
      " --ioengine=io_uring --direct=1 --output-format=json 2>/dev/null";
  FILE* p = ::popen(cmd.c_str(), "r");
  if (p == nullptr) return 0;
  std::string out;
  char buf[4096];
  for (size_t n; (n = std::fread(buf, 1, sizeof(buf), p)) > 0;) out.append(buf, n);
  ::pclose(p);
  return FioMbps(out, rw);
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
