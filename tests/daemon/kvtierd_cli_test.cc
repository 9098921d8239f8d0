// Runs the real kvtierd binary's --check-config path.
#include <sys/wait.h>

#include <unistd.h>

#include <array>
#include <cstdio>
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace {

using ::testing::HasSubstr;

struct CmdResult {
  int exit_code = -1;
  std::string output;  // stdout and stderr
};

CmdResult Kvtierd(const std::string& args) {
  const std::string cmd = std::string(KVTIER_BINARY_DIR) + "/bin/kvtierd " + args + " 2>&1";
  CmdResult run;
  FILE* p = ::popen(cmd.c_str(), "r");
  if (p == nullptr) return run;
  std::array<char, 4096> buf{};
  for (size_t n; (n = std::fread(buf.data(), 1, buf.size(), p)) > 0;) run.output.append(buf.data(), n);
  const int status = ::pclose(p);
  run.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return run;
}

const std::string kExample = std::string(KVTIER_SOURCE_DIR) + "/config/kvtier.example.yaml";

TEST(KvtierdCliTest, ExampleConfigChecksOk) {
  const CmdResult r = Kvtierd("--config " + kExample + " --check-config");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("configuration OK"));
  EXPECT_THAT(r.output, HasSubstr("chat-prod"));
  // Secrets are never printed.
  EXPECT_THAT(r.output, ::testing::Not(HasSubstr("replace-me-with-openssl-rand-hex-32")));
}

TEST(KvtierdCliTest, DefaultsCheckOk) {
  const CmdResult r = Kvtierd("--check-config");
  EXPECT_EQ(r.exit_code, 0) << r.output;
}

TEST(KvtierdCliTest, NegativeSizeExitsTwoNamingTheKey) {
  const CmdResult r = Kvtierd("--config " + kExample + " --set tiers.host.bytes=-5 --check-config");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_THAT(r.output, HasSubstr("tiers.host.bytes"));
}

TEST(KvtierdCliTest, UnknownKeyExitsTwoNamingKeyAndLine) {
  char path[] = "/tmp/kvtier-cli-XXXXXX.yaml";
  const int fd = ::mkstemps(path, 5);
  ASSERT_GE(fd, 0);
  const std::string yaml = "socket:\n  path: /tmp/x.sock\nmetrics:\n  listen: 127.0.0.1:9464\n  colour: red\n";
  ASSERT_EQ(::write(fd, yaml.data(), yaml.size()), static_cast<ssize_t>(yaml.size()));
  ::close(fd);
  const CmdResult r = Kvtierd(std::string("--config ") + path + " --check-config");
  ::unlink(path);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_THAT(r.output, HasSubstr(std::string(path) + ":5: metrics.colour: unknown key"));
}

TEST(KvtierdCliTest, BadCommandLineExitsTwo) {
  EXPECT_EQ(Kvtierd("--no-such-flag").exit_code, 2);
  EXPECT_EQ(Kvtierd("--config /nonexistent/kvtier.yaml --check-config").exit_code, 2);
}

}  // namespace
