// kvtier-bench gpu in a build without the CUDA toolkit (KVTIER_HAVE_CUDA
// off): the subcommand exists so the command line is the same everywhere.
#include <cstdio>

#include "tools/bench_gpu.h"

namespace kvtier::bench {

int Gpu(const GpuOptions& /*options*/) {
  std::fprintf(stderr,
               "kvtier-bench gpu: built without CUDA (configure with the CUDA toolkit and "
               "-DKVTIER_CUDA=ON)\n");
  return 2;
}

}  // namespace kvtier::bench
