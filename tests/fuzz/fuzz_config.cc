// Fuzz target: the config loader kvtierd runs on --config and SIGHUP
// (config/config_loader.h), on arbitrary YAML text and --set overrides.
//
// Property: it never crashes or hangs, and either returns a config or a
// kInvalidArgument error that names where the problem is.
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <string>

#include "common/check.h"
#include "config/config_loader.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  // First byte 0: the rest is one --set override; otherwise a config file
  // (a memfd: no files left behind, nothing shared between runs).
  kvtier::ConfigSource source;
  if (!text.empty() && text[0] == '\0') {
    source.overrides.push_back(text.substr(1));
  } else {
    const int fd = ::memfd_create("kvtier-fuzz-config", MFD_CLOEXEC);
    KVTIER_CHECK(fd >= 0);
    KVTIER_CHECK(::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size()));
    source.file = "/proc/self/fd/" + std::to_string(fd);
    kvtier::Result<kvtier::Config> c = kvtier::LoadConfig(source);
    ::close(fd);
    if (!c) KVTIER_CHECK(c.error().code() == kvtier::StatusCode::kInvalidArgument && !c.error().message().empty());
    return 0;
  }
  kvtier::Result<kvtier::Config> c = kvtier::LoadConfig(source);
  if (!c) KVTIER_CHECK(c.error().code() == kvtier::StatusCode::kInvalidArgument && !c.error().message().empty());
  return 0;
}
