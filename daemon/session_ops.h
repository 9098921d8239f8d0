// SessionOps: the Load and Store ops of one session, by id: those still
// running, and the results of finished ones that no Wait or Poll has taken
// yet.
//
// Only running ops count toward the session's limit
// (limits.max_inflight_ops_per_session). A finished op nobody waits for
// keeps its result for a later Wait or Poll, but at most `max_kept` such
// results stay: keeping one more drops the one that finished first. So a
// client that drops its op handles neither wedges its session nor grows the
// daemon's memory; a later Wait on a dropped op gets NotFound saying so.
//
// Owned by a Session, on the event-loop thread; thread-compatible.
#pragma once

#include <chrono>
#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "common/layer_gate.h"
#include "common/status.h"
#include "tiers/block_cache.h"

namespace kvtier {

class CompletionPage;  // session.h

// A timed Wait, by deadline (Server::ExpireWaits answers those that pass).
struct PendingWait {
  uint64_t session;
  uint64_t op;
  uint64_t request;
};
using WaitDeadlines = std::multimap<std::chrono::steady_clock::time_point, PendingWait>;
// Stores by layer, by when they are given up if not written whole
// (limits.store_layers_timeout_ms; Server::ExpireWaits aborts them).
struct PendingGate {
  uint64_t session;
  uint64_t op;
};
using GateDeadlines = std::multimap<std::chrono::steady_clock::time_point, PendingGate>;

// A request to answer with an op's result: a Wait, or a Load/Store with wait=true.
struct OpWaiter {
  uint64_t request = 0;
  // A timed Wait's entry in the server's WaitDeadlines: whoever answers the
  // Wait (or drops it) erases the entry, so none outlives its Wait.
  std::optional<WaitDeadlines::iterator> deadline;
};

struct SessionOp {
  bool load = false;
  std::chrono::steady_clock::time_point started = std::chrono::steady_clock::now();
  bool done = false;
  OpOutcome outcome;
  std::vector<OpWaiter> waiters;  // at most kMaxWaitersPerOp (handlers_data.cc)
  // A store's completion write, made when it is over.
  std::shared_ptr<CompletionPage> completions = nullptr;
  uint32_t completion_slot = 0;
  uint32_t completion_value = 0;
  // A store by layer's: opened by StoreLayers. Its last owner (this op, or
  // its session) letting go before every layer is written aborts the store.
  std::shared_ptr<LayerGate> gate = nullptr;
  // Its entry in the server's GateDeadlines, erased when it is over.
  std::optional<GateDeadlines::iterator> gate_deadline;
};

class SessionOps {
 public:
  // REQUIRES: max_in_flight >= 1, max_kept >= 1.
  SessionOps(uint32_t max_in_flight, uint32_t max_kept);
  SessionOps(const SessionOps&) = delete;
  SessionOps& operator=(const SessionOps&) = delete;

  // Ops started and not yet finished.
  uint32_t in_flight() const { return in_flight_; }
  // Finished results waiting to be taken.
  size_t kept() const { return kept_.size(); }
  // Finished results dropped unread since the session began.
  uint64_t dropped() const { return dropped_; }
  // Whether max_in_flight ops are running (Start must not be called).
  bool full() const { return in_flight_ >= max_in_flight_; }

  // Starts an op: its id (numbered from 1) and entry, valid until the op is
  // taken or dropped. REQUIRES: !full().
  std::pair<uint64_t, SessionOp*> Start();
  // The op `id`, running or finished. Errors: kNotFound, saying whether the
  // session never started it or it is over and its result is gone (taken,
  // or dropped unread).
  Result<SessionOp*> Find(uint64_t id);
  // Marks the running op `id` done with `outcome`, and returns it; nullptr if
  // no such op is running. If it has waiters, the caller answers them and
  // then Takes it; if not, its result is kept (which may drop the oldest kept
  // result, never this one).
  SessionOp* Finish(uint64_t id, OpOutcome outcome);
  // Forgets the op `id` (its result was delivered). No-op if unknown.
  void Take(uint64_t id);
  // Calls fn(op) for every op, running or finished; fn must not add or take ops.
  template <typename Fn>
  void ForEach(Fn&& fn) {
    for (auto& [id, e] : ops_) fn(e.op);
  }

 private:
  struct Entry {
    SessionOp op;
    // Where a kept result sits in kept_ (finished, no waiters).
    std::optional<std::list<uint64_t>::iterator> kept;
  };

  const uint32_t max_in_flight_;
  const uint32_t max_kept_;
  std::map<uint64_t, Entry> ops_;
  std::list<uint64_t> kept_;  // ids of kept results, oldest finished first
  uint64_t next_id_ = 1;
  uint32_t in_flight_ = 0;
  uint64_t dropped_ = 0;
};

}  // namespace kvtier
