#include "common/secret.h"

#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include <gtest/gtest.h>

namespace kvtier {
namespace {

namespace fs = std::filesystem;

class SecretTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/kvtier-secret-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string Write(const std::string& name, const std::vector<uint8_t>& bytes) {
    const std::string path = dir_ + "/" + name;
    std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(bytes.data()),
                                                static_cast<std::streamsize>(bytes.size()));
    return path;
  }
  static std::vector<uint8_t> Random(size_t n) {
    std::vector<uint8_t> v(n);
    for (size_t i = 0; i < n; ++i) v[i] = static_cast<uint8_t>((i * 2654435761u) >> 7);
    return v;
  }

  std::string dir_;
};

TEST_F(SecretTest, SizeAndContentBounds) {
  EXPECT_FALSE(Secret::FromBytes(Random(135)).has_value());
  EXPECT_TRUE(Secret::FromBytes(Random(136)).has_value());
  EXPECT_TRUE(Secret::FromBytes(Random(4096)).has_value());
  EXPECT_FALSE(Secret::FromBytes(Random(4097)).has_value());
  Result<Secret> zeros = Secret::FromBytes(std::vector<uint8_t>(256, 0));
  ASSERT_FALSE(zeros.has_value());
  EXPECT_NE(zeros.error().message().find("distinct"), std::string::npos);
}

TEST_F(SecretTest, GenerateGivesDifferentSecrets) {
  const Secret a = Secret::Generate().value();
  const Secret b = Secret::Generate().value();
  EXPECT_EQ(a.bytes().size(), Secret::kGeneratedBytes);
  EXPECT_FALSE(std::equal(a.bytes().begin(), a.bytes().end(), b.bytes().begin()));
}

TEST_F(SecretTest, LoadFileReadsBytesAndNamesThePathOnError) {
  const std::vector<uint8_t> bytes = Random(200);
  const Secret s = Secret::LoadFile(Write("ok.salt", bytes)).value();
  EXPECT_TRUE(std::equal(bytes.begin(), bytes.end(), s.bytes().begin(), s.bytes().end()));

  Result<Secret> missing = Secret::LoadFile(dir_ + "/missing.salt");
  ASSERT_FALSE(missing.has_value());
  EXPECT_EQ(missing.error().code(), StatusCode::kNotFound);
  EXPECT_NE(missing.error().message().find("missing.salt"), std::string::npos);

  Result<Secret> short_file = Secret::LoadFile(Write("short.salt", Random(20)));
  ASSERT_FALSE(short_file.has_value());
  EXPECT_NE(short_file.error().message().find("short.salt"), std::string::npos);
}

TEST_F(SecretTest, LoadOrCreateCreatesOnceWithMode0600) {
  const std::string path = dir_ + "/tenant-a.salt";
  const Secret created = Secret::LoadOrCreateFile(path).value();
  struct stat st {};
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  EXPECT_EQ(static_cast<size_t>(st.st_size), Secret::kGeneratedBytes);
  const Secret again = Secret::LoadOrCreateFile(path).value();
  EXPECT_TRUE(std::equal(created.bytes().begin(), created.bytes().end(), again.bytes().begin(),
                         again.bytes().end()));
  // No temporary files are left behind.
  EXPECT_EQ(std::distance(fs::directory_iterator(dir_), fs::directory_iterator()), 1);
}

TEST_F(SecretTest, ConcurrentCreatorsAgreeOnOneSecret) {
  const std::string path = dir_ + "/shared.salt";
  constexpr int kProcs = 8;
  std::vector<pid_t> pids;
  for (int i = 0; i < kProcs; ++i) {
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      Result<Secret> s = Secret::LoadOrCreateFile(path);
      if (!s) ::_exit(1);
      // Each child writes what it got; all must match the file.
      std::ofstream(dir_ + "/seen." + std::to_string(i), std::ios::binary)
          .write(reinterpret_cast<const char*>(s->bytes().data()),
                 static_cast<std::streamsize>(s->bytes().size()));
      ::_exit(0);
    }
    pids.push_back(pid);
  }
  for (pid_t pid : pids) {
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  }
  const Secret final_secret = Secret::LoadFile(path).value();
  for (int i = 0; i < kProcs; ++i) {
    const Secret seen = Secret::LoadFile(dir_ + "/seen." + std::to_string(i)).value();
    EXPECT_TRUE(std::equal(seen.bytes().begin(), seen.bytes().end(), final_secret.bytes().begin(),
                           final_secret.bytes().end()))
        << "process " << i << " used a different secret";
  }
}

TEST_F(SecretTest, LoadOrCreateFailsInAMissingDirectory) {
  Result<Secret> s = Secret::LoadOrCreateFile(dir_ + "/no/such/dir/x.salt");
  ASSERT_FALSE(s.has_value());
  EXPECT_EQ(s.error().source(), ErrorSource::kErrno);
}

}  // namespace
}  // namespace kvtier
