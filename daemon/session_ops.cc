#include "daemon/session_ops.h"

#include <string>

#include "common/check.h"

namespace kvtier {

SessionOps::SessionOps(uint32_t max_in_flight, uint32_t max_kept)
    : max_in_flight_(max_in_flight), max_kept_(max_kept) {
  KVTIER_CHECK(max_in_flight >= 1 && max_kept >= 1);
}

std::pair<uint64_t, SessionOp*> SessionOps::Start() {
  KVTIER_CHECK(!full());
  const uint64_t id = next_id_++;
  ++in_flight_;
  return {id, &ops_[id].op};
}

Result<SessionOp*> SessionOps::Find(uint64_t id) {
  auto it = ops_.find(id);
  if (it != ops_.end()) return &it->second.op;
  if (id == 0 || id >= next_id_) {
    return Err(Status(StatusCode::kNotFound,
                      "no op " + std::to_string(id) + " was started on this session"));
  }
  return Err(Status(
      StatusCode::kNotFound,
      "op " + std::to_string(id) +
          " is over and its result is gone: taken by an earlier Wait or Poll, or dropped unread "
          "(a session keeps the results of its last " +
          std::to_string(max_kept_) + " finished ops that nobody waited for)"));
}

SessionOp* SessionOps::Finish(uint64_t id, OpOutcome outcome) {
  auto it = ops_.find(id);
  if (it == ops_.end() || it->second.op.done) return nullptr;
  Entry& e = it->second;
  e.op.done = true;
  e.op.outcome = std::move(outcome);
  --in_flight_;
  if (e.op.waiters.empty()) {
    e.kept = kept_.insert(kept_.end(), id);
    while (kept_.size() > max_kept_) {
      ops_.erase(kept_.front());
      kept_.pop_front();
      ++dropped_;
    }
  }
  return &e.op;
}

void SessionOps::Take(uint64_t id) {
  auto it = ops_.find(id);
  if (it == ops_.end()) return;
  if (it->second.kept) kept_.erase(*it->second.kept);
  if (!it->second.op.done) --in_flight_;
  ops_.erase(it);
}

}  // namespace kvtier
