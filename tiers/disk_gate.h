// DiskGate: the learned NVMe gate (policy.disk_admission.learned, issue 19,
// docs/policy.md). It learns, per class of request, how often blocks of that
// class are hit on disk before their region is reclaimed, and says whether a
// block leaving host is worth a write.
//
// A block's class is its request's length in blocks, by power of two (a
// store's parent depth and its keys); one block in `sample_every` of each
// class is a sample, always written, so the gate keeps learning what it
// refuses. A class is refused once it has `min_samples` and its samples were
// hit less often than all samples were; counts are halved as they grow, so
// recent samples count most. Blocks of no known class (adopted at a restart)
// are always admitted and teach nothing.
//
// BlockCache keeps the tag (class and sample bit) in BlockEntry::disk_gate
// and DiskOnlyBlock::disk_gate. Every call is O(1).
//
// Thread-compatible: owned by BlockCache's thread.
#pragma once

#include <algorithm>
#include <bit>
#include <cstdint>

namespace kvtier {

class DiskGate {
 public:
  static constexpr uint8_t kClassMask = 0x1f;  // 0: no class known
  static constexpr uint8_t kSampleBit = 0x20;
  static constexpr uint8_t kTagMask = kClassMask | kSampleBit;  // a tag fits in 6 bits
  static constexpr int kClasses = 32;

  explicit DiskGate(uint32_t sample_every = 32, uint32_t min_samples = 8)
      : sample_every_(std::max(1u, sample_every)), min_samples_(min_samples) {}

  // The tag of a new block of a request of `request_blocks` (>= 1).
  uint8_t TagFor(uint32_t request_blocks) {
    const auto c = static_cast<uint8_t>(std::min<int>(kClasses - 1, std::bit_width(std::max(1u, request_blocks))));
    const bool sample = ++arrivals_[c] % sample_every_ == 0;
    return static_cast<uint8_t>(c | (sample ? kSampleBit : 0));
  }

  // A block of tag `tag` left the disk, hit there since it was written or
  // not. Only samples teach. `disk_blocks`: about how many the disk holds
  // (the horizon of the decay).
  void Learn(uint8_t tag, bool hit, uint64_t disk_blocks) {
    const uint8_t c = tag & kClassMask;
    if (c == 0 || (tag & kSampleBit) == 0) return;
    const double h = hit ? 1 : 0;
    samples_[c] += 1;
    hits_[c] += h;
    all_samples_ += 1;
    all_hits_ += h;
    if (all_samples_ > std::max<double>(1024, 2.0 * static_cast<double>(disk_blocks) / sample_every_)) {
      for (int i = 0; i < kClasses; ++i) {
        samples_[i] /= 2;
        hits_[i] /= 2;
      }
      all_samples_ /= 2;
      all_hits_ /= 2;
    }
  }

  // Whether a block of tag `tag` that showed no reuse is written.
  bool Admits(uint8_t tag) const {
    const uint8_t c = tag & kClassMask;
    if (c == 0 || (tag & kSampleBit) != 0 || samples_[c] < min_samples_ || all_samples_ <= 0) return true;
    return hits_[c] / samples_[c] >= all_hits_ / all_samples_;
  }

  // The class's share of samples hit, and all samples' (tests, stats).
  double hit_rate(uint8_t c) const { return samples_[c] > 0 ? hits_[c] / samples_[c] : 0.0; }
  double overall_hit_rate() const { return all_samples_ > 0 ? all_hits_ / all_samples_ : 0.0; }

 private:
  const uint32_t sample_every_;
  const uint32_t min_samples_;
  uint64_t arrivals_[kClasses] = {};
  double samples_[kClasses] = {};
  double hits_[kClasses] = {};
  double all_samples_ = 0;
  double all_hits_ = 0;
};

}  // namespace kvtier
