// kvtier-bench compress: the block codecs (kernels/codec.h) on one core:
// the stored size against the raw size, and encode and decode throughput
// (raw bytes per second) next to memcpy of the same bytes in the same run,
// for lossless and fp8 on N(0,1) bf16 and on outlier-heavy K (4 of 128
// channels x50, Student-t(3)), in 2 MiB blocks. Medians of the reps.
#pragma once

#include <cstdint>
#include <string>

namespace kvtier::bench {

struct CompressOptions {
  uint32_t block_kib = 2048;
  uint32_t blocks = 32;  // per rep
  uint32_t reps = 5;
  std::string json;
};

// Returns the exit code: 0, or 1 when a round trip is not what the codec
// promises (lossless bit-exact; fp8 within its bound is the tests' job).
int Compress(const CompressOptions& options);

}  // namespace kvtier::bench
