// Helpers for the IoEngine and FileDevice tests: a temporary directory on a
// file system where O_DIRECT works (/tmp here: ext4), removed with its
// contents at the end; a one-shot completion to wait on; and a byte pattern
// that differs for every offset, so a block written or read at the wrong
// place is caught.
//
// Thread-compatible, except Completion, which is thread-safe.
#pragma once

#include <gtest/gtest.h>
#include <stdlib.h>

#include <cstdint>
#include <filesystem>
#include <future>
#include <span>
#include <string>

#include "common/status.h"
#include "tiers/disk/io_engine.h"

namespace kvtier::disk_io_test {

class TempDir {
 public:
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "kvtier-disk-io-XXXXXX").string();
    if (::mkdtemp(tmpl.data()) != nullptr) path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ignored;
    if (!path_.empty()) std::filesystem::remove_all(path_, ignored);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  bool ok() const { return !path_.empty(); }
  const std::string& path() const { return path_; }
  std::string File(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// The `done` of one request, waited on by the test.
class Completion {
 public:
  std::function<void(Result<uint64_t>)> Callback() {
    return [this](Result<uint64_t> result) { promise_.set_value(std::move(result)); };
  }
  Result<uint64_t> Wait() { return future_.get(); }

 private:
  std::promise<Result<uint64_t>> promise_;
  std::future<Result<uint64_t>> future_ = promise_.get_future();
};

// Submits `request` and waits for its done.
inline Result<uint64_t> RunSync(IoEngine& engine, IoRequest request) {
  Completion completion;
  request.done = completion.Callback();
  engine.Submit(std::move(request));
  return completion.Wait();
}

// The byte that belongs at `file_offset` in a file written with `seed`.
inline uint8_t PatternByte(uint64_t file_offset, uint32_t seed) {
  uint64_t x = (file_offset / 8 + 1) * 0x9E3779B97F4A7C15ull ^ seed;
  x ^= x >> 29;
  return static_cast<uint8_t>(x >> (8 * (file_offset % 8)));
}

inline void FillPattern(std::span<uint8_t> bytes, uint64_t file_offset, uint32_t seed) {
  for (uint64_t i = 0; i < bytes.size(); ++i) bytes[i] = PatternByte(file_offset + i, seed);
}

// The index of the first byte that differs from the pattern, or -1.
inline int64_t FirstMismatch(std::span<const uint8_t> bytes, uint64_t file_offset, uint32_t seed) {
  for (uint64_t i = 0; i < bytes.size(); ++i) {
    if (bytes[i] != PatternByte(file_offset + i, seed)) return static_cast<int64_t>(i);
  }
  return -1;
}

}  // namespace kvtier::disk_io_test
