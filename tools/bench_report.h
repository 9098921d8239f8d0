// Reporting helpers shared by kvtier-bench's workloads (tools/bench.cc and
// tools/bench_gpu.cc): medians, the machine line, comparisons of a kvtier
// figure with a baseline measured in the same run, and the --json output
//
//   {"machine": {"cpu", "cpus", "kernel", ...extra}, "config": {...},
//    "comparisons": [{"name", "kvtier", "baseline", "baseline_name", "unit",
//                     "lower_is_better"[, "kvtier_target"], "ratio"[, "target"]}]}
//
// one comparison a line, with ratio oriented so that higher is better for
// kvtier. "target" is a ratio to reach, "kvtier_target" a figure (in "unit")
// to reach. Targets are informational: no workload fails on them.
//
// Plain functions over values; thread-compatible (they write to stdout or a
// file the caller names).
#pragma once

#include <chrono>
#include <string>
#include <utility>
#include <vector>

namespace kvtier::bench {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::duration d);

// The upper median (the middle element of the sorted values); 0 when empty.
double Median(std::vector<double> v);

// The first "model name" of /proc/cpuinfo, or "unknown".
std::string CpuModel();

// "machine:  <cpu>, <n> cpus, Linux <release>" on stdout.
void PrintMachine();

// A figure next to its baseline, for the table and --json.
struct Comparison {
  std::string name;
  double kvtier = 0;
  double baseline = 0;
  std::string baseline_name;
  std::string unit;
  bool lower_is_better = false;  // bytes, latency
  // The ratio this figure should reach (informational; 0 = none). Written to
  // --json only when set.
  double target = 0;
  // The figure kvtier itself should reach, in `unit`: at least it, or at most
  // it when lower_is_better (informational; 0 = none). Written to --json only
  // when set.
  double kvtier_target = 0;
  // kvtier / baseline, oriented so that higher is better for kvtier; 0 when
  // either figure is missing.
  double ratio() const {
    if (baseline <= 0 || kvtier <= 0) return 0;
    return lower_is_better ? baseline / kvtier : kvtier / baseline;
  }
  bool has_target() const { return target > 0 || kvtier_target > 0; }
  // True when every target set is reached (true when none is).
  bool met() const {
    if (target > 0 && ratio() < target) return false;
    if (kvtier_target > 0 && (lower_is_better ? kvtier > kvtier_target : kvtier < kvtier_target))
      return false;
    return true;
  }
};

// The comparisons as a table on stdout, with a target column when any has one.
void PrintComparisons(const std::vector<Comparison>& cs);

// `v` with three significant digits or so ("8.12", "41.3", "1534"), for tables.
std::string Figure(double v);

// `s` with '"', '\' and control characters escaped, for a JSON string.
std::string JsonEscape(const std::string& s);

// Key/value pairs written as JSON strings.
using JsonFields = std::vector<std::pair<std::string, std::string>>;

// Writes the --json document to `path` (truncating it). `extra_machine` adds
// string fields to "machine" after cpu, cpus and kernel (a workload's GPU,
// driver). Returns false when the file cannot be written.
bool WriteJson(const std::string& path, const JsonFields& config, const std::vector<Comparison>& cs,
               const JsonFields& extra_machine = {});

}  // namespace kvtier::bench
