// kvtierd: the kvtier daemon.
//
//   kvtierd [--config FILE] [--set key=value ...] [--check-config] [--foreground]
//           [--pid-file PATH]
//
// Without --foreground it forks into the background once its socket is
// listening (the parent exits 0 then, or 1 if start-up failed); systemd and
// containers use --foreground. Logs go to stderr.
//
// Exit codes: 0 success; 1 a runtime failure; 2 a usage or config error.
#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <spdlog/spdlog.h>

#include "common/version.h"
#include "config/config_loader.h"
#include "daemon/config_summary.h"
#include "daemon/logging.h"
#include "daemon/node_budget.h"
#include "daemon/server.h"
#include "ipc/wire.h"
#include "tiers/disk/disk_tier.h"

namespace {

// Forks; the parent waits for the child to write one byte to the pipe (ready)
// or to close it (failed), and exits accordingly. Returns the write end in the
// child.
int Daemonize() {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) {
    std::perror("kvtierd: pipe");
    std::exit(1);
  }
  const pid_t pid = ::fork();
  if (pid < 0) {
    std::perror("kvtierd: fork");
    std::exit(1);
  }
  if (pid > 0) {
    ::close(fds[1]);
    char ready = 0;
    const ssize_t n = ::read(fds[0], &ready, 1);
    std::exit(n == 1 ? 0 : 1);
  }
  ::close(fds[0]);
  ::setsid();
  return fds[1];
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"kvtierd: tiered KV-cache offload daemon for LLM inference", "kvtierd"};
  std::string config_file;
  std::vector<std::string> overrides;
  bool check_config = false;
  bool foreground = false;
  std::string pid_file;
  app.add_option("-c,--config", config_file, "YAML config file (default: built-in defaults)");
  app.add_option("--set", overrides,
                 "override a config key: --set tiers.host.bytes=64GiB (repeatable; YAML values)")
      ->expected(1)
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  app.add_flag("--check-config", check_config, "validate the config, print it, and exit");
  app.add_flag("-f,--foreground", foreground, "stay in the foreground (for systemd and containers)");
  app.add_option("--pid-file", pid_file, "write the daemon's pid here once it listens; removed at exit");
  app.set_version_flag("--version", std::string("kvtierd ") + kvtier::kVersion + " (protocol " +
                                        std::to_string(kvtier::ipc::kProtocolVersion) + ", disk format " +
                                        std::to_string(kvtier::DiskTier::kFormatVersion) + ")");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    return rc == 0 ? 0 : 2;
  }

  kvtier::ConfigSource source;
  if (!config_file.empty()) source.file = config_file;
  source.overrides = overrides;
  kvtier::Result<kvtier::Config> config = kvtier::LoadConfig(source);
  if (!config) {
    std::fprintf(stderr, "kvtierd: invalid configuration:\n%s\n", config.error().message().c_str());
    return 2;
  }
  const std::optional<std::string> exposed = kvtier::TokenExposure(*config, source);
  // What the node allows (a limits.node_* above it is a config error, found
  // before anything is created); the Server reads it again once it starts.
  const kvtier::Result<kvtier::NodeLimits> node = kvtier::ReadNodeLimits(config->limits);
  if (!node) {
    std::fprintf(stderr, "kvtierd: invalid configuration:\n%s\n", node.error().message().c_str());
    return 2;
  }
  if (check_config) {
    if (exposed) std::fprintf(stderr, "kvtierd: warning: %s\n", exposed->c_str());
    std::printf("%s", kvtier::ConfigSummary(*config).c_str());
    // What is kept for kvtierd here is from this process's use; the daemon
    // measures its own once its tiers are open.
    const kvtier::NodeBudgets budgets(*node, *config, config->tenants.size());
    std::printf("node budgets (fair shares between the named tenants):\n");
    for (const kvtier::NodeBudget* b : budgets.all()) {
      std::printf("  %s\n", b->Describe().c_str());
    }
    std::printf("kvtierd: configuration OK\n");
    return 0;
  }

  const int ready_fd = foreground ? -1 : Daemonize();
  kvtier::SetupLogging(config->log.format, config->log.level);
  spdlog::info("kvtierd starting\n{}", kvtier::ConfigSummary(*config));
  if (exposed) spdlog::warn("{}", *exposed);
  kvtier::Server::Options options{.config = *config, .source = source, .on_ready = [ready_fd, &pid_file] {
                                    if (!pid_file.empty()) {
                                      if (FILE* f = std::fopen(pid_file.c_str(), "w"); f != nullptr) {
                                        std::fprintf(f, "%d\n", ::getpid());
                                        std::fclose(f);
                                      } else {
                                        spdlog::error("cannot write pid file {}", pid_file);
                                      }
                                    }
                                    if (ready_fd >= 0) {
                                      const char one = 1;
                                      [[maybe_unused]] ssize_t n = ::write(ready_fd, &one, 1);
                                      ::close(ready_fd);
                                    }
                                  },
                                  .backend = nullptr};
  kvtier::Result<std::unique_ptr<kvtier::Server>> server = kvtier::Server::Create(std::move(options));
  if (!server) {
    spdlog::critical("start-up failed: {}", server.error().ToString());
    return 1;
  }
  const kvtier::Status st = (*server)->Run();
  if (!pid_file.empty()) ::unlink(pid_file.c_str());
  if (!st.ok()) {
    spdlog::critical("event loop failed: {}", st.ToString());
    return 1;
  }
  return 0;
}
