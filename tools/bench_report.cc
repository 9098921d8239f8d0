#include "tools/bench_report.h"

#include <sys/utsname.h>

#include <algorithm>
#include <cmath>
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

std::string Figure(double v) {
  char buf[32];
  const double a = v < 0 ? -v : v;
  std::snprintf(buf, sizeof(buf),
                a >= 100 || a == 0 ? "%.0f"
                : a >= 10          ? "%.1f"
                : a >= 1           ? "%.2f"
                                   : "%.3f",
                v);
  return buf;
}

namespace {

// ">= 5x", "<= 2 us", or both; "" when none.
std::string TargetText(const Comparison& c) {
  std::string t;
  if (c.target > 0) {
    char buf[32];
    std::snprintf(buf, sizeof(buf), ">= %gx", c.target);
    t = buf;
  }
  if (c.kvtier_target > 0) {
    t += (t.empty() ? "" : ", ") + std::string(c.lower_is_better ? "<= " : ">= ") +
         Figure(c.kvtier_target) + " " + c.unit;
  }
  return t;
}

}  // namespace

void PrintComparisons(const std::vector<Comparison>& cs) {
  bool targets = false;
  for (const Comparison& c : cs) targets |= c.has_target();
  std::printf("\n%-44s %14s %14s %8s  %s%s\n", "comparison", "kvtier", "baseline", "ratio",
              targets ? "target              " : "", "baseline is");
  for (const Comparison& c : cs) {
    const std::string kv = Figure(c.kvtier) + " " + c.unit,
                      base = Figure(c.baseline) + " " + c.unit;
    std::string target;
    if (targets) {
      target = c.has_target() ? TargetText(c) + (c.met() ? " met" : " below") : "";
      target.resize(std::max<size_t>(target.size() + 1, 20), ' ');
    }
    std::printf("%-44s %14s %14s %7.2fx  %s%s\n", c.name.c_str(), kv.c_str(), base.c_str(),
                c.ratio(), target.c_str(), c.baseline_name.c_str());
  }
  if (targets) std::printf("(ratio: higher is better for kvtier; targets are informational)\n");
}

std::string JsonEscape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\u%04x", static_cast<unsigned>(c));
      out += buf;
      continue;
    }
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out;
}

namespace {

// A JSON number with `decimals` decimals; null when not finite (a figure
// divided by a zero time), which JSON cannot spell.
std::string JsonNumber(double v, int decimals) {
  if (!std::isfinite(v)) return "null";
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.*f", decimals, v);
  return buf;
}

}  // namespace

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
    std::fprintf(f, "%s\"%s\": \"%s\"", i ? ", " : "", JsonEscape(config[i].first).c_str(),
                 JsonEscape(config[i].second).c_str());
  }
  std::fprintf(f, "},\n \"comparisons\": [");
  for (size_t i = 0; i < cs.size(); ++i) {
    const Comparison& c = cs[i];
    // tools/gpu-check.sh reads these lines with sed: keep "ratio" and the
    // optional "target" last.
    std::fprintf(
        f,
        "%s\n  {\"name\": \"%s\", \"kvtier\": %s, \"baseline\": %s, \"baseline_name\": \"%s\", "
        "\"unit\": \"%s\", \"lower_is_better\": %s",
        i ? "," : "", JsonEscape(c.name).c_str(), JsonNumber(c.kvtier, 3).c_str(),
        JsonNumber(c.baseline, 3).c_str(), JsonEscape(c.baseline_name).c_str(),
        JsonEscape(c.unit).c_str(), c.lower_is_better ? "true" : "false");
    if (c.kvtier_target > 0)
      std::fprintf(f, ", \"kvtier_target\": %s", JsonNumber(c.kvtier_target, 3).c_str());
    std::fprintf(f, ", \"ratio\": %s", JsonNumber(c.ratio(), 4).c_str());
    if (c.target > 0) std::fprintf(f, ", \"target\": %s", JsonNumber(c.target, 2).c_str());
    std::fprintf(f, "}");
  }
  std::fprintf(f, "\n]}\n");
  return std::fclose(f) == 0;
}

}  // namespace kvtier::bench
