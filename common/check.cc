#include "common/check.h"

#include <cstdio>
#include <cstdlib>

namespace kvtier::internal {

void CheckFailed(const char* file, int line, const char* condition, std::string_view message) {
  std::fprintf(stderr, "%s:%d: CHECK failed: %s%s%.*s\n", file, line, condition,
               message.empty() ? "" : ": ", static_cast<int>(message.size()), message.data());
  std::fflush(stderr);
  std::abort();
}

}  // namespace kvtier::internal
