#include "common/default_socket.h"

#include <sys/stat.h>

#include <cstdlib>

namespace kvtier {
namespace {

constexpr char kPackaged[] = "/run/kvtier/kvtierd.sock";
constexpr char kHere[] = "./var/kvtier/kvtierd.sock";

std::string Env(const char* name) {
  const char* v = std::getenv(name);  // NOLINT(concurrency-mt-unsafe): nothing here sets it
  return v == nullptr ? std::string() : std::string(v);
}

std::string UserRuntime() {
  const std::string dir = Env("XDG_RUNTIME_DIR");
  return dir.empty() ? std::string() : dir + "/kvtier/kvtierd.sock";
}

}  // namespace

std::vector<std::string> DefaultSocketCandidates() {
  if (std::string explicit_socket = Env("KVTIER_SOCKET"); !explicit_socket.empty()) {
    return {explicit_socket};
  }
  std::vector<std::string> out{kPackaged};
  if (std::string user = UserRuntime(); !user.empty()) out.push_back(user);
  out.emplace_back(kHere);
  return out;
}

std::string DaemonDefaultSocket() {
  if (std::string explicit_socket = Env("KVTIER_SOCKET"); !explicit_socket.empty()) {
    return explicit_socket;
  }
  struct stat st{};
  const std::string dir = Env("XDG_RUNTIME_DIR");
  if (!dir.empty() && ::stat(dir.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) return UserRuntime();
  return kHere;
}

std::string ClientDefaultSocket() {
  const std::vector<std::string> candidates = DefaultSocketCandidates();
  for (const std::string& path : candidates) {
    struct stat st{};
    if (::stat(path.c_str(), &st) == 0 && S_ISSOCK(st.st_mode)) return path;
  }
  return candidates.front();
}

}  // namespace kvtier
