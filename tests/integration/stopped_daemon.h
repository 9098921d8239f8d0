// Stopped: holds a real kvtierd stopped (SIGSTOP) for a scope, so that what
// is sent meanwhile is read in one wake-up once it continues, or so that it
// stands in for a hung daemon.
//
// For tests only; thread-compatible.
#pragma once

#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>

#include "tests/integration/daemon_process.h"

namespace kvtier::testing {

// Whether every thread of `pid` is stopped (a signal is delivered
// asynchronously: kill() may return while the target still runs).
inline bool AllThreadsStopped(pid_t pid) {
  const std::filesystem::path tasks = "/proc/" + std::to_string(pid) + "/task";
  std::error_code ec;
  for (const auto& task : std::filesystem::directory_iterator(tasks, ec)) {
    std::ifstream stat(task.path() / "stat");
    std::string line;
    std::getline(stat, line);
    // "tid (comm) S ...": the state follows the last ')'.
    const size_t paren = line.rfind(')');
    if (paren == std::string::npos || paren + 2 >= line.size()) return false;
    if (const char state = line[paren + 2]; state != 'T' && state != 't') return false;
  }
  return !ec;
}

class Stopped {
 public:
  explicit Stopped(const DaemonProcess& d) : d_(d) {
    d_.Signal(SIGSTOP);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (!AllThreadsStopped(d_.pid())) {
      if (std::chrono::steady_clock::now() > deadline) {
        ADD_FAILURE() << "kvtierd did not stop";
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  ~Stopped() { d_.Signal(SIGCONT); }
  Stopped(const Stopped&) = delete;
  Stopped& operator=(const Stopped&) = delete;

 private:
  const DaemonProcess& d_;
};

}  // namespace kvtier::testing
