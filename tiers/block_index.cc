#include "tiers/block_index.h"

#include "common/check.h"

namespace kvtier {

const char* TierName(Tier tier) {
  switch (tier) {
    case Tier::kHbm: return "hbm";
    case Tier::kHost: return "host";
    case Tier::kDisk: return "disk";
  }
  return "?";
}

size_t BlockIndex::Home(const StoredKey& key) const {
  // Stored keys are uniform hashes; a Fibonacci multiply spreads keys that
  // are not (tests' counters) too, then multiply-shift maps onto the table.
  __extension__ using U128 = unsigned __int128;  // g++ and clang; -Wpedantic asks for the marker
  const uint64_t h = key.Low64() * 0x9e3779b97f4a7c15ull;
  return static_cast<size_t>((static_cast<U128>(h) * table_.size()) >> 64);
}

BlockIndex::Slot* BlockIndex::FindSlot(const StoredKey& key) {
  if (table_.empty()) return nullptr;
  for (size_t i = Home(key), n = 0; n < table_.size(); ++n, i = (i + 1 == table_.size() ? 0 : i + 1)) {
    Slot& s = table_[i];
    if (s.entry == nullptr) return nullptr;
    if (s.entry != Tombstone() && s.key == key) return &s;
  }
  return nullptr;
}

BlockEntry* BlockIndex::Find(const StoredKey& key) {
  Slot* s = FindSlot(key);
  return s == nullptr ? nullptr : s->entry;
}

void BlockIndex::Prefetch(std::span<const StoredKey> keys) const {
  if (table_.empty()) return;
  for (const StoredKey& k : keys) __builtin_prefetch(&table_[Home(k)]);
}

void BlockIndex::TableInsert(const StoredKey& key, BlockEntry* e) {
  // At most 3/4 full, tombstones included. map_ already holds `key`, so a
  // rebuild places it too.
  if ((map_.size() + table_tombstones_) * 4 > table_.size() * 3) {
    GrowTable();
    return;
  }
  TablePut(key, e);
}

void BlockIndex::TablePut(const StoredKey& key, BlockEntry* e) {
  for (size_t i = Home(key);; i = (i + 1 == table_.size() ? 0 : i + 1)) {
    Slot& s = table_[i];
    if (s.entry == nullptr || s.entry == Tombstone()) {
      if (s.entry == Tombstone()) --table_tombstones_;
      s = Slot{key, e};
      return;
    }
  }
}

void BlockIndex::GrowTable() {
  // Twice what the live entries need at 3/4: tombstones go.
  table_.assign(std::max<size_t>(64, map_.size() * 8 / 3), Slot{});
  table_tombstones_ = 0;
  for (auto& [key, entry] : map_) TablePut(key, &entry);
}

BlockEntry* BlockIndex::Insert(const StoredKey& key, Tier tier, const StoredKey* parent) {
  auto [it, inserted] = map_.try_emplace(key);
  KVTIER_CHECK(inserted);
  BlockEntry* e = &it->second;
  e->key = key;
  TableInsert(key, e);
  e->tier = tier;
  LinkHot(e);
  if (parent != nullptr) {
    if (BlockEntry* p = Find(*parent); p != nullptr && p != e) {
      e->parent = p;
      e->next_sibling = p->first_child;
      if (p->first_child != nullptr) p->first_child->prev_sibling = e;
      p->first_child = e;
      ++p->children_in_tier[static_cast<size_t>(tier)];
    }
  }
  return e;
}

void BlockIndex::Erase(BlockEntry* e) {
  KVTIER_CHECK(e->leases == 0);
  if (!e->parked) Unlink(e);
  // Detach from the parent.
  if (BlockEntry* p = e->parent; p != nullptr) {
    --p->children_in_tier[static_cast<size_t>(e->tier)];
    if (e->prev_sibling != nullptr) e->prev_sibling->next_sibling = e->next_sibling;
    else p->first_child = e->next_sibling;
    if (e->next_sibling != nullptr) e->next_sibling->prev_sibling = e->prev_sibling;
  }
  // Orphan the children: they stay cached, but no longer hold this one.
  for (BlockEntry* c = e->first_child; c != nullptr;) {
    BlockEntry* next = c->next_sibling;
    c->parent = c->prev_sibling = c->next_sibling = nullptr;
    c = next;
  }
  const StoredKey key = e->key;  // erase() must not read the key it is destroying
  Slot* slot = FindSlot(key);
  KVTIER_CHECK(slot != nullptr);
  slot->entry = Tombstone();
  ++table_tombstones_;
  map_.erase(key);
}

void BlockIndex::Touch(BlockEntry* e) {
  if (e->parked) return;
  Unlink(e);
  LinkHot(e);
}

void BlockIndex::ChangeTier(BlockEntry* e, Tier to) {
  if (!e->parked) Unlink(e);
  if (e->parent != nullptr) {
    --e->parent->children_in_tier[static_cast<size_t>(e->tier)];
    ++e->parent->children_in_tier[static_cast<size_t>(to)];
  }
  e->tier = to;
  if (!e->parked) LinkHot(e);
}

void BlockIndex::Park(BlockEntry* e) {
  if (e->parked) return;
  Unlink(e);
  e->parked = true;
}

void BlockIndex::Unpark(BlockEntry* e, bool hot) {
  if (!e->parked) return;
  e->parked = false;
  if (hot) {
    LinkHot(e);
  } else {
    LinkCold(e);
  }
}

void BlockIndex::ReleaseLease(BlockEntry* e) {
  KVTIER_CHECK(e->leases > 0 && total_leases_ > 0);
  --e->leases;
  --total_leases_;
}

bool BlockIndex::HasChildrenAtOrAbove(const BlockEntry* e, Tier t) {
  for (size_t i = 0; i <= static_cast<size_t>(t); ++i) {
    if (e->children_in_tier[i] != 0) return true;
  }
  return false;
}

void BlockIndex::LinkHot(BlockEntry* e) {
  List& l = lru_[static_cast<size_t>(e->tier)];
  e->lru_prev = l.hottest;
  e->lru_next = nullptr;
  if (l.hottest != nullptr) l.hottest->lru_next = e;
  l.hottest = e;
  if (l.coldest == nullptr) l.coldest = e;
}

void BlockIndex::LinkCold(BlockEntry* e) {
  List& l = lru_[static_cast<size_t>(e->tier)];
  e->lru_next = l.coldest;
  e->lru_prev = nullptr;
  if (l.coldest != nullptr) l.coldest->lru_prev = e;
  l.coldest = e;
  if (l.hottest == nullptr) l.hottest = e;
}

void BlockIndex::Unlink(BlockEntry* e) {
  List& l = lru_[static_cast<size_t>(e->tier)];
  if (e->lru_prev != nullptr) e->lru_prev->lru_next = e->lru_next;
  else l.coldest = e->lru_next;
  if (e->lru_next != nullptr) e->lru_next->lru_prev = e->lru_prev;
  else l.hottest = e->lru_prev;
  e->lru_prev = e->lru_next = nullptr;
}

}  // namespace kvtier
