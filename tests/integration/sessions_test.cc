// A session's ops against a real kvtierd: only ops really running count
// toward limits.max_inflight_ops_per_session; a client that never collects
// its results neither wedges its session nor grows the daemon (a bounded
// number of results is kept, and a Wait on a dropped one says so); and a
// timed Wait answered early, or whose session closes, leaves no deadline
// behind (Stats: timed_waits_pending).
//
// Requests are pipelined on a raw session while the daemon is stopped
// (SIGSTOP): once it continues, it reads them all in one wake-up, before
// any copy completion can reach its loop, so "still running" is certain,
// not a race.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>

#include <array>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "common/block_pattern.h"
#include "daemon/node_budget.h"
#include "kvtier/client.h"
#include "kvtier/shm_kv_cache.h"
#include "tests/integration/daemon_process.h"
#include "tests/integration/raw_session.h"
#include "tests/integration/stats_when.h"
#include "tests/integration/stopped_daemon.h"

namespace kvtier::testing {
namespace {

using ::testing::HasSubstr;

Layout SmallLayout() {
  return Layout::Create(LayoutSpec{.model_id = "kvtier/sessions",
                                   .num_layers = 2,
                                   .kv_kind = KvKind::kSeparateKv,
                                   .num_kv_heads = 2,
                                   .head_dim = 64,
                                   .dtype = DType::kBf16,
                                   .block_tokens = 16})
      .value();
}

std::unique_ptr<Client> MustConnect(const DaemonProcess& d) {
  Result<std::unique_ptr<Client>> c =
      Client::Connect({.socket_path = d.socket_path(), .client_name = "test"});
  EXPECT_TRUE(c.has_value()) << c.error() << "\n" << d.Log();
  return c ? std::move(*c) : nullptr;
}

uint64_t Counter(const DaemonStats& s, const std::string& name) {
  for (const auto& [n, v] : s.counters) {
    if (n == name) return v;
  }
  ADD_FAILURE() << "Stats has no counter " << name;
  return ~uint64_t{0};
}

// Stops the daemon (SIGTERM) and expects a clean exit: under the sanitizers
// an error or a leak in kvtierd shows here.
void ExpectCleanStop(DaemonProcess& d) {
  const int status = d.Stop();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "status " << status << "\n" << d.Log();
}

// Says Hello and registers `cache` on a raw session: namespace 1.
void HelloAndRegister(RawSession& raw, const ShmKvCache& cache) {
  raw.Hello();
  flatbuffers::FlatBufferBuilder b;
  std::vector<wire::Placement> placements;
  for (const Placement& p : cache.placements()) placements.push_back(ipc::PlacementToWire(p));
  std::vector<flatbuffers::Offset<wire::MemoryRegion>> regions = {
      wire::CreateMemoryRegion(b, wire::MemoryKind::HostMemfd, cache.size_bytes(), 0)};
  const int fd = cache.fd();
  ASSERT_TRUE(raw.Send(ipc::FinishMessage(b, 2,
                                          wire::CreateRegisterKvCacheDirect(
                                              b, ipc::LayoutToWire(b, cache.layout()),
                                              cache.num_blocks(), &regions, &placements)),
                       std::span(&fd, 1))
                  .ok());
  const RawSession::Reply r = raw.Receive();
  ASSERT_EQ(r.body, wire::Body::Registered) << r.message;
}

wire::Key RawKey(uint8_t tag, uint32_t i) {
  std::array<uint8_t, 16> bytes{};
  bytes[0] = tag;
  for (int k = 0; k < 4; ++k) bytes[1 + k] = static_cast<uint8_t>(i >> (8 * k));
  return wire::Key(flatbuffers::span<const uint8_t, 16>(bytes.data(), bytes.size()));
}

// A Load (`load`) or Store of one key into/out of engine block `block`, not waited for.
std::vector<uint8_t> OneBlockOp(uint64_t request, bool load, const wire::Key& key, uint32_t block) {
  flatbuffers::FlatBufferBuilder b;
  const std::vector<wire::Key> keys = {key};
  const std::vector<uint32_t> ids = {block};
  if (load) return ipc::FinishMessage(b, request, wire::CreateLoadDirect(b, 1, &keys, &ids, false));
  return ipc::FinishMessage(b, request, wire::CreateStoreDirect(b, 1, &keys, &ids, nullptr, false));
}

std::vector<uint8_t> WaitFor(uint64_t request, uint64_t op, uint32_t timeout_ms) {
  flatbuffers::FlatBufferBuilder b;
  return ipc::FinishMessage(b, request, wire::CreateWait(b, op, timeout_ms));
}

TEST(SessionsTest, OpsNeverWaitedForKeepBeingAcceptedAndKeepABoundedNumberOfResults) {
  constexpr uint32_t kLimit = 8;
  constexpr uint32_t kOps = 5 * kLimit;
  Result<DaemonProcess> d =
      DaemonProcess::Start({"limits.max_inflight_ops_per_session=" + std::to_string(kLimit)});
  ASSERT_TRUE(d.has_value()) << d.error();
  auto c = MustConnect(*d);
  ASSERT_NE(c, nullptr);
  ShmKvCache cache = ShmKvCache::Create(SmallLayout(), 16).value();
  const CacheId id = c->RegisterKvCache(cache).value();
  const std::vector<BlockKey> keys = c->ComputeKeys(id, PseudoTokens(3, kOps * 16)).value();
  std::vector<OpHandle> ops;
  for (uint32_t i = 0; i < kOps; ++i) {
    Result<OpHandle> op = c->StoreAsync(id, std::span(&keys[i], 1), std::vector<uint32_t>{i % 16});
    ASSERT_TRUE(op.has_value()) << "store " << i
                                << " of a session that never waits: " << op.error();
    ops.push_back(*op);
    // Each completes (its key is committed) before the next starts, so only
    // finished, never collected ops are left behind.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (c->Lookup(id, std::span(&keys[i], 1)).value().hits != 1) {
      ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "store " << i << " never completed";
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  EXPECT_EQ(StatsWhen(*c, [](const DaemonStats& s) { return s.inflight_ops == 0; }).inflight_ops,
            0u);
  // The newest kLimit results are kept; an older one was dropped, and a Wait
  // for it says so at once.
  Result<OpResult> dropped = c->Wait(ops[kOps - kLimit - 1], std::chrono::seconds(5));
  ASSERT_FALSE(dropped.has_value());
  EXPECT_EQ(dropped.error().code(), StatusCode::kNotFound);
  EXPECT_THAT(dropped.error().message(), HasSubstr("dropped")) << dropped.error();
  for (uint32_t i = kOps - kLimit; i < kOps; ++i) {
    Result<OpResult> r = c->Wait(ops[i], std::chrono::seconds(5));
    ASSERT_TRUE(r.has_value()) << "op " << i << ": " << r.error();
    EXPECT_EQ(r->blocks, 1u);
  }
  ExpectCleanStop(*d);
}

TEST(SessionsTest, OpsStillRunningAreBoundedAndFinishedOnesFreeTheirPlacesUnwaited) {
  constexpr uint32_t kLimit = 3;
  Result<DaemonProcess> d =
      DaemonProcess::Start({"limits.max_inflight_ops_per_session=" + std::to_string(kLimit)});
  ASSERT_TRUE(d.has_value()) << d.error();
  auto admin = MustConnect(*d);
  ASSERT_NE(admin, nullptr);
  ShmKvCache cache = ShmKvCache::Create(SmallLayout(), 16).value();
  RawSession raw(d->socket_path());
  ASSERT_NO_FATAL_FAILURE(HelloAndRegister(raw, cache));
  {
    Stopped stopped(*d);
    for (uint32_t i = 0; i <= kLimit; ++i)
      ASSERT_TRUE(raw.Send(OneBlockOp(10 + i, true, RawKey(1, i), i)).ok());
  }
  for (uint32_t i = 0; i < kLimit; ++i) {
    const RawSession::Reply r = raw.Receive();
    EXPECT_EQ(r.body, wire::Body::OpStarted) << "load " << i << ": " << r.message;
  }
  const RawSession::Reply over = raw.Receive();
  EXPECT_EQ(over.id, 10u + kLimit);
  EXPECT_EQ(over.code, StatusCode::kResourceExhausted) << over.message;
  // Once they are over, new ops are accepted although none was waited for.
  EXPECT_EQ(
      StatsWhen(*admin, [](const DaemonStats& s) { return s.inflight_ops == 0; }).inflight_ops, 0u);
  for (uint32_t i = 0; i < kLimit; ++i) {
    ASSERT_TRUE(raw.Send(OneBlockOp(20 + i, true, RawKey(1, i), i)).ok());
    const RawSession::Reply r = raw.Receive();
    EXPECT_EQ(r.body, wire::Body::OpStarted)
        << "load " << i << " after the others finished: " << r.message;
    EXPECT_EQ(
        StatsWhen(*admin, [](const DaemonStats& s) { return s.inflight_ops == 0; }).inflight_ops,
        0u);
  }
  ExpectCleanStop(*d);
}

// Ops in flight hold kvtierd's memory (NodeBudgets::kOpBytesPerKey a key)
// from the tenant's share of the node's: a tenant's sessions times
// limits.max_inflight_ops_per_session no longer add up past what the node
// holds. Here the share leaves room for 128 one-key ops beside the cache's
// mapping; of 200 sent at once, the rest are refused naming the node's
// memory, and once the ops are over their memory is given back. Before,
// all 200 started.
TEST(SessionsTest, OpsInFlightAreHeldToTheTenantsShareOfTheNodesMemory) {
  constexpr uint64_t kOps = 200, kRoomFor = 128;
  ShmKvCache cache = ShmKvCache::Create(SmallLayout(), 4).value();
  const uint64_t capacity = cache.size_bytes() + kRoomFor * NodeBudgets::kOpBytesPerKey;
  // The node's memory less kvtierd's reserve (its 64 MiB host tier and 1 GiB
  // of headroom) is the tenants' capacity; one tenant, all of it guaranteed.
  Result<DaemonProcess> d = DaemonProcess::Start(
      {"limits.node_memory_bytes=" + std::to_string((64ull << 20) + NodeBudgets::kMemoryHeadroom + capacity),
       "limits.node_guaranteed_fraction=1.0"});
  ASSERT_TRUE(d.has_value()) << d.error();
  auto admin = MustConnect(*d);
  ASSERT_NE(admin, nullptr);
  RawSession raw(d->socket_path());
  ASSERT_NO_FATAL_FAILURE(HelloAndRegister(raw, cache));
  {
    Stopped stopped(*d);
    for (uint32_t i = 0; i < kOps; ++i) ASSERT_TRUE(raw.Send(OneBlockOp(10 + i, true, RawKey(3, i), i % 4)).ok());
  }
  uint64_t started = 0, refused = 0;
  for (uint32_t i = 0; i < kOps; ++i) {
    const RawSession::Reply r = raw.Receive();
    if (r.body == wire::Body::OpStarted) {
      ++started;
      continue;
    }
    ++refused;
    EXPECT_EQ(r.code, StatusCode::kResourceExhausted) << r.message;
    EXPECT_THAT(r.message, HasSubstr("memory")) << r.message;
  }
  EXPECT_EQ(started, kRoomFor);
  EXPECT_EQ(refused, kOps - kRoomFor);
  // Over, they give their memory back: the mapping alone is left.
  const DaemonStats after = StatsWhen(*admin, [](const DaemonStats& s) { return s.inflight_ops == 0; });
  EXPECT_EQ(Counter(after, "node_memory_used"), cache.size_bytes());
  EXPECT_EQ(Counter(after, "node_memory_refused"), kOps - kRoomFor);
  ASSERT_TRUE(raw.Send(OneBlockOp(1000, true, RawKey(3, 0), 0)).ok());
  EXPECT_EQ(raw.Receive().body, wire::Body::OpStarted);
  ExpectCleanStop(*d);
}

TEST(SessionsTest, TimedWaitsAnsweredEarlyOrClosedLeaveNoDeadlineBehind) {
  constexpr uint32_t kPairs = 24;  // 48 messages: one wake-up reads them all
  Result<DaemonProcess> d = DaemonProcess::Start({});
  ASSERT_TRUE(d.has_value()) << d.error();
  auto admin = MustConnect(*d);
  ASSERT_NE(admin, nullptr);
  ShmKvCache cache = ShmKvCache::Create(SmallLayout(), kPairs + 1).value();
  RawSession raw(d->socket_path());
  ASSERT_NO_FATAL_FAILURE(HelloAndRegister(raw, cache));
  {
    Stopped stopped(*d);
    for (uint32_t i = 0; i < kPairs; ++i) {
      ASSERT_TRUE(raw.Send(OneBlockOp(10 + 2 * i, false, RawKey(2, i), i)).ok());
      // Op ids count from 1 within the session. A minute: far longer than the test.
      ASSERT_TRUE(raw.Send(WaitFor(11 + 2 * i, i + 1, 60000)).ok());
    }
  }
  // Every Wait was taken while its op was running: all OpStarted replies come
  // before any OpResult (a Wait of a finished op is answered at once).
  for (uint32_t i = 0; i < kPairs; ++i) {
    const RawSession::Reply r = raw.Receive();
    ASSERT_EQ(r.body, wire::Body::OpStarted) << "reply " << i << ": " << r.message;
  }
  for (uint32_t i = 0; i < kPairs; ++i) {
    const RawSession::Reply r = raw.Receive();
    ASSERT_EQ(r.body, wire::Body::OpResult) << r.message;
    EXPECT_TRUE(r.done);
    EXPECT_EQ(r.code, StatusCode::kOk) << r.message;
  }
  EXPECT_EQ(Counter(admin->Stats().value(), "timed_waits_pending"), 0u)
      << "answered Waits keep their deadlines until they pass";

  // A session closed with a timed Wait pending: its malformed message, read
  // in the same wake-up, ends it while the op still runs.
  RawSession gone(d->socket_path());
  ASSERT_NO_FATAL_FAILURE(HelloAndRegister(gone, cache));
  {
    Stopped stopped(*d);
    ASSERT_TRUE(gone.Send(OneBlockOp(10, false, RawKey(3, 0), kPairs)).ok());
    ASSERT_TRUE(gone.Send(WaitFor(11, 1, 60000)).ok());
    const std::vector<uint8_t> garbage = {1, 2, 3, 4};
    ASSERT_TRUE(gone.Send(garbage).ok());
  }
  EXPECT_EQ(gone.Receive().body, wire::Body::OpStarted);
  EXPECT_EQ(gone.Receive().body, wire::Body::Error);
  EXPECT_TRUE(gone.Receive().eof);
  const DaemonStats after = StatsWhen(*admin, [](const DaemonStats& s) { return s.sessions == 2; });
  EXPECT_EQ(after.sessions, 2u);
  EXPECT_EQ(Counter(after, "timed_waits_pending"), 0u)
      << "a closed session's Waits keep their deadlines";
  ExpectCleanStop(*d);
}

// The loop reads tenants in turn, then each tenant's sessions (issue 46): a
// request of one tenant waits behind at most one request of each other
// tenant, however many sessions those have. Deterministic: the daemon is
// stopped while 24 sessions of tenant a send their Hello, then the admin
// asks ListTenants, then 24 more of a's send theirs; once it continues it
// reads them all in one wake-up, and the reply says how many of a's Hellos
// were read first. Before, the loop read sessions in the order they became
// readable: all 24.
TEST(SessionsTest, OneTenantsManySessionsWaitTheirTurnBehindAnotherTenantsOne) {
  const std::string a_token(24, 'a'), ops_token(24, 'o');
  Result<DaemonProcess> d = DaemonProcess::Start(
      {"tenants=[{name: a, token: " + a_token + "}, {name: ops, token: " + ops_token + ", admin: true}]"});
  ASSERT_TRUE(d.has_value()) << d.error();
  Result<std::unique_ptr<Client>> watcher =
      Client::Connect({.socket_path = d->socket_path(), .token = ops_token, .client_name = "test"});
  ASSERT_TRUE(watcher.has_value()) << watcher.error();
  RawSession admin(d->socket_path());
  admin.Hello(ops_token);
  std::vector<std::unique_ptr<RawSession>> many;
  for (int i = 0; i < 48; ++i) many.push_back(std::make_unique<RawSession>(d->socket_path()));
  // Every connection accepted before the daemon stops: their Hellos are then
  // readable sessions, not connections still to accept.
  ASSERT_GE(StatsWhen(**watcher, [](const DaemonStats& s) { return s.sessions >= 50; }).sessions, 50u);
  {
    Stopped stopped(*d);
    for (int i = 0; i < 24; ++i) ASSERT_TRUE(many[i]->SendHello(a_token).ok());
    flatbuffers::FlatBufferBuilder b;
    ASSERT_TRUE(admin.Send(ipc::FinishMessage(b, 7, wire::CreateListTenants(b))).ok());
    for (int i = 24; i < 48; ++i) ASSERT_TRUE(many[i]->SendHello(a_token).ok());
  }
  const RawSession::Reply reply = admin.Receive();
  ASSERT_EQ(reply.body, wire::Body::TenantList);
  const wire::TenantList* list = ipc::VerifyMessage(reply.bytes).value()->body_as_TenantList();
  uint64_t a_sessions = ~uint64_t{0};
  for (const wire::TenantInfo* t : *list->tenants()) {
    if (t->name()->str() == "a") a_sessions = t->sessions();
  }
  EXPECT_LE(a_sessions, 1u) << "the admin's request waited behind this many of a's";
  for (auto& s : many) EXPECT_EQ(s->Receive().body, wire::Body::Welcome);
}

}  // namespace
}  // namespace kvtier::testing
