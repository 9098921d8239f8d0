// DaemonProcess: a real kvtierd started for a test, on a socket in a fresh
// temporary directory, with its log in that directory.
//
// Thread-compatible; for tests only.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <string>
#include <vector>

#include "common/status.h"

namespace kvtier::testing {

class DaemonProcess {
 public:
  // Starts kvtierd --foreground with the given --set overrides (and a
  // temporary socket and state dir unless overridden), and waits until its
  // socket accepts connections. With `netns` (a network namespace's file,
  // e.g. /run/netns/NAME), it runs in that namespace (its Unix socket is
  // still reached by path). With `open_files`, that is its RLIMIT_NOFILE,
  // soft and hard.
  static Result<DaemonProcess> Start(std::vector<std::string> overrides, std::string config_file = "",
                                     std::string netns = "", uint64_t open_files = 0);

  DaemonProcess(DaemonProcess&& other) noexcept;
  DaemonProcess& operator=(DaemonProcess&&) = delete;
  ~DaemonProcess();

  const std::string& socket_path() const { return socket_path_; }
  const std::string& dir() const { return dir_; }
  pid_t pid() const { return pid_; }
  std::string Log() const;

  // SIGTERM and wait; returns the exit status (as from waitpid).
  int Stop();
  // SIGKILL and wait.
  void Kill();
  // Starts it again with the same arguments (same socket and state dir).
  Status Restart();
  // Sends a signal without waiting.
  void Signal(int sig) const;

 private:
  DaemonProcess(std::string dir, std::vector<std::string> args, std::string netns, uint64_t open_files);
  Status Spawn();

  std::string dir_;
  std::string socket_path_;
  std::vector<std::string> args_;
  std::string netns_;
  uint64_t open_files_ = 0;
  pid_t pid_ = -1;
};

// Runs `fn` in a forked child process (a real client process) and returns
// its pid; the child exits with fn's return value.
pid_t ForkChild(const std::function<int()>& fn);
// Waits for a child; returns its exit code, or 128+signal.
int WaitChild(pid_t pid);

}  // namespace kvtier::testing
