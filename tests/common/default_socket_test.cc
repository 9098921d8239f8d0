#include "common/default_socket.h"

#include <stdlib.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include <gtest/gtest.h>

namespace kvtier {
namespace {

// Sets (or, with nullopt, unsets) an environment variable for one test and
// puts it back after.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, std::optional<std::string> value) : name_(name) {
    if (const char* old = ::getenv(name)) old_ = old;
    if (value) {
      ::setenv(name, value->c_str(), 1);
    } else {
      ::unsetenv(name);
    }
  }
  ~ScopedEnv() {
    if (old_) {
      ::setenv(name_, old_->c_str(), 1);
    } else {
      ::unsetenv(name_);
    }
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

// A unix socket bound at `path` for as long as it lives.
class BoundSocket {
 public:
  explicit BoundSocket(const std::string& path) : path_(path) {
    fd_ = ::socket(AF_UNIX, SOCK_STREAM, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
    EXPECT_EQ(::bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0) << path;
  }
  ~BoundSocket() {
    ::close(fd_);
    ::unlink(path_.c_str());
  }

 private:
  std::string path_;
  int fd_ = -1;
};

class DefaultSocketTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/kvtier-default-socket-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    ASSERT_EQ(::mkdir((dir_ + "/kvtier").c_str(), 0700), 0);
  }
  void TearDown() override {
    ::rmdir((dir_ + "/kvtier").c_str());
    ::rmdir(dir_.c_str());
  }
  std::string dir_;
};

TEST_F(DefaultSocketTest, KvtierSocketIsTheOnlyCandidateForBoth) {
  ScopedEnv socket("KVTIER_SOCKET", "/somewhere/k.sock");
  ScopedEnv runtime("XDG_RUNTIME_DIR", dir_);
  EXPECT_EQ(DefaultSocketCandidates(), std::vector<std::string>{"/somewhere/k.sock"});
  EXPECT_EQ(DaemonDefaultSocket(), "/somewhere/k.sock");
  EXPECT_EQ(ClientDefaultSocket(), "/somewhere/k.sock");
}

TEST_F(DefaultSocketTest, ADaemonInTheUsersRuntimeDirectoryIsWhereAClientLooks) {
  ScopedEnv socket("KVTIER_SOCKET", std::nullopt);
  ScopedEnv runtime("XDG_RUNTIME_DIR", dir_);
  const std::string user = dir_ + "/kvtier/kvtierd.sock";
  EXPECT_EQ(DefaultSocketCandidates(),
            (std::vector<std::string>{"/run/kvtier/kvtierd.sock", user, "./var/kvtier/kvtierd.sock"}));
  EXPECT_EQ(DaemonDefaultSocket(), user);
  struct stat st{};
  if (::stat("/run/kvtier/kvtierd.sock", &st) == 0) GTEST_SKIP() << "a packaged kvtierd runs here";
  EXPECT_EQ(ClientDefaultSocket(), "/run/kvtier/kvtierd.sock");  // no daemon yet: the packaged one's
  BoundSocket daemon(user);
  EXPECT_EQ(ClientDefaultSocket(), user);
}

TEST_F(DefaultSocketTest, WithoutARuntimeDirectoryBothUseTheCurrentDirectorysVar) {
  ScopedEnv socket("KVTIER_SOCKET", std::nullopt);
  ScopedEnv runtime("XDG_RUNTIME_DIR", std::nullopt);
  EXPECT_EQ(DefaultSocketCandidates(),
            (std::vector<std::string>{"/run/kvtier/kvtierd.sock", "./var/kvtier/kvtierd.sock"}));
  EXPECT_EQ(DaemonDefaultSocket(), "./var/kvtier/kvtierd.sock");
  // A runtime directory that does not exist is not the daemon's.
  ScopedEnv missing("XDG_RUNTIME_DIR", dir_ + "/gone");
  EXPECT_EQ(DaemonDefaultSocket(), "./var/kvtier/kvtierd.sock");
}

}  // namespace
}  // namespace kvtier
