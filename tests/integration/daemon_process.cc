#include "tests/integration/daemon_process.h"

#include <fcntl.h>
#include <sys/resource.h>
#include <sched.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <thread>

#include "ipc/seqpacket.h"
#include "tests/programs.h"

namespace kvtier::testing {

Result<DaemonProcess> DaemonProcess::Start(std::vector<std::string> overrides, std::string config_file,
                                           std::string netns, uint64_t open_files) {
  char tmpl[] = "/tmp/kvtier-it-XXXXXX";
  if (::mkdtemp(tmpl) == nullptr) return Err(Status::FromErrno(errno, "mkdtemp"));
  const std::string dir = tmpl;
  std::vector<std::string> args = {ProgramPath("kvtierd"), "--foreground"};
  if (!config_file.empty()) {
    args.push_back("--config");
    args.push_back(config_file);
  }
  // Defaults for a test daemon; later --set arguments win.
  for (const std::string& s : {"socket.path=" + dir + "/kvtierd.sock", "state_dir=" + dir + "/state",
                               "tiers.disk.paths=[" + dir + "/disk]",
                               std::string("tiers.disk.enabled=false"), std::string("metrics.enabled=false"),
                               std::string("tiers.host.bytes=64MiB")}) {
    args.push_back("--set");
    args.push_back(s);
  }
  for (const std::string& s : overrides) {
    args.push_back("--set");
    args.push_back(s);
  }
  DaemonProcess d(dir, std::move(args), std::move(netns), open_files);
  KVTIER_RETURN_IF_ERROR(d.Spawn());
  return d;
}

DaemonProcess::DaemonProcess(std::string dir, std::vector<std::string> args, std::string netns, uint64_t open_files)
    : dir_(std::move(dir)),
      socket_path_(dir_ + "/kvtierd.sock"),
      args_(std::move(args)),
      netns_(std::move(netns)),
      open_files_(open_files) {
  for (size_t i = 0; i + 1 < args_.size(); ++i) {
    if (args_[i] == "--set" && args_[i + 1].starts_with("socket.path=")) {
      socket_path_ = args_[i + 1].substr(std::string("socket.path=").size());
    }
  }
}

DaemonProcess::DaemonProcess(DaemonProcess&& other) noexcept
    : dir_(std::move(other.dir_)),
      socket_path_(std::move(other.socket_path_)),
      args_(std::move(other.args_)),
      netns_(std::move(other.netns_)),
      open_files_(other.open_files_),
      pid_(std::exchange(other.pid_, -1)) {}

DaemonProcess::~DaemonProcess() {
  if (pid_ > 0) Kill();
  if (!dir_.empty() && ::getenv("KVTIER_KEEP_TEST_DIRS") == nullptr) {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
}

Status DaemonProcess::Spawn() {
  const std::string log = dir_ + "/kvtierd.log";
  const pid_t pid = ::fork();
  if (pid < 0) return Status::FromErrno(errno, "fork");
  if (pid == 0) {
    const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (fd >= 0) {
      ::dup2(fd, 2);
      ::dup2(fd, 1);
    }
    if (!netns_.empty()) {
      const int ns = ::open(netns_.c_str(), O_RDONLY | O_CLOEXEC);
      if (ns < 0 || ::setns(ns, CLONE_NEWNET) != 0) {
        std::fprintf(stderr, "daemon_process: entering %s: %s\n", netns_.c_str(), std::strerror(errno));
        ::_exit(126);
      }
    }
    if (open_files_ > 0) {
      const rlimit files{.rlim_cur = open_files_, .rlim_max = open_files_};
      if (::setrlimit(RLIMIT_NOFILE, &files) != 0) {
        std::fprintf(stderr, "daemon_process: RLIMIT_NOFILE %llu: %s\n",
                     static_cast<unsigned long long>(open_files_), std::strerror(errno));
        ::_exit(126);
      }
    }
    std::vector<char*> argv;
    for (std::string& a : args_) argv.push_back(a.data());
    argv.push_back(nullptr);
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  pid_ = pid;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (std::chrono::steady_clock::now() < deadline) {
    if (Result<UniqueFd> fd = ipc::Connect(socket_path_); fd) return Status::Ok();
    int status = 0;
    if (::waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      return Status(StatusCode::kInternal, "kvtierd exited during start-up:\n" + Log());
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return Status(StatusCode::kDeadlineExceeded, "kvtierd did not listen within 20 s:\n" + Log());
}

std::string DaemonProcess::Log() const {
  std::ifstream in(dir_ + "/kvtierd.log");
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

int DaemonProcess::Stop() {
  if (pid_ <= 0) return -1;
  ::kill(pid_, SIGTERM);
  int status = 0;
  ::waitpid(pid_, &status, 0);
  pid_ = -1;
  return status;
}

void DaemonProcess::Kill() {
  if (pid_ <= 0) return;
  ::kill(pid_, SIGKILL);
  int status = 0;
  ::waitpid(pid_, &status, 0);
  pid_ = -1;
}

Status DaemonProcess::Restart() {
  if (pid_ > 0) Kill();
  return Spawn();
}

void DaemonProcess::Signal(int sig) const {
  if (pid_ > 0) ::kill(pid_, sig);
}

pid_t ForkChild(const std::function<int()>& fn) {
  const pid_t pid = ::fork();
  if (pid == 0) ::_exit(fn());
  return pid;
}

int WaitChild(pid_t pid) {
  int status = 0;
  if (::waitpid(pid, &status, 0) != pid) return -1;
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return -1;
}

}  // namespace kvtier::testing
