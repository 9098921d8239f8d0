// The crash test (ctest label `crash`): SIGKILL of kvtierd during heavy
// demotion, 20 times in a row. After each restart every block acknowledged
// as stored loads byte-exact or misses, no load ever returns other bytes, and
// the disk tier is warm: blocks that were on disk before the crash are hits.
#include <signal.h>
#include <unistd.h>

#include <random>
#include <thread>

#include <gtest/gtest.h>

#include "tests/integration/disk_helpers.h"

namespace kvtier::testing {
namespace {

TEST(DiskCrashTest, SigkillDuringHeavyDemotionTwentyTimes) {
  // 1 GiB of disk: more than the 20 cycles write (the writer stores at most
  // 1024 blocks a cycle, 20 MiB with record headers), so no region is
  // reclaimed and every block that reached disk must still be there.
  std::vector<std::string> sets = DiskSets("auto");
  sets.push_back("tiers.disk.bytes=1GiB");
  Result<DaemonProcess> d = DaemonProcess::Start(sets);
  ASSERT_TRUE(d.has_value()) << d.error();
  std::vector<BlockKey> acked;      // acknowledged as stored
  std::vector<BlockKey> on_disk;    // and seen on disk before a crash
  std::mt19937 rng(7);
  for (int cycle = 0; cycle < 20; ++cycle) {
    SCOPED_TRACE("cycle " + std::to_string(cycle));
    DiskSession s = Open(*d);
    ASSERT_NE(s.client, nullptr);

    // Everything acknowledged so far loads exactly or misses; what was on
    // disk before the crash is a hit.
    int hits = 0;
    for (const BlockKey& k : acked) {
      const int r = LoadOne(s, k);
      ASSERT_NE(r, -1) << "wrong bytes served after restart " << cycle;
      hits += r;
    }
    for (const BlockKey& k : on_disk) {
      ASSERT_EQ(LoadOne(s, k), 1) << "a block on disk before the crash misses";
    }
    if (cycle > 0) {
      EXPECT_GE(hits, static_cast<int>(on_disk.size()));
      const DaemonStats st = s.client->Stats().value();
      EXPECT_GE(st.Counter("disk_recovered_records"), on_disk.size());
    }

    // New blocks, flushed to disk.
    const std::vector<BlockKey> fresh = s.client->ComputeKeys(s.id, Prompt(1000 + static_cast<uint64_t>(cycle), 32)).value();
    const std::vector<BlockKey> ok = StoreAck(s, fresh);
    acked.insert(acked.end(), ok.begin(), ok.end());
    ASSERT_TRUE(s.client->Flush().has_value());
    ASSERT_TRUE(WaitOnDisk(s, ok)) << d->Log();
    on_disk.insert(on_disk.end(), ok.begin(), ok.end());

    // A writer keeps the host tier spilling to disk; the daemon dies mid-way.
    const std::string socket = d->socket_path();
    const uint64_t seed = static_cast<uint64_t>(cycle) << 32;
    const pid_t writer = ForkChild([socket, seed]() -> int {
      Result<std::unique_ptr<Client>> c = Client::Connect({.socket_path = socket, .client_name = "writer"});
      if (!c) return 1;
      auto cache = ShmKvCache::Create(SmallLayout(), 64);
      if (!cache) return 1;
      auto id = (*c)->RegisterKvCache(*cache);
      if (!id) return 1;
      for (uint64_t p = 0; p < 64; ++p) {
        auto keys = (*c)->ComputeKeys(*id, Prompt(seed | p, 16));
        if (!keys) return 0;
        std::vector<uint32_t> ids(16);
        for (uint32_t j = 0; j < 16; ++j) {
          ids[j] = j;
          FillFromKey((*keys)[j], cache->block(j));
        }
        if (!(*c)->Store(*id, *keys, ids)) return 0;  // the daemon is gone
      }
      ::pause();  // done writing; wait to be killed
      return 0;
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(50 + rng() % 150));
    d->Kill();
    ::kill(writer, SIGKILL);
    WaitChild(writer);
    ASSERT_TRUE(d->Restart().ok()) << d->Log();
  }
  // One last check after the 20th crash.
  DiskSession s = Open(*d);
  ASSERT_NE(s.client, nullptr);
  for (const BlockKey& k : on_disk) ASSERT_EQ(LoadOne(s, k), 1);
  const DaemonStats st = s.client->Stats().value();
  EXPECT_GE(st.Counter("disk_recovered_records"), on_disk.size());
}

}  // namespace
}  // namespace kvtier::testing
