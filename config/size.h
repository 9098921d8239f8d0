// Byte sizes as operators write them: "64GiB", "512 MiB", "4096", "1.5GB" is
// not accepted (no fractions). Binary units KiB MiB GiB TiB (and K M G T as
// their shorthands), decimal units KB MB GB TB, and B. Thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "common/status.h"

namespace kvtier {

// Errors: kInvalidArgument for anything that is not a non-negative integer
// with an optional unit, or that overflows 64 bits. Zero is returned as 0:
// whether zero is allowed is the caller's rule.
Result<uint64_t> ParseSize(std::string_view text);

// "64GiB", "1536MiB", "4097B": the largest binary unit that divides exactly.
std::string FormatSize(uint64_t size_bytes);

}  // namespace kvtier
