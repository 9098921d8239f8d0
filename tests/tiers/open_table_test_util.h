// Test helper for the tables built on tiers/open_table.h (DiskOnlyIndex and
// BlockIndex's lookup table): the bound on the migration work of one call.
// Thread-compatible.
#pragma once

#include <gtest/gtest.h>

#include <cstddef>

#include "tiers/open_table.h"

namespace kvtier::tiers_test {

// Checks one Insert or Erase from its table's stats before and after it:
// while a growth migrates, the call moves at least one and at most
// kOpenTableMigrateSlotsPerCall slots of the old table and starts no other
// growth; a call that starts a growth moves at most that many too. Returns
// true when the call started a growth.
inline bool ExpectBoundedMigrationStep(const OpenTableStats& before, const OpenTableStats& after) {
  if (!before.migrating) {
    if (!after.migrating) return false;
    EXPECT_LE(after.slots_left_to_migrate, before.capacity);
    EXPECT_GE(after.slots_left_to_migrate + kOpenTableMigrateSlotsPerCall, before.capacity);
    return true;
  }
  const size_t moved =
      before.slots_left_to_migrate - (after.migrating ? after.slots_left_to_migrate : 0);
  EXPECT_LE(moved, kOpenTableMigrateSlotsPerCall);
  EXPECT_GT(moved, 0u) << "a migration must progress on every call";
  EXPECT_EQ(after.capacity, before.capacity) << "no growth during a migration";
  return false;
}

}  // namespace kvtier::tiers_test
