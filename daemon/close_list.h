// CloseList: the sessions marked for closing since the loop last closed
// them. Marking goes through it, so the loop closes exactly the marked
// sessions, each once, at a cost of O(sessions marked) per event instead of
// a scan of every session.
//
// Owned by the Server, on the event-loop thread; thread-compatible.
#pragma once

#include <cstdint>
#include <vector>

#include "daemon/session.h"

namespace kvtier {

class CloseList {
 public:
  // Marks `s` to be closed for `why` (a string that outlives the session,
  // e.g. a literal); a later reason replaces an earlier one, but a session
  // is listed once however often it is marked. O(1).
  void Mark(Session& s, const char* why);
  // The ids of the sessions marked since the last Take, in marking order;
  // leaves the list empty. A session taken is closed by the caller: marking
  // it again lists it no more.
  std::vector<uint64_t> Take();
  bool empty() const { return marked_.empty(); }

 private:
  std::vector<uint64_t> marked_;
};

}  // namespace kvtier
