#include "common/unique_fd.h"

#include <unistd.h>

namespace kvtier {

void UniqueFd::Reset(int fd) {
  const int old = std::exchange(fd_, fd);
  // Never retry close() on EINTR: on Linux the descriptor is already released
  // and a retry could close a descriptor another thread just opened.
  if (old >= 0) ::close(old);
}

}  // namespace kvtier
