#include "tools/bench_report.h"

#include <sys/utsname.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <thread>

namespace kvtier::bench {

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

std::string CpuModel() {
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  }
  return "unknown";
}

void PrintMachine() {
  const std::string cpu = CpuModel();
  utsname u{};
  ::uname(&u);
  std::printf("machine:  %s, %u cpus, Linux %s\n", cpu.c_str(), std::thread::hardware_concurrency(),
              u.release);
}

void PrintComparisons(const std::vector<Comparison>& cs) {
  std::printf("\n%-40s %12s %12s %8s  %s\n", "comparison", "kvtier", "baseline", "ratio",
              "baseline is");
  for (const Comparison& c : cs) {
    std::printf("%-40s %8.0f %-3s %8.0f %-3s %7.2fx  %s\n", c.name.c_str(), c.kvtier,
                c.unit.c_str(), c.baseline, c.unit.c_str(), c.ratio(), c.baseline_name.c_str());
  }
}

std::string JsonEscape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out;
}

bool WriteJson(const std::string& path, const JsonFields& config, const std::vector<Comparison>& cs,
               const JsonFields& extra_machine) {
  FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr) return false;
  const std::string cpu = CpuModel();
  utsname u{};
  ::uname(&u);
  std::fprintf(f, "{\"machine\": {\"cpu\": \"%s\", \"cpus\": %u, \"kernel\": \"%s\"",
               JsonEscape(cpu).c_str(), std::thread::hardware_concurrency(), u.release);
  for (const auto& [key, value] : extra_machine) {
    std::fprintf(f, ", \"%s\": \"%s\"", JsonEscape(key).c_str(), JsonEscape(value).c_str());
  }
  std::fprintf(f, "},\n \"config\": {");
  for (size_t i = 0; i < config.size(); ++i) {
    std::fprintf(f, "%s\"%s\": \"%s\"", i ? ", " : "", config[i].first.c_str(),
                 JsonEscape(config[i].second).c_str());
  }
  std::fprintf(f, "},\n \"comparisons\": [");
  for (size_t i = 0; i < cs.size(); ++i) {
    const Comparison& c = cs[i];
    std::fprintf(
        f,
        "%s\n  {\"name\": \"%s\", \"kvtier\": %.3f, \"baseline\": %.3f, \"baseline_name\": \"%s\", "
        "\"unit\": \"%s\", \"ratio\": %.4f",
        i ? "," : "", JsonEscape(c.name).c_str(), c.kvtier, c.baseline,
        JsonEscape(c.baseline_name).c_str(), c.unit.c_str(), c.ratio());
    if (c.target > 0) std::fprintf(f, ", \"target\": %.2f", c.target);
    std::fprintf(f, "}");
  }
  std::fprintf(f, "\n]}\n");
  return std::fclose(f) == 0;
}

}  // namespace kvtier::bench
