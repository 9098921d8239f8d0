#include "tiers/eviction_order.h"

#include <algorithm>
#include <bit>
#include <string>

namespace kvtier {

std::string_view PolicyName(PolicyKind kind) {
  switch (kind) {
    case PolicyKind::kLru: return "lru";
    case PolicyKind::kS3Fifo: return "s3fifo";
    case PolicyKind::kClasses: return "classes";
  }
  return "?";
}

Result<PolicyKind> ParsePolicy(std::string_view name) {
  if (name == "lru") return PolicyKind::kLru;
  if (name == "s3fifo") return PolicyKind::kS3Fifo;
  if (name == "classes") return PolicyKind::kClasses;
  return Err(InvalidArgument("unknown policy '" + std::string(name) + "' (lru, s3fifo or classes)"));
}

int EvictionOrder::KeptClass(uint32_t next_use_ms) {
  // 0: under 256 ms; then a power of two each, up to 17 minutes and more.
  return std::min(kKeptClasses - 1, static_cast<int>(std::bit_width(next_use_ms >> 8)));
}

uint64_t EvictionOrder::protected_size() const {
  uint64_t n = count_[kHigh];
  for (int c = 0; c < kKeptClasses; ++c) n += count_[kKept + c];
  return n;
}

bool EvictionOrder::Hint(BlockEntry* e, const RetentionHint& hint, uint32_t now_ms, bool linked,
                         KeepLimits limits) {
  if (hint.engine_dropped) {
    // The only copy now: among the policy's blocks, at the hot end, as if it
    // had just arrived from the engine's cache.
    if (!EngineHeld(e)) return true;
    if (linked) Unlink(e);
    e->hint_bits = kLevelNone;
    if (linked) Link(e, /*hot=*/true);
    return true;
  }
  if (hint.engine_holds && !hint.session_over && hint.priority == 0 && hint.next_use_ms == 0) {
    if (linked) Unlink(e);
    e->hint_bits = kLevelOver | kEngineHeldBit;
    if (linked) Link(e, /*hot=*/false);
    return true;
  }
  uint8_t level = hint.session_over  ? kLevelOver
                  : hint.priority < 0 ? kLevelLow
                  : hint.priority > 0 ? kLevelHigh
                                      : kLevelNone;
  bool kept = !hint.session_over && hint.next_use_ms > 0;
  bool refused = false;
  if (kept || level == kLevelHigh) {
    // The bytes protected once it is: a renewal counts itself once, so it
    // is refused only while the protected bytes are past a limit already.
    const uint64_t counted = linked && Protects(QueueOf(e)) ? e->block_bytes : 0;
    const uint64_t tier_after = protected_bytes_ - counted + e->block_bytes;
    const uint64_t owner_after = protected_bytes_of(e->owner) - counted + e->block_bytes;
    if (tier_after > limits.tier_bytes || owner_after > limits.owner_bytes) {
      kept = false;
      if (level == kLevelHigh) level = kLevelNone;
      refused = true;
    }
  }
  if (linked) Unlink(e);
  e->hint_bits = level;
  if (kept) {
    e->hint_bits |= static_cast<uint8_t>(kKeptBit | (KeptClass(hint.next_use_ms) << kKeptClassShift));
    e->keep_until_ms = now_ms + 2 * hint.next_use_ms;
  }
  if (linked) Link(e, /*hot=*/level != kLevelOver);
  return !refused;
}

void EvictionOrder::Expire(uint32_t now_ms) {
  uint32_t budget = kExpirePerCall;
  for (int c = 0; c < kKeptClasses && budget > 0; ++c) {
    for (List& l : lists_[kKept + c]) {
      while (l.coldest != nullptr && budget > 0 && static_cast<int32_t>(now_ms - l.coldest->keep_until_ms) >= 0) {
        BlockEntry* e = l.coldest;
        Unlink(e);
        e->hint_bits &= kLevelMask;
        Link(e, /*hot=*/false);
        --budget;
      }
    }
  }
}

void EvictionOrder::Insert(BlockEntry* e, bool hot) {
  int queue = kSmall;
  if (kind_ == PolicyKind::kS3Fifo) {
    const uint64_t fingerprint = e->key.Low64();
    if (ghost_small_.Contains(fingerprint)) {
      Adapt(/*grow_small=*/true);  // S let it go too soon
      queue = kMain;
    } else if (ghost_main_.Contains(fingerprint)) {
      Adapt(/*grow_small=*/false);  // M let it go: M is short of room
      queue = kMain;
    }
  }
  // classes: a block moving between tiers keeps its class (a new one has 0).
  if (kind_ != PolicyKind::kClasses) Set(e, queue, 0);
  Link(e, hot);
}

void EvictionOrder::ArrivedTogether(std::span<BlockEntry* const> chain, const Arrival& arrival) {
  if (kind_ == PolicyKind::kS3Fifo || kind_ == PolicyKind::kLru) {
    // Deepest first: the chain's head ends up hottest, as a lookup's
    // touches leave it, and a scan from the cold end meets the tail (a
    // leaf) before the blocks whose children it would orphan.
    for (auto it = chain.rbegin(); it != chain.rend(); ++it) {
      Unlink(*it);
      Link(*it, /*hot=*/true);
    }
    return;
  }
  if (kind_ != PolicyKind::kClasses) return;
  for (size_t i = 0; i < chain.size(); ++i) {
    BlockEntry* e = chain[i];
    const uint8_t c = ClassOf(arrival, i + 1 == chain.size());
    const bool sample = ++arrivals_[c] % kSampleEvery == 0;
    e->policy_bits = static_cast<uint8_t>(c | (sample ? kSampleBit : 0));
    if (!sample && !Hinted(e) && Demoted(c)) {
      // Root first to the cold end: the leaf ends up coldest.
      Unlink(e);
      Link(e, /*hot=*/false);
    }
  }
}

uint8_t EvictionOrder::ClassOf(const Arrival& a, bool tail) {
  auto bucket = [](uint32_t n, uint32_t b1, uint32_t b2, uint32_t b3) -> uint8_t {
    return n < b1 ? 0 : n < b2 ? 1 : n < b3 ? 2 : 3;
  };
  const uint8_t hits = bucket(a.prefix_hits, 1, 4, 16);
  const uint8_t length = bucket(a.request_blocks, 2, 8, 32);
  return static_cast<uint8_t>((hits << 3) | (length << 1) | (tail && a.partial_tail ? 1 : 0));
}

bool EvictionOrder::Demoted(uint8_t c) const {
  constexpr double kMinSamples = 8;
  return samples_[c] >= kMinSamples && all_samples_ > 0 &&
         reused_[c] / samples_[c] < 0.5 * (all_reused_ / all_samples_);
}

void EvictionOrder::Learn(const BlockEntry* e) {
  if ((e->policy_bits & kSampleBit) == 0) return;
  const uint8_t c = e->policy_bits & kClassMask;
  const double reused = (e->policy_bits & kReusedBit) != 0 ? 1 : 0;
  samples_[c] += 1;
  reused_[c] += reused;
  all_samples_ += 1;
  all_reused_ += reused;
  // Recent samples count most: halved once as many ended as the tier holds
  // blocks (twice over), at least 1024.
  if (all_samples_ > std::max<double>(1024, 2.0 * static_cast<double>(size()) / kSampleEvery)) {
    for (size_t i = 0; i < kClasses; ++i) {
      samples_[i] /= 2;
      reused_[i] /= 2;
    }
    all_samples_ /= 2;
    all_reused_ /= 2;
  }
}

void EvictionOrder::Touch(BlockEntry* e) {
  if (kind_ == PolicyKind::kClasses && (e->policy_bits & kSampleBit) != 0) e->policy_bits |= kReusedBit;
  if (Hinted(e)) {
    // The expected use came (kept ends), and a session is not over after all.
    Unlink(e);
    e->hint_bits &= kLevelMask;
    if (LevelOf(e) == kLevelOver) e->hint_bits = kLevelNone;
    Link(e, /*hot=*/true);
    return;
  }
  if (kind_ != PolicyKind::kS3Fifo) {
    Unlink(e);
    Link(e, /*hot=*/true);
    return;
  }
  // A set-aside block counts its hit and stays aside (Keep reads it later).
  const uint8_t hits = HitsOf(e);
  if (hits < kMaxHits) Set(e, LevelQueueOf(e), static_cast<uint8_t>(hits + 1));
}

bool EvictionOrder::TouchHeld(BlockEntry* e, bool linked) {
  if (linked) Touch(e);
  // An application's hint wins (Touch ended a wait for the next use, and a
  // finished session's low place, already).
  if (!EngineHeld(e) && (linked ? LevelOf(e) != kLevelNone : Hinted(e))) return false;
  if (linked) Unlink(e);
  e->hint_bits = kLevelOver | kEngineHeldBit;
  if (linked) Link(e, /*hot=*/true);
  return true;
}

void EvictionOrder::Remove(BlockEntry* e, bool gone) {
  Unlink(e);
  if (gone && kind_ == PolicyKind::kClasses) {
    Learn(e);
    ghost_small_.SetRemember(size() + 1);
    ghost_small_.Add(e->key.Low64());
  }
  if (!gone || kind_ != PolicyKind::kS3Fifo) return;
  GhostFilter& ghost = QueueOf(e) == kSmall ? ghost_small_ : ghost_main_;
  ghost.SetRemember(size() + 1);
  ghost.Add(e->key.Low64());
}

void EvictionOrder::Return(BlockEntry* e, bool hot) { Link(e, hot); }

void EvictionOrder::Hold(BlockEntry* e) {
  Unlink(e);
  e->order_flags |= kHeldFlag;
  Link(e, /*hot=*/true);
}

void EvictionOrder::Release(BlockEntry* e) {
  if (!Held(e)) return;
  Unlink(e);
  Link(e, /*hot=*/false);
}

void EvictionOrder::Mark(BlockEntry* e, bool marked, bool linked) {
  if (Marked(e) == marked) return;
  if (!linked) {
    e->order_flags ^= kMarkedFlag;
    return;
  }
  const int q = QueueOf(e);
  Take(q, SideOf(e), e);
  e->order_flags ^= kMarkedFlag;
  BlockEntry* pos = ListOf(e).hottest;
  for (uint32_t steps = 0; pos != nullptr && Seq(pos) > Seq(e); ++steps) {
    if (steps == kPlaceSteps) {
      // Too deep to look for: at the hot end, as a hit would put it. Each
      // list stays in order of position, which the merge and the window
      // rely on.
      SetSeq(e, ++hot_seq_);
      PutAfter(q, SideOf(e), ListOf(e).hottest, e);
      return;
    }
    pos = Colder(pos);
  }
  PutAfter(q, SideOf(e), pos, e);
}

bool EvictionOrder::Keep(BlockEntry* e) {
  if (kind_ != PolicyKind::kS3Fifo || Hinted(e) || HitsOf(e) == 0) return false;
  const bool from_small = QueueOf(e) == kSmall;
  Unlink(e);
  Set(e, kMain, from_small ? 0 : static_cast<uint8_t>(HitsOf(e) - 1));
  Link(e, /*hot=*/true);
  return true;
}

void EvictionOrder::Adapt(bool grow_small) {
  // One block's worth of the tier per ghost hit.
  const double step = 1.0 / static_cast<double>(std::max<uint64_t>(policy_size(), 64));
  small_share_ = std::clamp(small_share_ + (grow_small ? step : -step), 0.01, 0.9);
}

void EvictionOrder::Link(BlockEntry* e, bool hot) {
  const int q = QueueOf(e);
  SetSeq(e, hot || count_[q] == 0 ? ++hot_seq_ : ColdestSeq(q) - 1);
  PutAfter(q, SideOf(e), hot ? ListOf(e).hottest : nullptr, e);
  ++count_[q];
  ++total_;
  if (Protects(q)) CountProtected(e, true);
}

uint64_t EvictionOrder::ColdestSeq(int q) const {
  const BlockEntry* a = lists_[q][0].coldest;
  const BlockEntry* b = lists_[q][1].coldest;
  return a == nullptr ? Seq(b) : b == nullptr ? Seq(a) : std::min(Seq(a), Seq(b));
}

void EvictionOrder::SetWindow(uint32_t n) {
  window_ = n;
  for (int q = 0; q < kQueues; ++q) {
    windows_[q] = Window{};
    WindowFill(q);
  }
}

void EvictionOrder::WindowFill(int q) {
  Window& w = windows_[q];
  while (w.inside < window_) {
    BlockEntry* next[2];
    for (int side = 0; side < 2; ++side) {
      next[side] = w.edge[side] != nullptr ? Hotter(w.edge[side]) : lists_[q][side].coldest;
    }
    if (next[0] == nullptr && next[1] == nullptr) return;
    const int side = next[1] == nullptr || (next[0] != nullptr && Seq(next[0]) < Seq(next[1])) ? 0 : 1;
    w.edge[side] = next[side];
    ++w.inside;
  }
}

void EvictionOrder::WindowGained(int q, int side, BlockEntry* e) {
  Window& w = windows_[q];
  if (!InWindow(q, e)) {
    WindowFill(q);  // hotter than the window: in it only while it is short
    return;
  }
  // Colder than the window's hottest: in it, the hottest of its list there
  // when it lies past its list's edge (the next block of that list is past
  // the window).
  if (w.edge[side] == nullptr || Seq(e) > Seq(w.edge[side])) w.edge[side] = e;
  ++w.inside;
  // One over: the hottest inside leaves it.
  if (w.inside > window_) {
    const int hottest = w.edge[1] == nullptr || (w.edge[0] != nullptr && Seq(w.edge[0]) > Seq(w.edge[1])) ? 0 : 1;
    w.edge[hottest] = Colder(w.edge[hottest]);
    --w.inside;
  }
}

void EvictionOrder::WindowLosing(int q, int side, const BlockEntry* e) {
  Window& w = windows_[q];
  if (!InWindow(q, e)) return;
  if (w.edge[side] == e) w.edge[side] = Colder(e);
  --w.inside;
}

void EvictionOrder::PutAfter(int q, int side, BlockEntry* pos, BlockEntry* e) {
  List& l = lists_[q][side];
  const uint32_t id = pool_->IdOf(e);
  BlockEntry* next = pos != nullptr ? Hotter(pos) : l.coldest;
  e->lru_prev = pos != nullptr ? pool_->IdOf(pos) : 0;
  e->lru_next = next != nullptr ? pool_->IdOf(next) : 0;
  if (pos != nullptr) {
    pos->lru_next = id;
  } else {
    l.coldest = e;
  }
  if (next != nullptr) {
    next->lru_prev = id;
  } else {
    l.hottest = e;
  }
  WindowGained(q, side, e);
}

void EvictionOrder::Take(int q, int side, BlockEntry* e) {
  WindowLosing(q, side, e);
  List& l = lists_[q][side];
  BlockEntry* prev = Colder(e);
  BlockEntry* next = Hotter(e);
  if (prev != nullptr) {
    prev->lru_next = e->lru_next;
  } else {
    l.coldest = next;
  }
  if (next != nullptr) {
    next->lru_prev = e->lru_prev;
  } else {
    l.hottest = prev;
  }
  e->lru_prev = e->lru_next = 0;
  WindowFill(q);
}

void EvictionOrder::CountProtected(const BlockEntry* e, bool in) {
  if (protected_by_owner_.size() <= e->owner) protected_by_owner_.resize(e->owner + size_t{1}, 0);
  if (in) {
    protected_bytes_ += e->block_bytes;
    protected_by_owner_[e->owner] += e->block_bytes;
  } else {
    protected_bytes_ -= e->block_bytes;
    protected_by_owner_[e->owner] -= e->block_bytes;
  }
}

void EvictionOrder::Unlink(BlockEntry* e) {
  const int q = QueueOf(e);
  Take(q, SideOf(e), e);
  e->order_flags &= static_cast<uint8_t>(~kHeldFlag);
  --count_[q];
  --total_;
  if (Protects(q)) CountProtected(e, false);
}

}  // namespace kvtier
