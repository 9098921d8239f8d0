#include "tiers/block_index.h"

#include <utility>

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

BlockEntry* BlockIndex::Find(const StoredKey& key) {
  Slot* s = table_.Find(key);
  return s == nullptr ? nullptr : s->entry;
}

void BlockIndex::Prefetch(std::span<const StoredKey> keys) const {
  for (const StoredKey& k : keys) table_.Prefetch(k);
}

BlockEntry* BlockIndex::NewEntry(const StoredKey& key) {
  BlockEntry* e = entries_.New();
  e->key = key;
  table_.Insert(Slot{key, e});  // checks that the key is absent
  return e;
}

void BlockIndex::DeleteEntry(BlockEntry* e) {
  Slot* slot = table_.Find(e->key);
  KVTIER_CHECK(slot != nullptr && slot->entry == e);
  table_.Erase(slot);
  entries_.Delete(e);
}

BlockEntry* BlockIndex::Insert(const StoredKey& key, Tier tier, const StoredKey* parent) {
  BlockEntry* e = NewEntry(key);
  e->tier = tier;
  order(tier).Insert(e);
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
  if (!e->parked) order(e->tier).Remove(e, /*gone=*/true);
  // Detach from the parent.
  if (BlockEntry* p = e->parent; p != nullptr) {
    --p->children_in_tier[static_cast<size_t>(e->tier)];
    MaybeRelease(p);
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
  DeleteEntry(e);
}

void BlockIndex::Touch(BlockEntry* e) {
  if (!e->parked) order(e->tier).Touch(e);
}

void BlockIndex::ChangeTier(BlockEntry* e, Tier to) {
  if (!e->parked) order(e->tier).Remove(e, /*gone=*/true);
  if (e->parent != nullptr) {
    --e->parent->children_in_tier[static_cast<size_t>(e->tier)];
    ++e->parent->children_in_tier[static_cast<size_t>(to)];
    MaybeRelease(e->parent);
  }
  e->tier = to;
  if (e->parked) {
    e->arrives = true;  // into the new tier's order when unparked
  } else {
    order(to).Insert(e);
  }
}

void BlockIndex::Park(BlockEntry* e) {
  if (e->parked) return;
  order(e->tier).Remove(e, /*gone=*/false);
  e->parked = true;
}

void BlockIndex::Unpark(BlockEntry* e, bool hot) {
  if (!e->parked) return;
  e->parked = false;
  if (std::exchange(e->arrives, false)) {
    order(e->tier).Insert(e, hot);
  } else {
    order(e->tier).Return(e, hot);
  }
}

void BlockIndex::ReleaseLease(BlockEntry* e) {
  KVTIER_CHECK(e->leases > 0 && total_leases_ > 0);
  --e->leases;
  --total_leases_;
}

void BlockIndex::MaybeRelease(BlockEntry* p) {
  if (EvictionOrder::Held(p) && !HasChildrenAtOrAbove(p, p->tier)) order(p->tier).Release(p);
}

bool BlockIndex::HasChildrenAtOrAbove(const BlockEntry* e, Tier t) {
  for (size_t i = 0; i <= static_cast<size_t>(t); ++i) {
    if (e->children_in_tier[i] != 0) return true;
  }
  return false;
}

}  // namespace kvtier
