// FairQueue: the sessions with requests to read, served one request at a
// time, tenants in turn and each tenant's sessions in turn (issue 46). A
// tenant with 64 busy sessions gets the event loop as often as a tenant with
// one: the one session's request waits behind at most one request of each
// other tenant, not behind a request of every other session.
//
// Owned by the event-loop thread (Server); thread-compatible.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <optional>

namespace kvtier {

class FairQueue {
 public:
  // `session` of `flow` (its tenant) has a request to read. The caller
  // pushes a session at most once until it is popped.
  void Push(uint32_t flow, uint64_t session) { flows_[flow].push_back(session); }

  // The next session: the first of the flow after the one served last (in
  // flow order, wrapping), or nullopt when none is queued.
  std::optional<uint64_t> Pop() {
    if (flows_.empty()) return std::nullopt;
    auto it = flows_.upper_bound(last_);
    if (it == flows_.end()) it = flows_.begin();
    last_ = it->first;
    const uint64_t session = it->second.front();
    it->second.pop_front();
    if (it->second.empty()) flows_.erase(it);
    return session;
  }

  bool empty() const { return flows_.empty(); }

 private:
  std::map<uint32_t, std::deque<uint64_t>> flows_;  // only flows with sessions queued
  uint32_t last_ = UINT32_MAX;  // the flow served last: the first Pop starts at the lowest
};

}  // namespace kvtier
