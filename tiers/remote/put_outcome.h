// RemotePutOutcome: what became of one block of a RemoteTier::Put, for its
// owner (BlockCache) without the remote tier's headers.
#pragma once

#include <cstdint>

namespace kvtier {

enum class RemotePutOutcome : uint8_t {
  kNotReached,  // the cluster was not reached (or the batch was refused here): try again later
  kStored,
  kRefused,  // too large for max_value_bytes, or the cluster said no (OOM, NOPERM): do not retry
};

}  // namespace kvtier
