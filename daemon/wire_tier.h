// TierToWire: a tier as the wire names it (ipc/kvtier.fbs). For the request
// handlers (daemon/handlers_*.cc).
#pragma once

#include "ipc/wire.h"
#include "tiers/block_entry.h"

namespace kvtier {

inline wire::Tier TierToWire(Tier t) {
  switch (t) {
    case Tier::kHbm: return wire::Tier::Hbm;
    case Tier::kHost: return wire::Tier::Host;
    case Tier::kDisk: return wire::Tier::Disk;
  }
  return wire::Tier::None;
}

}  // namespace kvtier
