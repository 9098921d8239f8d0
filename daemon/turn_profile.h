// TurnProfile: where one turn of kvtierd's event loop went (every ready
// event of one epoll_wait, then the loop's own upkeep), as time and count
// per kind of work: a request by its message type, posted completions, a
// session's writes, accepts, expiries. The loop logs the largest parts of a
// turn that ran past Server's slow-turn threshold, so an operator (and the
// closing note of issue 32) can see what holds requests up.
//
// Loop thread only; not thread-safe.
#pragma once

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>

#include <time.h>

namespace kvtier {

class TurnProfile {
 public:
  using Clock = std::chrono::steady_clock;

  void Begin(Clock::time_point now) {
    start_ = now;
    cpu_start_ = ThreadCpu();
    n_ = 0;
    other_ = {};
  }
  // Adds `d` to the part named `what`, which must be of static storage (a
  // literal, or a FlatBuffers enum name): parts are told apart by address.
  void Add(const char* what, Clock::duration d) {
    for (size_t i = 0; i < n_; ++i) {
      if (parts_[i].what == what) {
        ++parts_[i].count;
        parts_[i].time += d;
        return;
      }
    }
    Part& p = n_ < parts_.size() ? parts_[n_++] : other_;
    if (&p != &other_) p = Part{what, 0, {}};
    ++p.count;
    p.time += d;
  }
  // Runs `fn` as part `what`.
  template <typename Fn>
  void Time(const char* what, Fn&& fn) {
    const Clock::time_point t0 = Clock::now();
    fn();
    Add(what, Clock::now() - t0);
  }
  Clock::duration Length(Clock::time_point now) const { return now - start_; }
  // The loop thread's CPU time in this turn so far: a turn much longer than
  // its CPU time waited for a core (other threads, other processes), not
  // for its own work.
  Clock::duration Cpu() const { return ThreadCpu() - cpu_start_; }

  // "Store x4 12.1 ms, posted x180 9.5 ms, ...": the largest parts first,
  // at most six, and what the rest took.
  std::string Describe() const {
    std::array<Part, kParts + 1> sorted{};
    size_t n = 0;
    for (size_t i = 0; i < n_; ++i) sorted[n++] = parts_[i];
    if (other_.count > 0) sorted[n++] = Part{"other", other_.count, other_.time};
    std::sort(sorted.begin(), sorted.begin() + static_cast<ptrdiff_t>(n),
              [](const Part& a, const Part& b) { return a.time > b.time; });
    std::string out;
    Clock::duration rest{};
    for (size_t i = 0; i < n; ++i) {
      if (i >= 6) {
        rest += sorted[i].time;
        continue;
      }
      char buf[96];
      std::snprintf(buf, sizeof(buf), "%s%s x%u %.2f ms", out.empty() ? "" : ", ", sorted[i].what, sorted[i].count,
                    std::chrono::duration<double, std::milli>(sorted[i].time).count());
      out += buf;
    }
    if (rest.count() > 0) {
      char buf[48];
      std::snprintf(buf, sizeof(buf), ", the rest %.2f ms", std::chrono::duration<double, std::milli>(rest).count());
      out += buf;
    }
    return out;
  }

 private:
  static Clock::duration ThreadCpu() {
    timespec ts{};
    ::clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return std::chrono::seconds(ts.tv_sec) + std::chrono::nanoseconds(ts.tv_nsec);
  }
  static constexpr size_t kParts = 16;
  struct Part {
    const char* what = nullptr;
    uint32_t count = 0;
    Clock::duration time{};
  };
  Clock::time_point start_{};
  Clock::duration cpu_start_{};
  std::array<Part, kParts> parts_{};
  size_t n_ = 0;
  Part other_{"other", 0, {}};  // parts past kParts
};

}  // namespace kvtier
