// LatencyHistogram: how long operations took, in fixed buckets from 1 us to
// 10 s (a 1-2.5-5 series), with their count and sum: what a Prometheus
// histogram exports. Engine code records into one and the daemon's metrics
// endpoint copies it out, so only daemon/ depends on prometheus-cpp.
//
// Value type; thread-compatible (each is owned by one thread and copied for
// export).
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>

namespace kvtier {

class LatencyHistogram {
 public:
  // Upper bounds of the buckets, in seconds; one more bucket above the last.
  static constexpr std::array<double, 22> kBoundsSeconds = {
      1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3,
      5e-3, 1e-2, 2.5e-2, 5e-2, 0.1,    0.25,   0.5,  1.0,  2.5,    5.0,  10.0};

  void Record(std::chrono::nanoseconds d) {
    const double s = std::chrono::duration<double>(d).count();
    size_t i = 0;
    while (i < kBoundsSeconds.size() && s > kBoundsSeconds[i]) ++i;
    ++counts_[i];
    ++count_;
    sum_seconds_ += s;
  }
  // Records the time since `start`.
  void RecordSince(std::chrono::steady_clock::time_point start) {
    Record(std::chrono::steady_clock::now() - start);
  }

  // Samples in bucket i (not cumulative); i == kBoundsSeconds.size() is +Inf.
  uint64_t bucket(size_t i) const { return counts_[i]; }
  uint64_t count() const { return count_; }
  double sum_seconds() const { return sum_seconds_; }

 private:
  std::array<uint64_t, kBoundsSeconds.size() + 1> counts_{};
  uint64_t count_ = 0;
  double sum_seconds_ = 0;
};

}  // namespace kvtier
