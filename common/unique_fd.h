// UniqueFd: owns one file descriptor and closes it on destruction.
//
// Move-only. Thread-compatible: one owner at a time.
#pragma once

#include <utility>

namespace kvtier {

class UniqueFd {
 public:
  UniqueFd() = default;
  // Takes ownership of `fd` (which may be -1 for "none").
  explicit UniqueFd(int fd) : fd_(fd) {}
  ~UniqueFd() { Reset(); }

  UniqueFd(UniqueFd&& other) noexcept : fd_(other.Release()) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept {
    if (this != &other) Reset(other.Release());
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  explicit operator bool() const { return valid(); }

  // Gives up ownership without closing; returns the descriptor.
  [[nodiscard]] int Release() { return std::exchange(fd_, -1); }

  // Closes the owned descriptor (if any) and takes `fd`. A failed close is
  // not reported: the descriptor is gone either way on Linux, and callers that
  // must know a write reached storage call fsync/fdatasync before this.
  void Reset(int fd = -1);

 private:
  int fd_ = -1;
};

}  // namespace kvtier
