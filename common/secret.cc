#include "common/secret.h"

#include <fcntl.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include "common/unique_fd.h"

namespace kvtier {
namespace {

// Reads the whole of `fd` (at most `limit` bytes + 1, to detect overlong files).
Result<std::vector<uint8_t>> ReadAll(int fd, size_t limit, const std::string& path) {
  std::vector<uint8_t> out(limit + 1);
  size_t got = 0;
  while (got < out.size()) {
    const ssize_t n = ::read(fd, out.data() + got, out.size() - got);
    if (n < 0) {
      if (errno == EINTR) continue;
      return Err(Status::FromErrno(errno, "reading secret file " + path));
    }
    if (n == 0) break;
    got += static_cast<size_t>(n);
  }
  out.resize(got);
  return out;
}

Status WriteAll(int fd, std::span<const uint8_t> bytes, const std::string& path) {
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      return Status::FromErrno(errno, "writing secret file " + path);
    }
    done += static_cast<size_t>(n);
  }
  return Status::Ok();
}

Status FsyncDirectoryOf(const std::string& path) {
  std::string dir = std::filesystem::path(path).parent_path().string();
  if (dir.empty()) dir = ".";
  UniqueFd fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!fd) return Status::FromErrno(errno, "opening directory " + dir);
  if (::fsync(fd.get()) != 0) return Status::FromErrno(errno, "fsync of directory " + dir);
  return Status::Ok();
}

}  // namespace

Secret::~Secret() {
  if (!bytes_.empty()) ::explicit_bzero(bytes_.data(), bytes_.size());
}

Result<Secret> Secret::FromBytes(std::vector<uint8_t> bytes) {
  if (bytes.size() < kMinBytes || bytes.size() > kMaxBytes) {
    const size_t size = bytes.size();
    ::explicit_bzero(bytes.data(), bytes.size());
    return Err(InvalidArgument("secret is " + std::to_string(size) + " bytes; it must be " +
                               std::to_string(kMinBytes) + " to " + std::to_string(kMaxBytes) +
                               " random bytes (e.g. head -c 256 /dev/urandom)"));
  }
  std::array<bool, 256> seen{};
  size_t distinct = 0;
  for (uint8_t b : bytes) distinct += !std::exchange(seen[b], true);
  if (distinct < kMinDistinctByteValues) {
    ::explicit_bzero(bytes.data(), bytes.size());
    return Err(InvalidArgument("secret has only " + std::to_string(distinct) +
                               " distinct byte values; it must be random bytes "
                               "(e.g. head -c 256 /dev/urandom)"));
  }
  return Secret(std::move(bytes));
}

Result<Secret> Secret::Generate() {
  std::vector<uint8_t> bytes(kGeneratedBytes);
  size_t got = 0;
  while (got < bytes.size()) {
    const ssize_t n = ::getrandom(bytes.data() + got, bytes.size() - got, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      return Err(Status::FromErrno(errno, "getrandom"));
    }
    got += static_cast<size_t>(n);
  }
  return FromBytes(std::move(bytes));
}

Result<Secret> Secret::LoadFile(const std::string& path) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd) return Err(Status::FromErrno(errno, "opening secret file " + path));
  KVTIER_ASSIGN_OR_RETURN(std::vector<uint8_t> bytes, ReadAll(fd.get(), kMaxBytes, path));
  Result<Secret> secret = FromBytes(std::move(bytes));
  if (!secret) return Err(secret.error().WithContext("secret file " + path));
  return secret;
}

Result<Secret> Secret::LoadOrCreateFile(const std::string& path) {
  Result<Secret> existing = LoadFile(path);
  if (existing || existing.error().code() != StatusCode::kNotFound) return existing;

  KVTIER_ASSIGN_OR_RETURN(Secret secret, Generate());
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  {
    UniqueFd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600));
    if (!fd) return Err(Status::FromErrno(errno, "creating secret file " + tmp));
    Status written = WriteAll(fd.get(), secret.bytes(), tmp);
    if (written.ok() && ::fsync(fd.get()) != 0) {
      written = Status::FromErrno(errno, "fsync of secret file " + tmp);
    }
    if (!written.ok()) {
      ::unlink(tmp.c_str());
      return Err(written);
    }
  }
  // link() never replaces: if another process created `path` meanwhile, its
  // secret is the one everybody uses.
  const int linked = ::link(tmp.c_str(), path.c_str());
  const int link_errno = errno;
  ::unlink(tmp.c_str());
  if (linked != 0) {
    if (link_errno == EEXIST) return LoadFile(path);
    return Err(Status::FromErrno(link_errno, "creating secret file " + path));
  }
  KVTIER_RETURN_IF_ERROR(FsyncDirectoryOf(path));
  return secret;
}

}  // namespace kvtier
