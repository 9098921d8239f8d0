// EvictionOrder: the order in which one tier offers its blocks for eviction,
// and where blocks go in it when they arrive, are hit or come back from a
// move (issue 19, docs/policy.md). BlockIndex keeps one per tier; blocks
// link through BlockEntry::lru_prev/lru_next (32-bit ids in BlockIndex's
// pool) and keep the policy's bits in
// BlockEntry::policy_bits. Every call is O(1); a victim scan looks at no
// more than its limit of blocks.
//
//   lru     One queue: arrivals and hits go to the hot end, the scan starts
//           at the cold end.
//   s3fifo  Two FIFO queues, small (S) and main (M), after S3-FIFO (Yang et
//           al., SOSP'23). An arrival enters S, or M when its key is a ghost
//           (let go of recently). A hit only counts (2 bits; nothing
//           moves). The scan takes S's oldest while S holds more than its
//           share, else M's; a block hit since it entered is kept instead of
//           evicted: out of S into M, or back to M's head with one hit less.
//           S's share adapts on ghosts (ARC's rule): a block S let go that
//           comes back grows it, one M let go shrinks it; it starts at 10%
//           and stays within 1% to 90%.
//
// Which blocks may go is the caller's (leases, moves, children: the
// `judge` of PickVictim); the order only says in which order to ask and
// which of the willing to keep.
//
// A parent whose children are still in its tier goes only as a last resort
// (prefix order: the leaves first). The scan sets it aside (kHeld) in a
// queue of its own, in the order it met them, so that the next scans do
// not walk past it again; BlockIndex releases it to the cold end of its
// queue once its last child in the tier or above has left. Set-aside
// blocks count as looked at: a scan walks the queues for `limit` blocks
// less those set aside, and takes the coldest set-aside one when it finds
// no leaf, as the walk over the same parents at the cold end would have.
// Each block is looked at once per stay at the cold end, not once per
// victim (issue 48: write-back looked at 600 blocks a victim).
//
// The caller may mark blocks (BlockCache marks those the tier below holds:
// clean, free to let go). Each queue keeps its marked blocks in a list of
// their own, and a scan merges the two by the position each block was
// linked at (a 48-bit sequence number), so that a scan of marked blocks
// only walks no other block, and every other scan sees one order.
//
// The engine's hints (RetentionHint, Hint) take blocks out of the policy's
// queues into queues of their own, LRU each, which the scan asks in this
// order:
//   low     priority -1, and blocks whose session is over (at its cold end;
//           a hit undoes "over"), and blocks an engine holds a copy of in
//           its own cache (engine_holds; Hint links them at the cold end,
//           and a store's ArrivedTogether then moves its chain to the hot
//           end under lru and s3fifo: the engine has them; a hit, or the
//           engine's word that it let go of its copy,
//           engine_dropped, puts them back among the policy's blocks at the
//           hot end, as the only copy: exclusive caching);
//   the policy's queues (blocks without a hint);
//   high    priority +1;
//   kept    a next use expected within next_use_ms: kept until that use (a
//           hit) or until twice next_use_ms has passed (Expire), then back
//           at the cold end of their level. In 13 classes by the power of
//           two of next_use_ms, the longest asked first (a block needed
//           later goes first, as Belady's would).
// High and kept blocks (protected) hold at most the KeepLimits a Hint is
// given, in bytes (BlockEntry::block_bytes): the tier's share, and the
// owner's share of it. Past either, a hint to keep a block is taken as none,
// a renewal of a protected block too, so no tenant keeps more than its
// share by hinting again.
//
// Thread-compatible: owned by BlockIndex's thread.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "tiers/block_entry.h"
#include "tiers/chunked_pool.h"
#include "tiers/ghost_filter.h"

namespace kvtier {

enum class PolicyKind : uint8_t { kLru = 0, kS3Fifo = 1, kClasses = 2 };
std::string_view PolicyName(PolicyKind kind);  // "lru", "s3fifo", "classes"
// Errors: kInvalidArgument naming the text and the policies.
Result<PolicyKind> ParsePolicy(std::string_view name);

// The engine's retention hint for blocks (Client::Store, Client::Hint).
// The daemon checks hints (ipc::CheckRetentionHint); the order takes any
// priority by its sign.
struct RetentionHint {
  int8_t priority = 0;       // -1: evict before unhinted blocks; 0: no hint; +1: keep over them
  uint32_t next_use_ms = 0;  // expected next use within this many ms; 0: none
  bool session_over = false;  // no use expected: evict first (priority and next_use ignored)
  // A store's blocks of which the storing engine keeps a copy in its own
  // cache: evicted first, unless hinted otherwise (priority or next_use).
  bool engine_holds = false;
  // A Hint: the engine let go of its own copy. Blocks held for it go back
  // among the policy's (others are left as they are; the rest of the hint
  // is not read).
  bool engine_dropped = false;
};

// What a victim scan's caller says of a candidate.
enum class Candidate : uint8_t {
  kSkip,        // cannot go now
  kEvict,       // may go
  kLastResort,  // may go, but only when no kEvict one is found (a parent of cached blocks)
  // As kLastResort, and it stays so until it has no children in its tier
  // or above (BlockIndex::HasChildrenAtOrAbove): set aside until then.
  kHeld,
};

class EvictionOrder {
 public:
  // `pool` holds the entries (borrowed; must outlive the order).
  EvictionOrder(PolicyKind kind, const ChunkedPool<BlockEntry>* pool) : kind_(kind), pool_(pool) {}
  EvictionOrder(const EvictionOrder&) = delete;
  EvictionOrder& operator=(const EvictionOrder&) = delete;

  PolicyKind kind() const { return kind_; }

  // `e` arrives in the tier: a store, or a move from another tier; at the
  // hot end of its queue, or the cold end (a move that ended with the block
  // parked, BlockIndex::Unpark).
  void Insert(BlockEntry* e, bool hot = true);
  // What the store of a chain of blocks knew of its request.
  struct Arrival {
    uint32_t prefix_hits = 0;    // leading blocks of the request held, or let go of lately (Remembers)
    uint32_t request_blocks = 0;  // blocks of the request (hits and new)
    bool partial_tail = false;   // the chain's last block covers part of a block's tokens
  };
  // The blocks of one store arrived, root first (each the parent of the
  // next), after their Inserts: lru and s3fifo queue them deepest first,
  // so that a chain's tail is the first of it a scan meets; classes takes
  // their class and may move them to the cold end (root first: the leaf
  // coldest).
  void ArrivedTogether(std::span<BlockEntry* const> chain, const Arrival& arrival);
  // `e` was hit.
  void Touch(BlockEntry* e);
  // `e` was loaded into an engine that keeps it in its own cache
  // (Load.engine_holds): a hit, after which it goes among the blocks
  // engines hold, at the hot end of their queue (as a store's arrive),
  // unless the hit left it hinted (kept over unhinted blocks, or evicted
  // before them): true when it went there. Not `linked` (parked): only
  // marked, for when it comes back.
  bool TouchHeld(BlockEntry* e, bool linked);
  // `e` leaves the order: for a while (a move in flight, Return brings it
  // back) or, `gone`, for good (the tier let go of it: remembered as a
  // ghost).
  void Remove(BlockEntry* e, bool gone);
  // `e` comes back after Remove(e, false): its queue and hits as they were,
  // at its queue's hot or cold end.
  void Return(BlockEntry* e, bool hot);
  // `e`, set aside as held by its children (Candidate::kHeld), has none in
  // its tier or above now: back at the cold end of its queue. Others are
  // left as they are.
  void Release(BlockEntry* e);

  // The first candidate, in the policy's order, that `judge` (Candidate
  // (const BlockEntry*)) says may go, or else the first it says may go as a
  // last resort (*last_resort set), or null; at most `limit` candidates are
  // looked at (set-aside ones count: see above). s3fifo keeps (moves) the
  // willing that were hit meanwhile. `judge` must not change the order.
  // `marked_only`: only marked blocks are candidates, and only those among
  // the window's coldest blocks of their queue (SetWindow): a scan of
  // marked blocks stops at the first past them, as a walk of that many
  // blocks over both lists would have.
  template <typename F>
  BlockEntry* PickVictim(uint32_t limit, F&& judge, bool* last_resort, bool marked_only = false);

  // Marks `e`, or clears its mark. `linked`: e is in this order (else
  // only its flag changes, and Insert or Return places it). Linked, it
  // moves to the other list of its queue at its place by position, looked
  // for from the hot end for at most kPlaceSteps blocks (the blocks marked
  // are mostly ones whose write just ended, near the hot end); deeper, it
  // goes to the hot end with a new position, as a hit would put it, so that
  // every list stays in order of position.
  static constexpr uint32_t kPlaceSteps = 64;
  void Mark(BlockEntry* e, bool marked, bool linked);
  static bool Marked(const BlockEntry* e) { return (e->order_flags & kMarkedFlag) != 0; }
  // Each queue keeps track of its `n` coldest blocks (a boundary in each
  // list, moved by a step or two at each link and unlink): the window of a
  // marked-only scan. Default 1024; set before blocks arrive (else it is
  // built again once, walking n blocks a queue).
  void SetWindow(uint32_t n);
  // Whether `e` is set aside as held by its children (Candidate::kHeld).
  static bool Held(const BlockEntry* e) { return (e->order_flags & kHeldFlag) != 0; }

  // The engine's hint for `e`, replacing any it had (a hint of none clears
  // it); `linked`: e is in this order (not parked), else only its bits
  // change and Return or Insert places it. `now_ms`: the order's clock
  // (any origin; wraps). Returns false when a hint to keep it was refused
  // (it would take protected bytes past `limits`; also when it was
  // protected already and they are past them now) and it is kept as
  // unhinted.
  struct KeepLimits {
    uint64_t tier_bytes = UINT64_MAX;   // protected bytes of every owner
    uint64_t owner_bytes = UINT64_MAX;  // protected bytes of e's owner
  };
  bool Hint(BlockEntry* e, const RetentionHint& hint, uint32_t now_ms, bool linked, KeepLimits limits);
  // Kept blocks whose time has passed go back to their level, at most
  // kExpirePerCall a call (the rest at the next).
  static constexpr uint32_t kExpirePerCall = 256;
  void Expire(uint32_t now_ms);
  // Blocks in the high and kept queues, and their bytes: all, and one
  // owner's.
  uint64_t protected_size() const;
  uint64_t protected_bytes() const { return protected_bytes_; }
  uint64_t protected_bytes_of(TenantId owner) const {
    return owner < protected_by_owner_.size() ? protected_by_owner_[owner] : 0;
  }
  // Blocks in the low queue, and set aside as held by their children.
  uint64_t low_size() const { return count_[kLow]; }
  uint64_t held_size() const { return count_[kHeld]; }
  // Whether `e` is low as its engine holds a copy (engine_holds).
  static bool EngineHeld(const BlockEntry* e) { return (e->hint_bits & kEngineHeldBit) != 0; }

  uint64_t size() const { return total_; }
  // What a block carries for its place in an order: its two links, the
  // policy's bits, the hint's bits, the time it is kept until, its flags
  // and its position.
  static constexpr size_t kMetadataBytesPerBlock =
      sizeof(BlockEntry::lru_prev) + sizeof(BlockEntry::lru_next) + sizeof(BlockEntry::policy_bits) +
      sizeof(BlockEntry::hint_bits) + sizeof(BlockEntry::keep_until_ms) + sizeof(BlockEntry::order_flags) +
      sizeof(BlockEntry::order_seq_high) + sizeof(BlockEntry::order_seq_low);
  // Whether the tier let go of a block of this key lately (s3fifo and
  // classes keep ghosts; lru none).
  bool Remembers(const StoredKey& key) const {
    const uint64_t f = key.Low64();
    return ghost_small_.Contains(f) || ghost_main_.Contains(f);
  }
  // s3fifo: blocks in S, and S's target share of the tier (0 for lru).
  uint64_t small_size() const { return kind_ == PolicyKind::kS3Fifo ? count_[kSmall] : 0; }
  double small_share() const { return kind_ == PolicyKind::kS3Fifo ? small_share_ : 0.0; }
  // The first block of a queue's unmarked (or marked) list from its cold
  // end, and the next hotter and colder ones in its list (tests, and the
  // order's own scan).
  BlockEntry* Coldest(bool main_queue = false, bool marked = false) const {
    return lists_[main_queue ? kMain : kSmall][marked ? 1 : 0].coldest;
  }
  // Its position: lower is colder within a queue (tests).
  static uint64_t Position(const BlockEntry* e) { return Seq(e); }
  // Whether linked block `e` lies in its queue's window (SetWindow).
  bool InWindow(const BlockEntry* e) const { return InWindow(QueueOf(e), e); }
  BlockEntry* Hotter(const BlockEntry* e) const { return pool_->At(e->lru_next); }
  BlockEntry* Colder(const BlockEntry* e) const { return pool_->At(e->lru_prev); }

 private:
  // lru keeps everything in queue 0; s3fifo: S is 0, M is 1. Then the
  // hints' queues.
  static constexpr int kSmall = 0;
  static constexpr int kMain = 1;
  static constexpr int kLow = 2;
  static constexpr int kHigh = 3;
  static constexpr int kKept = 4;  // kKept + class, class < kKeptClasses
  static constexpr int kKeptClasses = 13;
  static constexpr int kHeld = kKept + kKeptClasses;  // set aside (Held)
  static constexpr int kQueues = kHeld + 1;
  // hint_bits: the level (2 bits), whether it is kept, the kept class (4
  // bits), and whether it is low as an engine holds it (level Over).
  static constexpr uint8_t kLevelMask = 0x3;
  static constexpr uint8_t kLevelNone = 0, kLevelLow = 1, kLevelHigh = 2, kLevelOver = 3;
  static constexpr uint8_t kKeptBit = 0x4;
  static constexpr uint8_t kKeptClassShift = 3;
  static constexpr uint8_t kKeptClassMask = 0xf;
  static constexpr uint8_t kEngineHeldBit = 0x80;
  static uint8_t LevelOf(const BlockEntry* e) { return e->hint_bits & kLevelMask; }
  static bool Hinted(const BlockEntry* e) { return e->hint_bits != 0; }
  static int KeptClass(uint32_t next_use_ms);
  // The policy's own blocks (s3fifo's share is of these).
  uint64_t policy_size() const { return count_[kSmall] + count_[kMain]; }
  static constexpr uint8_t kQueueBit = 0x1;
  static constexpr uint8_t kHitsShift = 1;
  static constexpr uint8_t kMaxHits = 3;

  // order_flags.
  static constexpr uint8_t kHeldFlag = 0x1;
  static constexpr uint8_t kMarkedFlag = 0x2;
  // A queue is two lists, unmarked (0) and marked (1), each coldest to
  // hottest by position.
  struct List {
    BlockEntry* coldest = nullptr;
    BlockEntry* hottest = nullptr;
  };
  static int SideOf(const BlockEntry* e) { return Marked(e) ? 1 : 0; }
  List& ListOf(const BlockEntry* e) { return lists_[QueueOf(e)][SideOf(e)]; }
  static uint64_t Seq(const BlockEntry* e) { return (uint64_t{e->order_seq_high} << 32) | e->order_seq_low; }
  static void SetSeq(BlockEntry* e, uint64_t seq) {
    e->order_seq_high = static_cast<uint16_t>(seq >> 32);
    e->order_seq_low = static_cast<uint32_t>(seq);
  }
  // Positions start mid-range: links at the hot end count up (2^47:
  // centuries at millions a second); a link at the cold end takes one
  // below its queue's coldest.
  static constexpr uint64_t kSeqStart = uint64_t{1} << 47;
  // The position of queue q's coldest block (either list); REQUIRES: q
  // holds a block.
  uint64_t ColdestSeq(int q) const;
  // A queue's window: its `window_` coldest blocks are those up to edge[0]
  // in its unmarked list and up to edge[1] in its marked one (null: none of
  // that list), `inside` of them.
  struct Window {
    BlockEntry* edge[2] = {nullptr, nullptr};
    uint64_t inside = 0;
  };
  // Whether `e` lies in queue q's window: at or below the hotter edge's
  // position (every block of either list up to there is in it).
  bool InWindow(int q, const BlockEntry* e) const {
    const Window& w = windows_[q];
    for (const BlockEntry* edge : w.edge) {
      if (edge != nullptr && Seq(e) <= Seq(edge)) return true;
    }
    return false;
  }
  // The window after e entered or left list (q, side): it takes in the
  // next hotter block while short, gives back its hottest while over.
  void WindowGained(int q, int side, BlockEntry* e);
  void WindowLosing(int q, int side, const BlockEntry* e);
  void WindowFill(int q);
  // `e` into list (q, side) just hotter than `pos` (null: at its cold
  // end), and out of it.
  void PutAfter(int q, int side, BlockEntry* pos, BlockEntry* e);
  void Take(int q, int side, BlockEntry* e);
  // The colder of the two lists' next blocks a and b (either may be null),
  // stepping that list's cursor on.
  BlockEntry* NextOf(BlockEntry*& a, BlockEntry*& b) const {
    const bool take_a = b == nullptr || (a != nullptr && Seq(a) < Seq(b));
    BlockEntry*& cursor = take_a ? a : b;
    BlockEntry* e = cursor;
    cursor = Hotter(e);
    return e;
  }
  int QueueOf(const BlockEntry* e) const { return Held(e) ? kHeld : LevelQueueOf(e); }
  // Its queue when not set aside.
  int LevelQueueOf(const BlockEntry* e) const {
    if ((e->hint_bits & kKeptBit) != 0) return kKept + ((e->hint_bits >> kKeptClassShift) & kKeptClassMask);
    switch (LevelOf(e)) {
      case kLevelLow:
      case kLevelOver: return kLow;
      case kLevelHigh: return kHigh;
      default: return kind_ == PolicyKind::kS3Fifo ? e->policy_bits & kQueueBit : 0;
    }
  }
  // classes: policy_bits holds the class (5 bits), whether the block is a
  // sample (inserted hot whatever its class: what the class's reuse is
  // learned from) and whether a sample was hit.
  static constexpr uint8_t kClassMask = 0x1f;
  static constexpr uint8_t kSampleBit = 0x20;
  static constexpr uint8_t kReusedBit = 0x40;
  static constexpr size_t kClasses = 32;
  static constexpr uint32_t kSampleEvery = 8;
  static uint8_t ClassOf(const Arrival& a, bool tail);
  // Whether class `c` goes to the cold end: its samples were reused less
  // than half as often as all samples were.
  bool Demoted(uint8_t c) const;
  void Learn(const BlockEntry* e);
  static uint8_t HitsOf(const BlockEntry* e) { return static_cast<uint8_t>(e->policy_bits >> kHitsShift); }
  static void Set(BlockEntry* e, int queue, uint8_t hits) {
    e->policy_bits = static_cast<uint8_t>(queue | (hits << kHitsShift));
  }
  static bool Protects(int queue) { return queue == kHigh || queue >= kKept; }
  // Moves a block into, or out of, its queue; keeps the protected bytes.
  // Unlink ends its being set aside.
  void Link(BlockEntry* e, bool hot);
  void Unlink(BlockEntry* e);
  // PickVictim's parts: the queues in the scan's order for at most
  // `budget` blocks (kHeld ones set aside: Hold), returning the first the
  // judge lets go and keeping the first last resort in *fallback; and the
  // coldest set-aside block the judge does not skip.
  template <typename F>
  BlockEntry* Scan(uint32_t budget, F& judge, BlockEntry** fallback, bool marked_only);
  template <typename F>
  BlockEntry* ColdestHeld(uint32_t limit, F& judge, bool marked_only);
  void Hold(BlockEntry* e);
  void CountProtected(const BlockEntry* e, bool in);
  // s3fifo: whether the scan keeps willing block `e` (hit since it entered
  // its queue), and moves it.
  bool Keep(BlockEntry* e);
  void Adapt(bool grow_small);

  const PolicyKind kind_;
  const ChunkedPool<BlockEntry>* pool_;
  List lists_[kQueues][2];
  Window windows_[kQueues];
  uint32_t window_ = 1024;
  uint64_t hot_seq_ = kSeqStart;
  uint64_t count_[kQueues] = {};
  uint64_t total_ = 0;
  uint64_t protected_bytes_ = 0;
  std::vector<uint64_t> protected_by_owner_;  // by TenantId
  double small_share_ = 0.1;
  GhostFilter ghost_small_;  // let go of from S
  GhostFilter ghost_main_;   // let go of from M
  // classes: per class, arrivals, and the samples that ended (left the
  // tier) and were reused; halved as they grow, so recent blocks count most.
  uint32_t arrivals_[kClasses] = {};
  double samples_[kClasses] = {};
  double reused_[kClasses] = {};
  double all_samples_ = 0;
  double all_reused_ = 0;
};

template <typename F>
BlockEntry* EvictionOrder::PickVictim(uint32_t limit, F&& judge, bool* last_resort, bool marked_only) {
  const uint64_t held = count_[kHeld];
  BlockEntry* fallback = nullptr;
  BlockEntry* victim =
      Scan(held < limit ? static_cast<uint32_t>(limit - held) : 0, judge, &fallback, marked_only);
  if (victim == nullptr) {
    // The set-aside parents were colder than what the scan walked.
    if (BlockEntry* h = ColdestHeld(limit, judge, marked_only); h != nullptr) fallback = h;
    // None the judge takes (another owner's, leased): the queues get the
    // whole limit.
    if (fallback == nullptr && held > 0) victim = Scan(limit, judge, &fallback, marked_only);
  }
  if (last_resort != nullptr) *last_resort = victim == nullptr && fallback != nullptr;
  return victim != nullptr ? victim : fallback;
}

template <typename F>
BlockEntry* EvictionOrder::Scan(uint32_t budget, F& judge, BlockEntry** fallback, bool marked_only) {
  uint32_t scanned = 0;
  int first = kSmall;
  if (kind_ == PolicyKind::kS3Fifo &&
      (static_cast<double>(count_[kSmall]) <= small_share_ * static_cast<double>(policy_size()) ||
       count_[kSmall] == 0)) {
    first = kMain;
  }
  int order[kHeld] = {kLow, first, 1 - first, kHigh};
  for (int c = 0; c < kKeptClasses; ++c) order[4 + c] = kKept + kKeptClasses - 1 - c;
  for (int q : order) {
    BlockEntry* unmarked = marked_only ? nullptr : lists_[q][0].coldest;
    BlockEntry* marked = lists_[q][1].coldest;
    while ((unmarked != nullptr || marked != nullptr) && scanned < budget) {
      if (marked_only && !InWindow(q, marked)) break;
      ++scanned;
      BlockEntry* e = NextOf(unmarked, marked);  // steps on before Keep or Hold moves it
      const Candidate c = judge(static_cast<const BlockEntry*>(e));
      if (c == Candidate::kEvict && !Keep(e)) return e;
      if (c == Candidate::kLastResort && *fallback == nullptr) *fallback = e;
      if (c == Candidate::kHeld) Hold(e);
    }
  }
  return nullptr;
}

template <typename F>
BlockEntry* EvictionOrder::ColdestHeld(uint32_t limit, F& judge, bool marked_only) {
  BlockEntry* unmarked = marked_only ? nullptr : lists_[kHeld][0].coldest;
  BlockEntry* marked = lists_[kHeld][1].coldest;
  for (uint32_t scanned = 0; (unmarked != nullptr || marked != nullptr) && scanned < limit; ++scanned) {
    BlockEntry* e = NextOf(unmarked, marked);
    if (judge(static_cast<const BlockEntry*>(e)) != Candidate::kSkip) return e;
  }
  return nullptr;
}

}  // namespace kvtier
