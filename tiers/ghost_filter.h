// GhostFilter: "was this key let go of recently?", in about two bytes per
// remembered key: two Bloom filters that take turns (the newer one takes the
// keys; when it has taken as many as the filter remembers, the older one is
// cleared and becomes the newer). A key is remembered for between one and
// two turns. False positives: about 3% per filter at a full turn (3 hash
// bits, 8 bits per key), so a check finds a key that was never added in about
// 6% of cases; the policies that ask (tiers/eviction_order.h) only take the
// answer as a hint.
//
// `remember` may change as the tier grows; it takes effect at the next turn
// (a turn clears memory of that size: O(remember) once per `remember`
// additions, O(1) amortized).
//
// Thread-compatible: owned by BlockIndex's thread.
#pragma once

#include <cstdint>
#include <vector>

namespace kvtier {

class GhostFilter {
 public:
  explicit GhostFilter(uint64_t remember = kMinRemember) { Resize(remember); }

  void Add(uint64_t fingerprint) {
    if (added_ >= remember_) Turn();
    Set(newer_, fingerprint);
    ++added_;
  }
  bool Contains(uint64_t fingerprint) const { return Has(newer_, fingerprint) || Has(older_, fingerprint); }
  // How many keys a turn takes (at least kMinRemember), from the next turn.
  void SetRemember(uint64_t remember) { next_remember_ = remember < kMinRemember ? kMinRemember : remember; }
  uint64_t memory_bytes() const { return (newer_.size() + older_.size()) * sizeof(uint64_t); }

  static constexpr uint64_t kMinRemember = 1024;

 private:
  static constexpr int kHashes = 3;
  void Resize(uint64_t remember) {
    remember_ = remember < kMinRemember ? kMinRemember : remember;
    next_remember_ = remember_;
    newer_.assign(remember_ / 8 + 1, 0);  // 8 bits per key
    older_.assign(remember_ / 8 + 1, 0);
  }
  void Turn() {
    older_.swap(newer_);
    remember_ = next_remember_;
    newer_.assign(remember_ / 8 + 1, 0);
    added_ = 0;
  }
  // Bit i of the key's kHashes bits in `bits` (a multiply-shift hash per bit).
  static uint64_t Bit(const std::vector<uint64_t>& bits, uint64_t fingerprint, int i) {
    static constexpr uint64_t kMul[kHashes] = {0x9e3779b97f4a7c15ull, 0xc2b2ae3d27d4eb4full, 0x165667b19e3779f9ull};
    const uint64_t h = (fingerprint ^ (fingerprint >> 29)) * kMul[i];
    return (h >> 20) % (bits.size() * 64);
  }
  static void Set(std::vector<uint64_t>& bits, uint64_t fingerprint) {
    for (int i = 0; i < kHashes; ++i) {
      const uint64_t b = Bit(bits, fingerprint, i);
      bits[b / 64] |= uint64_t{1} << (b % 64);
    }
  }
  static bool Has(const std::vector<uint64_t>& bits, uint64_t fingerprint) {
    for (int i = 0; i < kHashes; ++i) {
      const uint64_t b = Bit(bits, fingerprint, i);
      if ((bits[b / 64] & (uint64_t{1} << (b % 64))) == 0) return false;
    }
    return true;
  }

  std::vector<uint64_t> newer_;
  std::vector<uint64_t> older_;
  uint64_t remember_ = kMinRemember;
  uint64_t next_remember_ = kMinRemember;
  uint64_t added_ = 0;
};

}  // namespace kvtier
