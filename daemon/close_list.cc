#include "daemon/close_list.h"

#include <utility>

namespace kvtier {

void CloseList::Mark(Session& s, const char* why) {
  if (s.close_reason_ == nullptr) marked_.push_back(s.id);
  s.close_reason_ = why;
}

std::vector<uint64_t> CloseList::Take() { return std::exchange(marked_, {}); }

}  // namespace kvtier
