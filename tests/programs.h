// Where tests find the programs they start (kvtierd, kvtierctl, gpu_client,
// c_api_example): $KVTIER_PROGRAMS_DIR when it is set (the GPU bundle, run on
// another machine by tools/gpu-check.sh), else the build directory's bin/.
//
// Test-only.
#pragma once

#include <cstdlib>
#include <string>

namespace kvtier::testing {

inline std::string ProgramPath(const std::string& name) {
  const char* dir = std::getenv("KVTIER_PROGRAMS_DIR");
  const std::string bin =
      dir != nullptr && *dir != '\0' ? std::string(dir) : std::string(KVTIER_BINARY_DIR) + "/bin";
  return bin + "/" + name;
}

}  // namespace kvtier::testing
