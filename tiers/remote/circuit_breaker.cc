#include "tiers/remote/circuit_breaker.h"

#include <spdlog/spdlog.h>

#include <utility>

namespace kvtier {

CircuitBreaker::Ticket::Ticket(Ticket&& other) noexcept
    : breaker_(std::exchange(other.breaker_, nullptr)), probe_(other.probe_) {}

CircuitBreaker::Ticket::~Ticket() {
  if (breaker_ != nullptr) breaker_->Drop(probe_);
}

void CircuitBreaker::Ticket::Record(bool reached_cluster) {
  CircuitBreaker* breaker = std::exchange(breaker_, nullptr);
  if (breaker != nullptr) breaker->Verdict(probe_, reached_cluster);
}

CircuitBreaker::CircuitBreaker(Options options) : options_(std::move(options)) {}

std::chrono::steady_clock::time_point CircuitBreaker::Now() const {
  return options_.clock ? options_.clock() : std::chrono::steady_clock::now();
}

std::optional<CircuitBreaker::Ticket> CircuitBreaker::Admit() {
  std::lock_guard lock(mu_);
  if (!counters_.open) return Ticket(this, false);
  if (probing_ || Now() < reopen_at_) {
    ++counters_.refused;
    return std::nullopt;
  }
  probing_ = true;  // one batch probes the cluster
  return Ticket(this, true);
}

bool CircuitBreaker::RefuseNow() {
  std::lock_guard lock(mu_);
  if (!counters_.open || Now() >= reopen_at_) return false;
  ++counters_.refused;
  return true;
}

CircuitBreaker::Counters CircuitBreaker::counters() const {
  std::lock_guard lock(mu_);
  return counters_;
}

void CircuitBreaker::Drop(bool probe) {
  std::lock_guard lock(mu_);
  if (probe) probing_ = false;
}

void CircuitBreaker::Verdict(bool probe, bool reached_cluster) {
  std::lock_guard lock(mu_);
  if (probe) probing_ = false;
  if (reached_cluster) {
    consecutive_failures_ = 0;
    if (counters_.open) {
      counters_.open = false;
      spdlog::info("{}: the cluster answers again; circuit breaker closed", options_.what);
    }
    return;
  }
  ++counters_.unavailable;
  ++consecutive_failures_;
  const auto now = Now();
  if (counters_.open) {
    // A failed probe cools down again; a batch admitted before the breaker
    // opened changes nothing.
    if (probe) reopen_at_ = now + options_.cooldown;
  } else if (consecutive_failures_ >= options_.failures) {
    counters_.open = true;
    reopen_at_ = now + options_.cooldown;
    ++counters_.opened;
    spdlog::warn(
        "{}: {} batches in a row could not reach the cluster; circuit breaker open (every remote "
        "lookup is a miss; probing again every {} ms)",
        options_.what, consecutive_failures_, options_.cooldown.count());
  }
}

}  // namespace kvtier
