#include "tiers/block_index.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "tests/tiers/open_table_test_util.h"

namespace kvtier {
namespace {

StoredKey K(uint32_t n) {
  StoredKey key;
  for (size_t i = 0; i < 4; ++i)
    key.bytes[StoredKey::kSize - 1 - i] = static_cast<uint8_t>(n >> (8 * i));
  key.bytes[0] = 0x5a;
  return key;
}

// The keys of a tier's LRU list, coldest first; also checks that the
// backward links agree with the forward ones.
std::vector<StoredKey> Order(const BlockIndex& index, Tier t) {
  std::vector<StoredKey> keys;
  const BlockEntry* prev = nullptr;
  for (const BlockEntry* e = index.order(t).Coldest(); e != nullptr; e = index.order(t).Hotter(e)) {
    EXPECT_EQ(index.order(t).Colder(e), prev) << "broken back link at " << e->key.ToHex();
    EXPECT_EQ(e->tier, t);
    keys.push_back(e->key);
    prev = e;
    if (keys.size() > 100000) {
      ADD_FAILURE() << "cycle in the LRU list";
      break;
    }
  }
  return keys;
}

std::vector<StoredKey> Keys(std::initializer_list<uint32_t> ns) {
  std::vector<StoredKey> keys;
  for (uint32_t n : ns) keys.push_back(K(n));
  return keys;
}

std::set<const BlockEntry*> Children(const BlockEntry* e) {
  std::set<const BlockEntry*> children;
  const BlockEntry* prev = nullptr;
  for (const BlockEntry* c = e->first_child; c != nullptr; c = c->next_sibling) {
    EXPECT_EQ(c->prev_sibling, prev);
    EXPECT_EQ(c->parent, e);
    children.insert(c);
    prev = c;
  }
  return children;
}

TEST(BlockIndexTest, TierNames) {
  EXPECT_STREQ(TierName(Tier::kHbm), "hbm");
  EXPECT_STREQ(TierName(Tier::kHost), "host");
  EXPECT_STREQ(TierName(Tier::kDisk), "disk");
}

TEST(BlockIndexTest, InsertFindErase) {
  BlockIndex index;
  EXPECT_EQ(index.Find(K(1)), nullptr);
  BlockEntry* e = index.Insert(K(1), Tier::kHost, nullptr);
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->key, K(1));
  EXPECT_EQ(e->tier, Tier::kHost);
  EXPECT_EQ(e->state, EntryState::kFilling);
  EXPECT_EQ(index.Find(K(1)), e);
  EXPECT_EQ(index.size(), 1u);
  index.Erase(e);
  EXPECT_EQ(index.Find(K(1)), nullptr);
  EXPECT_EQ(index.size(), 0u);
  EXPECT_EQ(index.order(Tier::kHost).Coldest(), nullptr);
  // The key can come back.
  EXPECT_NE(index.Insert(K(1), Tier::kHbm, nullptr), nullptr);
  EXPECT_EQ(Order(index, Tier::kHbm), Keys({1}));
}

// The lookup table through growth and heavy erase churn (tombstones), with
// counter-like keys: every Find agrees with a reference set.
TEST(BlockIndexTest, LookupTableAgreesWithAReferenceUnderChurn) {
  BlockIndex index;
  std::set<uint32_t> present;
  std::mt19937 rng(7);
  for (int step = 0; step < 40000; ++step) {
    const uint32_t n = rng() % 5000;
    if (present.count(n) != 0) {
      index.Erase(index.Find(K(n)));
      present.erase(n);
    } else {
      BlockEntry* e = index.Insert(K(n), Tier::kHost, nullptr);
      ASSERT_EQ(e->key, K(n));
      present.insert(n);
    }
    if (step % 4000 == 0) {
      for (uint32_t m = 0; m < 5000; ++m) {
        BlockEntry* e = index.Find(K(m));
        ASSERT_EQ(e != nullptr, present.count(m) != 0) << "key " << m << " at step " << step;
        if (e != nullptr) {
          ASSERT_EQ(e->key, K(m));
        }
      }
    }
  }
  EXPECT_EQ(index.size(), present.size());
  const std::vector<StoredKey> some = Keys({1, 2, 3, 4999});
  index.Prefetch(some);  // only a hint; must not disturb anything
  for (uint32_t m : {1u, 2u, 3u, 4999u}) EXPECT_EQ(index.Find(K(m)) != nullptr, present.count(m) != 0);
}

// Random inserts and erases (counter keys and random ones) through many
// growths of the lookup table and of the entry pool: after every batch
// (every few calls while the table migrates), each live key is found at the
// address Insert returned (entries never move), erased and never-inserted
// keys are not, and during a migration ForEach visits exactly the live set
// once.
TEST(BlockIndexTest, ModelHoldsAcrossTableGrowthMigrations) {
  BlockIndex index;
  std::mt19937_64 rng(11);
  std::unordered_map<StoredKey, BlockEntry*, Key128Hash> model;
  std::vector<StoredKey> keys, erased;
  uint32_t next = 0;
  int migrations = 0, checked_during_migration = 0;
  bool was_migrating = false;
  auto random_key = [&] {
    StoredKey k;
    for (auto& b : k.bytes) b = static_cast<uint8_t>(rng());
    return k;
  };
  auto check = [&](int step) {
    ASSERT_EQ(index.size(), model.size()) << "step " << step;
    for (const auto& [key, entry] : model) {
      ASSERT_EQ(index.Find(key), entry) << "step " << step;
      ASSERT_EQ(entry->key, key);
    }
    for (size_t i = erased.size() > 16 ? erased.size() - 16 : 0; i < erased.size(); ++i) {
      ASSERT_EQ(index.Find(erased[i]), nullptr) << "erased key found at step " << step;
    }
    for (int i = 0; i < 4; ++i) ASSERT_EQ(index.Find(random_key()), nullptr);
    if (index.table_stats().migrating) {
      ++checked_during_migration;
      std::set<const BlockEntry*> seen;
      index.ForEach([&](BlockEntry* e) {
        EXPECT_TRUE(seen.insert(e).second) << "visited twice at step " << step;
        auto it = model.find(e->key);
        EXPECT_TRUE(it != model.end() && it->second == e)
            << "visited a dead entry at step " << step;
      });
      ASSERT_EQ(seen.size(), model.size()) << "step " << step;
    }
  };
  for (int step = 0; step < 40000; ++step) {
    if (rng() % 3 != 0 || keys.empty()) {
      const StoredKey key = rng() % 2 ? K(next++) : random_key();
      BlockEntry* e = index.Insert(key, static_cast<Tier>(rng() % kNumTiers), nullptr);
      ASSERT_EQ(e->key, key);
      model[key] = e;
      keys.push_back(key);
    } else {
      const size_t i = rng() % keys.size();
      index.Erase(index.Find(keys[i]));
      model.erase(keys[i]);
      erased.push_back(keys[i]);
      keys[i] = keys.back();
      keys.pop_back();
    }
    const bool migrating = index.table_stats().migrating;
    if (migrating && !was_migrating) ++migrations;
    was_migrating = migrating;
    if (step % (migrating ? 53 : 997) == 0) {
      check(step);
      if (HasFatalFailure()) return;
    }
  }
  check(40000);
  EXPECT_GE(migrations, 6) << "the test should cross several growths";
  EXPECT_GE(checked_during_migration, 20);
}

// Erase leaves no tombstone behind: churn at a constant size never starts a
// growth and never touches the capacity; the pool reuses the freed entries.
TEST(BlockIndexTest, ChurnAtConstantSizeNeverRebuilds) {
  BlockIndex index;
  std::vector<uint32_t> live;
  uint32_t next = 0;
  for (; next < 3000; ++next) {
    index.Insert(K(next), Tier::kHost, nullptr);
    live.push_back(next);
  }
  std::mt19937 rng(12);
  auto churn = [&] {
    const size_t i = rng() % live.size();
    index.Erase(index.Find(K(live[i])));
    index.Insert(K(next), Tier::kHost, nullptr);
    live[i] = next++;
  };
  while (index.table_stats().migrating) churn();
  const size_t capacity = index.table_stats().capacity;
  for (int step = 0; step < 100000; ++step) {
    churn();
    ASSERT_FALSE(index.table_stats().migrating) << "step " << step;
  }
  EXPECT_EQ(index.table_stats().capacity, capacity);
  EXPECT_EQ(index.size(), live.size());
  for (uint32_t n : live) ASSERT_NE(index.Find(K(n)), nullptr);
  size_t seen = 0;
  index.ForEach([&](BlockEntry*) { ++seen; });
  EXPECT_EQ(seen, live.size());
}

// While the lookup table migrates, each Insert or Erase moves at most
// kMigrateSlotsPerCall slots of the old table and at least one.
TEST(BlockIndexTest, EachCallMigratesABoundedNumberOfSlots) {
  BlockIndex index;
  std::vector<uint32_t> live;
  std::mt19937 rng(13);
  uint32_t next = 0;
  int migrations = 0;
  for (int step = 0; step < 60000; ++step) {
    const OpenTableStats before = index.table_stats();
    if (rng() % 4 != 0 || live.empty()) {
      index.Insert(K(next), Tier::kHost, nullptr);
      live.push_back(next++);
    } else {
      const size_t i = rng() % live.size();
      index.Erase(index.Find(K(live[i])));
      live[i] = live.back();
      live.pop_back();
    }
    const OpenTableStats after = index.table_stats();
    if (tiers_test::ExpectBoundedMigrationStep(before, after)) {
      ++migrations;
      EXPECT_GE(after.capacity, before.capacity * 2 - 2) << "doubles";
    }
    if (HasFailure()) {
      ADD_FAILURE() << "at step " << step;
      return;
    }
  }
  EXPECT_GE(migrations, 6);
}

// Entries keep their addresses, and the links between them hold, while the
// pool adds chunks and the table migrates underneath.
TEST(BlockIndexTest, LinksSurviveGrowth) {
  BlockIndex index;
  BlockEntry* root = index.Insert(K(0), Tier::kHost, nullptr);
  std::vector<BlockEntry*> entries = {root};
  for (uint32_t n = 1; n < 20000; ++n) {
    const StoredKey parent = entries[n / 2]->key;
    entries.push_back(index.Insert(K(n), n % 2 ? Tier::kHost : Tier::kHbm, &parent));
  }
  for (uint32_t n = 0; n < entries.size(); ++n) {
    ASSERT_EQ(index.Find(K(n)), entries[n]);
    if (n > 0) {
      ASSERT_EQ(entries[n]->parent, entries[n / 2]);
    }
  }
  EXPECT_EQ(Order(index, Tier::kHost).size() + Order(index, Tier::kHbm).size(), entries.size());
}

TEST(BlockIndexTest, InsertIsHottestAndTouchMovesToHotEnd) {
  BlockIndex index;
  for (uint32_t n : {1, 2, 3, 4}) index.Insert(K(n), Tier::kHost, nullptr);
  EXPECT_EQ(Order(index, Tier::kHost), Keys({1, 2, 3, 4}));
  index.Touch(index.Find(K(1)));  // coldest
  EXPECT_EQ(Order(index, Tier::kHost), Keys({2, 3, 4, 1}));
  index.Touch(index.Find(K(3)));  // middle
  EXPECT_EQ(Order(index, Tier::kHost), Keys({2, 4, 1, 3}));
  index.Touch(index.Find(K(3)));  // already hottest
  EXPECT_EQ(Order(index, Tier::kHost), Keys({2, 4, 1, 3}));
  EXPECT_TRUE(Order(index, Tier::kHbm).empty());
  EXPECT_TRUE(Order(index, Tier::kDisk).empty());
}

TEST(BlockIndexTest, EraseKeepsTheListLinked) {
  BlockIndex index;
  for (uint32_t n : {1, 2, 3, 4, 5}) index.Insert(K(n), Tier::kHbm, nullptr);
  index.Erase(index.Find(K(3)));  // middle
  EXPECT_EQ(Order(index, Tier::kHbm), Keys({1, 2, 4, 5}));
  index.Erase(index.Find(K(1)));  // coldest
  EXPECT_EQ(Order(index, Tier::kHbm), Keys({2, 4, 5}));
  index.Erase(index.Find(K(5)));  // hottest
  EXPECT_EQ(Order(index, Tier::kHbm), Keys({2, 4}));
  index.Insert(K(6), Tier::kHbm, nullptr);
  EXPECT_EQ(Order(index, Tier::kHbm), Keys({2, 4, 6}));
}

TEST(BlockIndexTest, ParkedEntriesAreOutOfTheListsUntilUnparked) {
  BlockIndex index;
  BlockEntry* p = index.Insert(K(1), Tier::kHost, nullptr);
  for (uint32_t n : {2, 3, 4}) index.Insert(K(n), Tier::kHost, nullptr);
  BlockEntry* c = index.Insert(K(5), Tier::kHost, &p->key);
  index.Park(index.Find(K(2)));
  index.Park(index.Find(K(2)));  // twice is once
  EXPECT_EQ(Order(index, Tier::kHost), Keys({1, 3, 4, 5})) << "eviction never sees a parked entry";
  index.Touch(index.Find(K(2)));  // a hit while it moves leaves it out
  EXPECT_EQ(Order(index, Tier::kHost), Keys({1, 3, 4, 5}));
  // It changes tier while parked (a finished move), still out of the lists,
  // with its parent's counts right.
  index.Park(c);
  index.ChangeTier(c, Tier::kDisk);
  EXPECT_TRUE(Order(index, Tier::kDisk).empty());
  EXPECT_EQ(p->children_in_tier[static_cast<size_t>(Tier::kDisk)], 1u);
  EXPECT_EQ(p->children_in_tier[static_cast<size_t>(Tier::kHost)], 0u);
  index.Unpark(c, /*hot=*/true);
  EXPECT_EQ(Order(index, Tier::kDisk), Keys({5}));
  // Back at the cold end (a failed write, first in line again) or the hot end.
  index.Unpark(index.Find(K(2)), /*hot=*/false);
  EXPECT_EQ(Order(index, Tier::kHost), Keys({2, 1, 3, 4}));
  index.Park(index.Find(K(3)));
  index.Unpark(index.Find(K(3)), /*hot=*/true);
  EXPECT_EQ(Order(index, Tier::kHost), Keys({2, 1, 4, 3}));
  // Unparking what is not parked changes nothing; erasing a parked entry is safe.
  index.Unpark(index.Find(K(1)), /*hot=*/true);
  EXPECT_EQ(Order(index, Tier::kHost), Keys({2, 1, 4, 3}));
  index.Park(index.Find(K(4)));
  index.Erase(index.Find(K(4)));
  EXPECT_EQ(Order(index, Tier::kHost), Keys({2, 1, 3}));
  // Alone in a list: cold and hot are one end.
  BlockEntry* only = index.Insert(K(9), Tier::kHbm, nullptr);
  index.Park(only);
  EXPECT_TRUE(Order(index, Tier::kHbm).empty());
  index.Unpark(only, /*hot=*/false);
  EXPECT_EQ(Order(index, Tier::kHbm), Keys({9}));
}

TEST(BlockIndexTest, ChangeTierMovesListsAndParentCounts) {
  BlockIndex index;
  BlockEntry* p = index.Insert(K(1), Tier::kHost, nullptr);
  BlockEntry* c = index.Insert(K(2), Tier::kHost, &p->key);
  index.Insert(K(3), Tier::kHbm, nullptr);
  ASSERT_EQ(c->parent, p);
  EXPECT_EQ(p->children_in_tier[static_cast<size_t>(Tier::kHost)], 1u);
  EXPECT_TRUE(BlockIndex::HasChildrenAtOrAbove(p, Tier::kHost));
  EXPECT_FALSE(BlockIndex::HasChildrenAtOrAbove(p, Tier::kHbm));

  index.ChangeTier(c, Tier::kHbm);
  EXPECT_EQ(c->tier, Tier::kHbm);
  EXPECT_EQ(Order(index, Tier::kHost), Keys({1}));
  EXPECT_EQ(Order(index, Tier::kHbm), Keys({3, 2})) << "a moved entry is hottest in its new tier";
  EXPECT_EQ(p->children_in_tier[static_cast<size_t>(Tier::kHost)], 0u);
  EXPECT_EQ(p->children_in_tier[static_cast<size_t>(Tier::kHbm)], 1u);
  // A child above the parent's tier still holds the parent.
  EXPECT_TRUE(BlockIndex::HasChildrenAtOrAbove(p, Tier::kHost));
  EXPECT_TRUE(BlockIndex::HasChildrenAtOrAbove(p, Tier::kHbm));

  index.ChangeTier(c, Tier::kDisk);
  EXPECT_EQ(Order(index, Tier::kDisk), Keys({2}));
  EXPECT_EQ(Order(index, Tier::kHbm), Keys({3}));
  EXPECT_EQ(p->children_in_tier[static_cast<size_t>(Tier::kHbm)], 0u);
  EXPECT_EQ(p->children_in_tier[static_cast<size_t>(Tier::kDisk)], 1u);
  // A child below does not.
  EXPECT_FALSE(BlockIndex::HasChildrenAtOrAbove(p, Tier::kHost));
  EXPECT_TRUE(BlockIndex::HasChildrenAtOrAbove(p, Tier::kDisk));

  // Moving the parent leaves its own counts alone.
  index.ChangeTier(p, Tier::kDisk);
  EXPECT_EQ(p->children_in_tier[static_cast<size_t>(Tier::kDisk)], 1u);
  EXPECT_EQ(c->parent, p);
  EXPECT_EQ(Order(index, Tier::kDisk), Keys({2, 1}));
  EXPECT_TRUE(Order(index, Tier::kHost).empty());
}

TEST(BlockIndexTest, InsertLinksUnderAPresentParentOnly) {
  BlockIndex index;
  const StoredKey absent = K(99);
  BlockEntry* orphan = index.Insert(K(1), Tier::kHost, &absent);
  EXPECT_EQ(orphan->parent, nullptr);
  BlockEntry* p = index.Insert(K(2), Tier::kHost, nullptr);
  BlockEntry* a = index.Insert(K(3), Tier::kHost, &p->key);
  BlockEntry* b = index.Insert(K(4), Tier::kHbm, &p->key);
  EXPECT_EQ(Children(p), (std::set<const BlockEntry*>{a, b}));
  EXPECT_EQ(p->children_in_tier[static_cast<size_t>(Tier::kHost)], 1u);
  EXPECT_EQ(p->children_in_tier[static_cast<size_t>(Tier::kHbm)], 1u);
  EXPECT_EQ(orphan->first_child, nullptr);
}

TEST(BlockIndexTest, EraseOfAChildFixesTheParent) {
  BlockIndex index;
  BlockEntry* p = index.Insert(K(1), Tier::kHost, nullptr);
  BlockEntry* c1 = index.Insert(K(2), Tier::kHost, &p->key);
  BlockEntry* c2 = index.Insert(K(3), Tier::kHbm, &p->key);
  BlockEntry* c3 = index.Insert(K(4), Tier::kHost, &p->key);
  ASSERT_EQ(Children(p), (std::set<const BlockEntry*>{c1, c2, c3}));

  index.Erase(c2);  // whichever position it has in the sibling list
  EXPECT_EQ(Children(p), (std::set<const BlockEntry*>{c1, c3}));
  EXPECT_EQ(p->children_in_tier[static_cast<size_t>(Tier::kHbm)], 0u);
  EXPECT_EQ(p->children_in_tier[static_cast<size_t>(Tier::kHost)], 2u);
  EXPECT_FALSE(BlockIndex::HasChildrenAtOrAbove(p, Tier::kHbm));

  index.Erase(c3);
  EXPECT_EQ(Children(p), (std::set<const BlockEntry*>{c1}));
  index.Erase(c1);
  EXPECT_EQ(p->first_child, nullptr);
  EXPECT_EQ(p->children_in_tier[static_cast<size_t>(Tier::kHost)], 0u);
  EXPECT_FALSE(BlockIndex::HasChildrenAtOrAbove(p, Tier::kDisk));
}

TEST(BlockIndexTest, EraseOrphansTheChildren) {
  BlockIndex index;
  BlockEntry* g = index.Insert(K(1), Tier::kHost, nullptr);
  BlockEntry* p = index.Insert(K(2), Tier::kHost, &g->key);
  BlockEntry* c1 = index.Insert(K(3), Tier::kHost, &p->key);
  BlockEntry* c2 = index.Insert(K(4), Tier::kHost, &p->key);
  index.Erase(p);
  EXPECT_EQ(index.Find(K(2)), nullptr);
  for (BlockEntry* c : {c1, c2}) {
    EXPECT_EQ(c->parent, nullptr);
    EXPECT_EQ(c->prev_sibling, nullptr);
    EXPECT_EQ(c->next_sibling, nullptr);
  }
  EXPECT_EQ(g->first_child, nullptr);
  EXPECT_EQ(g->children_in_tier[static_cast<size_t>(Tier::kHost)], 0u);
  EXPECT_EQ(Order(index, Tier::kHost), Keys({1, 3, 4}));
  // Orphans can be erased and moved without touching the dead parent.
  index.ChangeTier(c1, Tier::kHbm);
  index.Erase(c2);
  EXPECT_EQ(Order(index, Tier::kHost), Keys({1}));
  EXPECT_EQ(Order(index, Tier::kHbm), Keys({3}));
}

TEST(BlockIndexTest, LeasesAreCounted) {
  BlockIndex index;
  BlockEntry* a = index.Insert(K(1), Tier::kHost, nullptr);
  BlockEntry* b = index.Insert(K(2), Tier::kHost, nullptr);
  index.AddLease(a);
  index.AddLease(a);
  index.AddLease(b);
  EXPECT_EQ(a->leases, 2u);
  EXPECT_EQ(index.total_leases(), 3u);
  index.ReleaseLease(a);
  index.ReleaseLease(b);
  EXPECT_EQ(index.total_leases(), 1u);
  EXPECT_EQ(b->leases, 0u);
  index.Erase(b);
  index.ReleaseLease(a);
  EXPECT_EQ(index.total_leases(), 0u);
}

TEST(BlockIndexDeathTest, EraseOfALeasedEntryAborts) {
  BlockIndex index;
  BlockEntry* a = index.Insert(K(1), Tier::kHost, nullptr);
  index.AddLease(a);
  EXPECT_DEATH(index.Erase(a), "CHECK failed");
}

TEST(BlockIndexDeathTest, DoubleInsertAborts) {
  BlockIndex index;
  index.Insert(K(1), Tier::kHost, nullptr);
  EXPECT_DEATH(index.Insert(K(1), Tier::kHost, nullptr), "CHECK failed");
}

TEST(BlockIndexDeathTest, ReleaseWithoutLeaseAborts) {
  BlockIndex index;
  BlockEntry* a = index.Insert(K(1), Tier::kHost, nullptr);
  EXPECT_DEATH(index.ReleaseLease(a), "CHECK failed");
}

TEST(BlockIndexTest, ForEachVisitsEveryEntry) {
  BlockIndex index;
  for (uint32_t n = 0; n < 50; ++n) index.Insert(K(n), n % 2 ? Tier::kHost : Tier::kHbm, nullptr);
  std::set<StoredKey> seen;
  index.ForEach([&](BlockEntry* e) { seen.insert(e->key); });
  EXPECT_EQ(seen.size(), 50u);
}

// Random inserts, touches, tier changes and erases against a plain model of
// the lists and the parent links.
TEST(BlockIndexTest, RandomOpsMatchAModel) {
  BlockIndex index;
  std::array<std::vector<StoredKey>, kNumTiers> lists;  // coldest first
  std::map<StoredKey, std::optional<StoredKey>> parent_of;
  std::map<StoredKey, Tier> tier_of;
  std::mt19937 rng(7);
  uint32_t next = 0;
  auto remove_from = [](std::vector<StoredKey>& v, const StoredKey& k) {
    v.erase(std::find(v.begin(), v.end(), k));
  };
  auto random_present = [&]() {
    auto it = tier_of.begin();
    std::advance(it, rng() % tier_of.size());
    return it->first;
  };
  for (int step = 0; step < 4000; ++step) {
    const uint32_t op = tier_of.empty() ? 0 : rng() % 4;
    if (op == 0) {
      const StoredKey key = K(next++);
      const Tier t = static_cast<Tier>(rng() % kNumTiers);
      std::optional<StoredKey> parent;
      if (!tier_of.empty() && rng() % 4 != 0) parent = random_present();
      index.Insert(key, t, parent ? &*parent : nullptr);
      lists[static_cast<size_t>(t)].push_back(key);
      parent_of[key] = parent;
      tier_of[key] = t;
    } else if (op == 1) {
      const StoredKey key = random_present();
      index.Touch(index.Find(key));
      auto& l = lists[static_cast<size_t>(tier_of[key])];
      remove_from(l, key);
      l.push_back(key);
    } else if (op == 2) {
      const StoredKey key = random_present();
      const Tier to = static_cast<Tier>(rng() % kNumTiers);
      index.ChangeTier(index.Find(key), to);
      remove_from(lists[static_cast<size_t>(tier_of[key])], key);
      lists[static_cast<size_t>(to)].push_back(key);
      tier_of[key] = to;
    } else {
      const StoredKey key = random_present();
      index.Erase(index.Find(key));
      remove_from(lists[static_cast<size_t>(tier_of[key])], key);
      tier_of.erase(key);
      parent_of.erase(key);
      for (auto& [k, p] : parent_of) {
        if (p == key) p.reset();
      }
    }
    // Parents that were erased after a child was linked are not parents any more.
    ASSERT_EQ(index.size(), tier_of.size());
    for (size_t t = 0; t < kNumTiers; ++t) {
      ASSERT_EQ(Order(index, static_cast<Tier>(t)), lists[t]) << "step " << step << " tier " << t;
    }
    if (step % 50 == 0 || step > 3950) {
      for (const auto& [key, tier] : tier_of) {
        const BlockEntry* e = index.Find(key);
        ASSERT_NE(e, nullptr);
        const std::optional<StoredKey>& p = parent_of[key];
        ASSERT_EQ(e->parent != nullptr, p.has_value()) << "step " << step;
        if (p) {
          ASSERT_EQ(e->parent->key, *p);
        }
        uint32_t counts[kNumTiers] = {};
        size_t n = 0;
        for (const auto& [k2, p2] : parent_of) {
          if (p2 == key) {
            ++counts[static_cast<size_t>(tier_of[k2])];
            ++n;
          }
        }
        for (size_t t = 0; t < kNumTiers; ++t) {
          ASSERT_EQ(e->children_in_tier[t], counts[t]) << "step " << step;
        }
        ASSERT_EQ(Children(e).size(), n);
      }
    }
  }
}

}  // namespace
}  // namespace kvtier
