// CircuitBreaker: the remote tier's guard against a cluster it cannot reach.
// Closed, it admits every batch. After `failures` batches in a row could not
// reach the cluster it opens: batches are refused for `cooldown`, then one at
// a time probes the cluster, and that probe's verdict closes the breaker or
// starts another cooldown.
//
// An admitted batch holds a Ticket and gives it a verdict (Record). A ticket
// dropped without one, by a batch that ended before it tried the network,
// counts nothing, and a probe's turn passes to the next batch at once: no
// early return can leave the breaker open for good.
//
// Thread-safe. Tickets must not outlive their breaker.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
#include <string>

namespace kvtier {

class CircuitBreaker {
 public:
  using Clock = std::function<std::chrono::steady_clock::time_point()>;
  struct Options {
    uint32_t failures = 3;  // >= 1
    std::chrono::milliseconds cooldown{2000};
    std::string what = "tiers.remote";  // its log lines' prefix
    Clock clock = {};                   // empty: steady_clock
  };
  struct Counters {
    uint64_t unavailable = 0;  // verdicts: the cluster was not reached
    uint64_t opened = 0;       // times it opened
    uint64_t refused = 0;      // batches refused while open
    bool open = false;
  };

  class Ticket {
   public:
    Ticket(Ticket&& other) noexcept;
    Ticket& operator=(Ticket&&) = delete;
    ~Ticket();
    // The verdict: the batch reached the cluster (it answered, even with an
    // error, in time) or not. At most once.
    void Record(bool reached_cluster);

   private:
    friend class CircuitBreaker;
    Ticket(CircuitBreaker* breaker, bool probe) : breaker_(breaker), probe_(probe) {}
    CircuitBreaker* breaker_;  // null once recorded or moved from
    bool probe_;
  };

  explicit CircuitBreaker(Options options);

  // A ticket for a batch about to use the network, or nullopt (counted as
  // refused) while the breaker is open and cooling down or another probe is
  // out.
  std::optional<Ticket> Admit();
  // Whether a batch offered now would be refused as still cooling down
  // (counted as refused if so); takes no probe's turn. For refusing at once,
  // before a batch is queued.
  bool RefuseNow();
  Counters counters() const;

 private:
  std::chrono::steady_clock::time_point Now() const;
  void Verdict(bool probe, bool reached_cluster);
  void Drop(bool probe);

  const Options options_;
  mutable std::mutex mu_;
  uint32_t consecutive_failures_ = 0;
  bool probing_ = false;
  std::chrono::steady_clock::time_point reopen_at_{};
  Counters counters_;
};

}  // namespace kvtier
