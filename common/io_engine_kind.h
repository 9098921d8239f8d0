// IoEngineKind: which disk I/O engine to run. Shared by the config (which
// reads it) and the disk tier (which runs it), so neither depends on the
// other. A value type.
#pragma once

namespace kvtier {

enum class IoEngineKind { kAuto, kIoUring, kThreadPool };

}  // namespace kvtier
