// The security model's promises (docs/security.md), against a real kvtierd:
// a tenant that is no admin cannot evict, flush, verify, list or probe
// another tenant's blocks through any call, and sees only its own share in
// Stats; a peer of another uid is refused unless configured; tokens must
// match exactly; and the per-tenant bound on sessions holds.
#include <gmock/gmock.h>
#include <grp.h>
#include <gtest/gtest.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <span>
#include <thread>
#include <optional>
#include <string>
#include <vector>

#include "common/block_pattern.h"
#include "common/kv_cache_layout.h"
#include "common/unique_fd.h"
#include "kvtier/client.h"
#include "kvtier/shm_kv_cache.h"
#include "tests/integration/daemon_process.h"

namespace kvtier::testing {
namespace {

std::string Tok(char c) { return std::string(24, c); }

#if defined(__has_feature)
#if __has_feature(thread_sanitizer)
constexpr bool kUnderTsan = true;
#else
constexpr bool kUnderTsan = false;
#endif
#else
constexpr bool kUnderTsan = false;
#endif

Layout SmallLayout() {
  return Layout::Create(LayoutSpec{.model_id = "kvtier/security", .num_layers = 2, .kv_kind = KvKind::kSeparateKv,
                                   .num_kv_heads = 2, .head_dim = 64, .dtype = DType::kBf16, .block_tokens = 16})
      .value();
}

std::unique_ptr<Client> Connect(const DaemonProcess& d, const std::string& token) {
  Result<std::unique_ptr<Client>> c = Client::Connect({.socket_path = d.socket_path(), .token = token});
  return c ? std::move(*c) : nullptr;
}

// A daemon with tenants a, b (with `b_extra` in its entry) and the admin
// ops, and a session of each; nullopt (with the failure added) if any of it
// did not start.
struct ThreeTenants {
  DaemonProcess daemon;
  std::unique_ptr<Client> a, b, ops;
};
std::optional<ThreeTenants> StartThreeTenants(const std::string& b_extra, std::vector<std::string> sets) {
  sets.insert(sets.begin(), "tenants=[{name: a, token: " + Tok('a') + "}, {name: b, token: " + Tok('b') + b_extra +
                                "}, {name: ops, token: " + Tok('o') + ", admin: true}]");
  Result<DaemonProcess> d = DaemonProcess::Start(std::move(sets));
  if (!d) {
    ADD_FAILURE() << d.error();
    return std::nullopt;
  }
  ThreeTenants t{std::move(*d), nullptr, nullptr, nullptr};
  t.a = Connect(t.daemon, Tok('a'));
  t.b = Connect(t.daemon, Tok('b'));
  t.ops = Connect(t.daemon, Tok('o'));
  if (!t.a || !t.b || !t.ops) {
    ADD_FAILURE() << "a tenant could not connect";
    return std::nullopt;
  }
  return t;
}

TEST(SecurityTest, NoTenantReachesAnotherTenantsBlocksUnlessAdmin) {
  std::optional<ThreeTenants> tenants =
      StartThreeTenants("", {"tiers.disk.enabled=true", "tiers.disk.bytes=32MiB", "tiers.disk.region_bytes=1MiB"});
  ASSERT_TRUE(tenants.has_value());
  auto& [d, a, b, ops] = *tenants;

  ShmKvCache cache = ShmKvCache::Create(SmallLayout(), 16).value();
  const CacheId ia = a->RegisterKvCache(cache).value();
  const CacheId ib = b->RegisterKvCache(cache).value();
  const std::vector<BlockKey> keys = a->ComputeKeys(ia, PseudoTokens(5, 4 * 16)).value();
  for (uint32_t i = 0; i < 4; ++i) FillFromKey(keys[i], cache.block(i));
  ASSERT_EQ(a->Store(ia, keys, std::vector<uint32_t>{0, 1, 2, 3}).value().blocks, 4u);

  auto denied = [](const auto& r) { return !r.has_value() && r.error().code() == StatusCode::kPermissionDenied; };
  // b cannot act on a's blocks, or on everyone's.
  EXPECT_TRUE(denied(b->Evict("a")));
  EXPECT_TRUE(denied(b->Evict("*")));
  EXPECT_TRUE(denied(b->Evict("a", BlockTier::kHost, SmallLayout().fingerprint())));
  EXPECT_TRUE(denied(b->ListNamespaces("a")));
  EXPECT_TRUE(denied(b->ListNamespaces("*")));
  EXPECT_TRUE(denied(b->ListTenants()));
  EXPECT_TRUE(denied(b->Flush()));
  EXPECT_TRUE(denied(b->VerifyDisk(true)));
  // ...cannot see them in its own listing, or probe them by key.
  EXPECT_TRUE(b->ListNamespaces().value().empty());
  EXPECT_EQ(b->Lookup(ib, keys).value().hits, 0u);
  EXPECT_EQ(b->Load(ib, keys, std::vector<uint32_t>{8, 9, 10, 11}).value().blocks, 0u);
  EXPECT_EQ(b->Prefetch(ib, keys).value(), 0u);
  // ...and its own evict leaves them alone.
  EXPECT_EQ(b->Evict().value(), 0u);
  EXPECT_EQ(b->Evict("", std::nullopt, SmallLayout().fingerprint()).value(), 0u);
  EXPECT_EQ(a->Lookup(ia, keys).value().hits, 4u);

  // a sees its own namespace; the admin sees a's and may act on them.
  const std::vector<NamespaceStats> own = a->ListNamespaces().value();
  ASSERT_EQ(own.size(), 1u);
  EXPECT_EQ(own[0].blocks, 4u);
  EXPECT_EQ(ops->ListNamespaces("a").value().size(), 1u);
  EXPECT_EQ(ops->ListNamespaces("*").value().size(), 1u);
  EXPECT_TRUE(ops->VerifyDisk(true).has_value());
  EXPECT_EQ(ops->Evict("a").value(), 4u);
  EXPECT_EQ(a->Lookup(ia, keys).value().hits, 0u);
  EXPECT_EQ(ops->Evict("nobody").error().code(), StatusCode::kNotFound);
}

// Stats tells a tenant only of itself: another tenant's stores, lookups and
// loads leave every figure it sees unchanged, while the admin sees the node.
TEST(SecurityTest, StatsShowATenantOnlyItsOwnShare) {
  std::optional<ThreeTenants> tenants = StartThreeTenants(", quotas: {host: 1MiB}", {"tiers.host.bytes=64MiB"});
  ASSERT_TRUE(tenants.has_value());
  auto& [d, a, b, ops] = *tenants;
  ShmKvCache cache = ShmKvCache::Create(SmallLayout(), 16).value();
  const CacheId ib = b->RegisterKvCache(cache).value();
  const DaemonStats b_before = b->Stats().value();
  EXPECT_EQ(b_before.scope, "tenant b");
  EXPECT_EQ(b_before.sessions, 1u);
  EXPECT_EQ(b_before.mappings, 1u);
  ASSERT_EQ(b_before.tiers.size(), 3u);
  EXPECT_EQ(b_before.tiers[1].capacity_bytes, 1u << 20);  // its quota, not the node's 64 MiB
  EXPECT_EQ(b_before.Counter("disk_io_errors"), 0u);      // node-wide counters are the admin's
  EXPECT_TRUE(std::none_of(b_before.counters.begin(), b_before.counters.end(), [](const auto& c) {
    return c.first == "sessions_refused" || c.first == "promotions";
  }));

  // a's traffic.
  const CacheId ia = a->RegisterKvCache(cache).value();
  const std::vector<BlockKey> keys = a->ComputeKeys(ia, PseudoTokens(9, 4 * 16)).value();
  for (uint32_t i = 0; i < 4; ++i) FillFromKey(keys[i], cache.block(i));
  ASSERT_EQ(a->Store(ia, keys, std::vector<uint32_t>{0, 1, 2, 3}).value().blocks, 4u);
  EXPECT_EQ(a->Lookup(ia, keys).value().hits, 4u);
  EXPECT_EQ(a->Load(ia, keys, std::vector<uint32_t>{4, 5, 6, 7}).value().blocks, 4u);

  const DaemonStats b_after = b->Stats().value();
  EXPECT_EQ(b_after.sessions, b_before.sessions);
  EXPECT_EQ(b_after.mappings, b_before.mappings);
  for (size_t t = 0; t < 3; ++t) {
    EXPECT_EQ(b_after.tiers[t].used_bytes, b_before.tiers[t].used_bytes) << "tier " << t;
    EXPECT_EQ(b_after.tiers[t].blocks, b_before.tiers[t].blocks) << "tier " << t;
  }
  EXPECT_EQ(b_after.counters, b_before.counters);

  const DaemonStats a_now = a->Stats().value();
  EXPECT_EQ(a_now.scope, "tenant a");
  EXPECT_EQ(a_now.tiers[1].blocks, 4u);
  EXPECT_EQ(a_now.tiers[1].capacity_bytes, 64u << 20);
  EXPECT_EQ(a_now.Counter("stores"), 4u);
  EXPECT_EQ(a_now.Counter("lookups"), 1u);
  EXPECT_EQ(a_now.Counter("hits_host"), 4u);
  EXPECT_EQ(a_now.Counter("loads"), 4u);
  EXPECT_EQ(a_now.leases, 0u);

  // b's own traffic shows in b's figures only.
  const std::vector<BlockKey> bkeys = b->ComputeKeys(ib, PseudoTokens(10, 2 * 16)).value();
  ASSERT_EQ(b->Store(ib, bkeys, std::vector<uint32_t>{0, 1}).value().blocks, 2u);
  EXPECT_EQ(b->Lookup(ib, keys).value().hits, 0u);
  const DaemonStats b_own = b->Stats().value();
  EXPECT_EQ(b_own.tiers[1].blocks, 2u);
  EXPECT_EQ(b_own.Counter("stores"), 2u);
  EXPECT_EQ(b_own.Counter("misses"), 4u);
  EXPECT_EQ(a->Stats().value().Counter("misses"), 0u);

  const DaemonStats node = ops->Stats().value();
  EXPECT_EQ(node.scope, "node");
  EXPECT_EQ(node.sessions, 3u);
  EXPECT_EQ(node.tiers[1].blocks, 6u);
  EXPECT_EQ(node.tiers[1].capacity_bytes, 64u << 20);
  EXPECT_EQ(node.Counter("stores"), 6u);
  EXPECT_EQ(node.Counter("lookups"), 2u);
}

// A real peer of another uid (a child process that drops to nobody): the
// socket's mode keeps it out; with the socket open to everyone, its peer
// credentials do; configured as a tenant of its own, it is that tenant and
// sees only its own share.
TEST(SecurityTest, APeerOfAnotherUidIsRefusedUnlessConfigured) {
  if (::geteuid() != 0) GTEST_SKIP() << "acting as another uid needs root (CI runs as root)";
  constexpr uint32_t kNobody = 65534;
  // What a client running as nobody gets: 0 = connected (and, in `scope`,
  // what its Stats said), else the StatusCode of the refusal.
  auto connect_as_nobody = [](const DaemonProcess& d, std::string* scope) {
    int out[2];
    EXPECT_EQ(::pipe(out), 0);
    const pid_t pid = ForkChild([&] {
      ::close(out[0]);
      if (::setgroups(0, nullptr) != 0 || ::setgid(kNobody) != 0 || ::setuid(kNobody) != 0)
        return 100;
      Result<std::unique_ptr<Client>> c = Client::Connect({.socket_path = d.socket_path()});
      if (!c) return static_cast<int>(c.error().code());
      Result<DaemonStats> st = (*c)->Stats();
      if (!st) return 101;
      const std::string said = st->scope;
      if (::write(out[1], said.data(), said.size()) != static_cast<ssize_t>(said.size()))
        return 102;
      return 0;
    });
    ::close(out[1]);
    char buf[256];
    const ssize_t n = ::read(out[0], buf, sizeof(buf));
    ::close(out[0]);
    if (n > 0) scope->assign(buf, static_cast<size_t>(n));
    return WaitChild(pid);
  };
  std::string scope;
  const std::string root_only = "tenants=[{name: local, uid: 0, admin: true}]";
  {
    Result<DaemonProcess> d = DaemonProcess::Start({root_only});  // socket mode 0660, owned by root
    ASSERT_TRUE(d.has_value()) << d.error();
    ASSERT_EQ(::chmod(d->dir().c_str(), 0755), 0);  // so that only the socket's own mode decides
    EXPECT_EQ(connect_as_nobody(*d, &scope), static_cast<int>(StatusCode::kPermissionDenied));
  }
  {
    Result<DaemonProcess> d = DaemonProcess::Start({root_only, "socket.mode=0666"});
    ASSERT_TRUE(d.has_value()) << d.error();
    ASSERT_EQ(::chmod(d->dir().c_str(), 0755), 0);
    EXPECT_EQ(connect_as_nobody(*d, &scope), static_cast<int>(StatusCode::kUnauthenticated));
    EXPECT_NE(Connect(*d, ""), nullptr) << "root, the configured uid, still gets in";
  }
  {
    Result<DaemonProcess> d =
        DaemonProcess::Start({"tenants=[{name: local, uid: 0, admin: true}, {name: guest, uid: " +
                                  std::to_string(kNobody) + "}]",
                              "socket.mode=0666"});
    ASSERT_TRUE(d.has_value()) << d.error();
    ASSERT_EQ(::chmod(d->dir().c_str(), 0755), 0);
    EXPECT_EQ(connect_as_nobody(*d, &scope), 0);
    EXPECT_EQ(scope, "tenant guest");
  }
}

TEST(SecurityTest, TokensMustMatchExactly) {
  Result<DaemonProcess> d = DaemonProcess::Start({"tenants=[{name: a, token: " + Tok('a') + "}]"});
  ASSERT_TRUE(d.has_value()) << d.error();
  EXPECT_NE(Connect(*d, Tok('a')), nullptr);
  for (const std::string& wrong : {Tok('b'), Tok('a') + "a", Tok('a').substr(1), std::string(Tok('a')).replace(23, 1, "b"),
                                   std::string()}) {
    Result<std::unique_ptr<Client>> c = Client::Connect({.socket_path = d->socket_path(), .token = wrong});
    ASSERT_FALSE(c.has_value()) << "token '" << wrong << "' was accepted";
    EXPECT_EQ(c.error().code(), StatusCode::kUnauthenticated);
    EXPECT_THAT(c.error().message(), ::testing::Not(::testing::HasSubstr(Tok('a'))));
  }
}

// The bound on ops per session: sessions_test.cc (it needs ops that are
// certainly still running, which takes pipelined requests).
TEST(SecurityTest, SessionsPerTenantAreBounded) {
  Result<DaemonProcess> d = DaemonProcess::Start(
      {"tenants=[{name: a, token: " + Tok('a') + "}]", "limits.max_sessions_per_tenant=2"});
  ASSERT_TRUE(d.has_value()) << d.error();
  auto first = Connect(*d, Tok('a'));
  auto second = Connect(*d, Tok('a'));
  ASSERT_TRUE(first && second);
  Result<std::unique_ptr<Client>> third = Client::Connect({.socket_path = d->socket_path(), .token = Tok('a')});
  ASSERT_FALSE(third.has_value()) << "a third session of a tenant limited to two";
  EXPECT_EQ(third.error().code(), StatusCode::kResourceExhausted);
  // The others were never affected.
  EXPECT_TRUE(first->Stats().has_value());
  EXPECT_TRUE(second->Stats().has_value());
}

Layout LayoutOfModel(const std::string& model) {
  return Layout::Create(LayoutSpec{.model_id = model, .num_layers = 2, .kv_kind = KvKind::kSeparateKv,
                                   .num_kv_heads = 2, .head_dim = 64, .dtype = DType::kBf16, .block_tokens = 16})
      .value();
}

// A sealed memfd of `bytes` (a hole: no memory behind it).
UniqueFd SparseMemfd(uint64_t bytes) {
  UniqueFd fd(::memfd_create("kvtier-security-test", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  EXPECT_TRUE(fd.valid());
  EXPECT_EQ(::ftruncate(fd.get(), static_cast<off_t>(bytes)), 0);
  EXPECT_EQ(::fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK), 0);
  return fd;
}

// One tenant cannot use up kvtierd's memory maps (Linux allows a process
// vm.max_map_count of them, 65,530 by default) nor map without bound: each
// tenant has limits.max_mappings_per_tenant and max_mapped_bytes_per_tenant,
// given back when its sessions end. A memfd is mapped only as far as the
// cache's placements reach. Before, about 70 sessions of one tenant took the
// daemon to its map limit, and every other tenant's registration failed.
TEST(SecurityTest, MapsAndMappedBytesPerTenantAreBounded) {
  Result<DaemonProcess> d = DaemonProcess::Start(
      {"tenants=[{name: a, token: " + Tok('a') + "}, {name: b, token: " + Tok('b') + "}]",
       "limits.max_mappings_per_tenant=8", "limits.max_mapped_bytes_per_tenant=64MiB"});
  ASSERT_TRUE(d.has_value()) << d.error();
  const Layout layout = LayoutOfModel("kvtier/maps");  // 16 KiB blocks
  std::vector<ShmKvCache> caches;
  for (int i = 0; i < 10; ++i) caches.push_back(ShmKvCache::Create(layout, 4).value());

  // Tenant a, over two sessions: each cache maps its region and its fence
  // page (two maps), so four fit in 8, not five.
  auto a1 = Connect(*d, Tok('a'));
  auto a2 = Connect(*d, Tok('a'));
  ASSERT_TRUE(a1 && a2);
  size_t registered = 0;
  Result<CacheId> refused = Err(Status(StatusCode::kInternal, "never refused"));
  for (; registered < 8; ++registered) {
    refused = (registered % 2 == 0 ? a1 : a2)->RegisterKvCache(caches[registered]);
    if (!refused) break;
  }
  EXPECT_EQ(registered, 4u);
  ASSERT_FALSE(refused.has_value());
  EXPECT_EQ(refused.error().code(), StatusCode::kResourceExhausted);
  EXPECT_THAT(refused.error().message(), ::testing::HasSubstr("limits.max_mappings_per_tenant"));
  // Tenant b is not held back by a.
  auto b = Connect(*d, Tok('b'));
  ASSERT_TRUE(b);
  ASSERT_TRUE(b->RegisterKvCache(caches[9]).has_value());
  // a's maps come back when its session ends.
  a1.reset();
  Result<CacheId> again = Err(Status(StatusCode::kInternal, "not tried"));
  for (int i = 0; i < 100 && !again.has_value(); ++i) {
    again = a2->RegisterKvCache(caches[8]);
    if (!again) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_TRUE(again.has_value()) << again.error();

  // Bytes: a 1 GiB memfd whose cache uses 16 MiB is mapped (and charged) as
  // 16 MiB; one that needs 56 MiB more is past b's 64 MiB.
  const UniqueFd big = SparseMemfd(1ull << 30);
  Result<CacheId> small_use =
      b->RegisterKvCache(layout, 1024, KvCacheLayout::Contiguous(layout), {KvRegion{big.get(), 1ull << 30}});
  ASSERT_TRUE(small_use.has_value()) << small_use.error();
  const UniqueFd other = SparseMemfd(1ull << 30);
  Result<CacheId> past =
      b->RegisterKvCache(layout, 3584, KvCacheLayout::Contiguous(layout), {KvRegion{other.get(), 1ull << 30}});
  ASSERT_FALSE(past.has_value());
  EXPECT_EQ(past.error().code(), StatusCode::kResourceExhausted);
  EXPECT_THAT(past.error().message(), ::testing::HasSubstr("limits.max_mapped_bytes_per_tenant"));
  EXPECT_TRUE(b->Stats().has_value()) << "the refusals closed nothing";
}

// `count` tenants t0, t1, ... with tokens, and the admin ops: a tenants=
// setting.
std::string ManyTenants(int count) {
  std::string list = "tenants=[";
  for (int i = 0; i < count; ++i) {
    list += "{name: t" + std::to_string(i) + ", token: " + Tok(static_cast<char>('A' + i)) + "}, ";
  }
  return list + "{name: ops, token: " + Tok('o') + ", admin: true}]";
}

// A tenant that used nothing yet registers a cache, stores 4 blocks and
// loads them back byte for byte, on a session of its own.
void RegistersStoresAndLoads(const DaemonProcess& d, const std::string& token) {
  std::unique_ptr<Client> c = Connect(d, token);
  ASSERT_TRUE(c) << "it could not connect\n" << d.Log();
  ShmKvCache cache = ShmKvCache::Create(SmallLayout(), 8).value();
  Result<CacheId> id = c->RegisterKvCache(cache);
  ASSERT_TRUE(id.has_value()) << id.error();
  const std::vector<BlockKey> keys = c->ComputeKeys(*id, PseudoTokens(46, 4 * 16)).value();
  std::vector<std::vector<uint8_t>> stored;
  for (uint32_t i = 0; i < 4; ++i) {
    FillFromKey(keys[i], cache.block(i));
    stored.emplace_back(cache.block(i).begin(), cache.block(i).end());
  }
  Result<OpResult> st = c->Store(*id, keys, std::vector<uint32_t>{0, 1, 2, 3});
  ASSERT_TRUE(st.has_value()) << st.error();
  ASSERT_EQ(st->blocks, 4u);
  Result<OpResult> ld = c->Load(*id, keys, std::vector<uint32_t>{4, 5, 6, 7});
  ASSERT_TRUE(ld.has_value()) << ld.error();
  ASSERT_EQ(ld->blocks, 4u);
  for (uint32_t i = 0; i < 4; ++i) {
    EXPECT_TRUE(std::equal(stored[i].begin(), stored[i].end(), cache.block(4 + i).begin())) << "block " << i;
  }
}

// Tenants each within limits.max_mappings_per_tenant (4,096) but together
// past Linux's vm.max_map_count for the whole daemon (65,530): each gets its
// guaranteed share of the node's maps and borrows only from what no tenant
// is guaranteed, so the tenant that comes last still registers, stores and
// loads. The refusals name the node's limit, are counted, and are logged
// once. Before, the 16th tenant's registrations failed with "mmap: Cannot
// allocate memory", then every other tenant's, with nothing logged.
TEST(SecurityTest, TenantsAtTheirOwnMapLimitsLeaveEveryOtherTenantItsShareOfTheNode) {
  constexpr int kGreedy = 18;
  Result<DaemonProcess> d = DaemonProcess::Start({ManyTenants(kGreedy + 1)});
  ASSERT_TRUE(d.has_value()) << d.error();
  // A cache of 14 layers, one region each, and its fence page: 15 maps per
  // registration, 64 registrations per session.
  const Layout layout = Layout::Create(LayoutSpec{.model_id = "kvtier/node-maps", .num_layers = 14,
                                                  .kv_kind = KvKind::kSeparateKv, .num_kv_heads = 2,
                                                  .head_dim = 64, .dtype = DType::kBf16, .block_tokens = 16})
                            .value();
  std::vector<UniqueFd> memfds;
  std::vector<KvRegion> regions;
  for (int i = 0; i < 14; ++i) {
    memfds.push_back(SparseMemfd(64 << 10));
    regions.push_back(KvRegion{memfds.back().get(), 64 << 10});
  }
  // Each tenant in a process of its own (a client holds a descriptor for
  // each region it registered), one after another: it registers until it
  // is refused, reports how many and why, and keeps them until killed.
  struct Children {
    std::vector<pid_t> pids;
    ~Children() {
      for (pid_t pid : pids) {
        ::kill(pid, SIGKILL);
        WaitChild(pid);
      }
    }
  } greedy;
  std::vector<std::pair<size_t, std::string>> results;  // registered, why it stopped
  for (int t = 0; t < kGreedy; ++t) {
    int out[2];
    ASSERT_EQ(::pipe(out), 0);
    const std::string token = Tok(static_cast<char>('A' + t));
    greedy.pids.push_back(ForkChild([&] {
      ::close(out[0]);
      rlimit files{};
      ::getrlimit(RLIMIT_NOFILE, &files);
      files.rlim_cur = files.rlim_max;
      ::setrlimit(RLIMIT_NOFILE, &files);
      std::vector<std::unique_ptr<Client>> sessions;
      size_t registered = 0;
      std::string why;
      while (why.empty()) {
        if (registered % 64 == 0) sessions.push_back(Connect(*d, token));
        if (!sessions.back()) {
          why = "could not connect";
          break;
        }
        Result<CacheId> id = sessions.back()->RegisterKvCache(layout, 1, KvCacheLayout::VllmNhd(layout, 1), regions);
        if (id) {
          ++registered;
        } else {
          why = id.error().ToString();
        }
      }
      const std::string report = std::to_string(registered) + " " + why;
      if (::write(out[1], report.data(), report.size()) != static_cast<ssize_t>(report.size())) return 1;
      ::close(out[1]);
      while (true) ::pause();
    }));
    ::close(out[1]);
    std::string report;
    char buf[512];
    for (ssize_t n; (n = ::read(out[0], buf, sizeof(buf))) > 0;) report.append(buf, static_cast<size_t>(n));
    ::close(out[0]);
    const size_t space = report.find(' ');
    ASSERT_NE(space, std::string::npos) << "t" << t << " reported nothing";
    results.emplace_back(std::stoul(report.substr(0, space)), report.substr(space + 1));
  }
  std::unique_ptr<Client> ops = Connect(*d, Tok('o'));
  ASSERT_TRUE(ops);
  const uint64_t share = ops->Stats().value().Counter("node_maps_share");
  EXPECT_LT(share, 4096u) << "the tenants' limits add up past the node's: each is guaranteed less than its limit";
  size_t node_refusals = 0;
  for (size_t t = 0; t < results.size(); ++t) {
    const auto& [registered, why] = results[t];
    EXPECT_GE(registered, share / 15) << "t" << t << " got less than its guaranteed share: " << why;
    EXPECT_THAT(why, ::testing::StartsWith("ResourceExhausted")) << "t" << t;
    if (why.find("vm.max_map_count") != std::string::npos) ++node_refusals;
  }
  EXPECT_GT(node_refusals, 0u) << "the tenants' limits add up past the node's, yet none was held to it";

  // The last tenant, which used nothing, is not held back by the others.
  RegistersStoresAndLoads(*d, Tok(static_cast<char>('A' + kGreedy)));

  const DaemonStats node = ops->Stats().value();
  EXPECT_EQ(node.Counter("node_maps_refused"), node_refusals);
  EXPECT_EQ(node.Counter("node_budget_warnings"), 1u) << "refusals are logged at most once a minute";
  EXPECT_NE(d->Log().find("node limit vm.max_map_count"), std::string::npos) << d->Log();
}

// Tenants each within limits.max_sessions_per_tenant but together past
// kvtierd's descriptors (RLIMIT_NOFILE): the same shares. A tenant that
// opens sessions until it is refused leaves another its share. Before, the
// daemon ran out of descriptors, paused accepting, and no tenant could
// connect.
TEST(SecurityTest, TenantsAtTheirOwnSessionLimitsLeaveEveryOtherTenantItsShareOfDescriptors) {
  constexpr uint64_t kOpenFiles = 1400;
  rlimit own{};
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &own), 0);
  if (own.rlim_max != RLIM_INFINITY && own.rlim_max < 2 * kOpenFiles) {
    GTEST_SKIP() << "this process may open only " << own.rlim_max << " descriptors";
  }
  own.rlim_cur = own.rlim_max;
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &own), 0);
  Result<DaemonProcess> d =
      DaemonProcess::Start({ManyTenants(3), "limits.max_sessions_per_tenant=1024"}, "", "", kOpenFiles);
  ASSERT_TRUE(d.has_value()) << d.error();
  std::vector<std::unique_ptr<Client>> held;
  std::vector<Status> refusals;
  for (char t : {'A', 'B'}) {
    while (held.size() < 2 * kOpenFiles) {
      Result<std::unique_ptr<Client>> c = Client::Connect(
          {.socket_path = d->socket_path(), .token = Tok(t), .call_timeout = std::chrono::seconds(10)});
      if (!c) {
        refusals.push_back(c.error());
        break;
      }
      held.push_back(std::move(*c));
    }
  }
  ASSERT_EQ(refusals.size(), 2u) << "neither tenant was refused a session";
  for (const Status& r : refusals) {
    EXPECT_EQ(r.code(), StatusCode::kResourceExhausted) << r;
    EXPECT_THAT(r.message(), ::testing::HasSubstr("RLIMIT_NOFILE")) << r;
  }
  // t2 connects, and does its work, on the daemon's last descriptors.
  RegistersStoresAndLoads(*d, Tok('C'));
  std::unique_ptr<Client> ops = Connect(*d, Tok('o'));
  ASSERT_TRUE(ops);
  EXPECT_EQ(ops->Stats().value().Counter("node_sessions_refused"), 2u);
}

// A tenant that loops `kvtierctl namespaces` or `kvtierctl evict` is held to
// limits.bulk_calls_per_second (an admin is not), and one that stores under
// ever new layouts to limits.max_namespaces_per_tenant, with errors that
// name the limit; the other tenants are not held back by either.
TEST(SecurityTest, BulkCallsAreRateLimitedAndLayoutsPerTenantBounded) {
  std::optional<ThreeTenants> tenants = StartThreeTenants(
      "", {"limits.bulk_calls_per_second=5", "limits.max_namespaces_per_tenant=2"});
  ASSERT_TRUE(tenants.has_value());
  auto& [d, a, b, ops] = *tenants;

  uint64_t served = 0;
  std::optional<Status> refusal;
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < 40; ++i) {
    Result<std::vector<NamespaceStats>> r = i % 2 ? b->ListNamespaces() : b->Evict().transform([](uint64_t) {
      return std::vector<NamespaceStats>{};
    });
    if (r) {
      ++served;
    } else {
      ASSERT_EQ(r.error().code(), StatusCode::kResourceExhausted) << r.error();
      refusal = r.error();
    }
  }
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LE(served, static_cast<uint64_t>(5 + 5 * elapsed + 1)) << "a second's worth, then 5 a second";
  EXPECT_GE(served, 5u);
  ASSERT_TRUE(refusal.has_value()) << "40 calls in " << elapsed << " s were all served";
  EXPECT_THAT(refusal->message(), ::testing::HasSubstr("limits.bulk_calls_per_second")) << *refusal;
  for (int i = 0; i < 40; ++i) ASSERT_TRUE(ops->ListNamespaces("*").has_value()) << "admins are not limited";
  EXPECT_TRUE(a->ListNamespaces().has_value()) << "another tenant has its own allowance";

  // Layouts: a holds blocks under two; a third is refused, b may use it.
  std::vector<ShmKvCache> caches;
  std::vector<CacheId> ids;
  for (int m = 0; m < 3; ++m) {
    caches.push_back(ShmKvCache::Create(LayoutOfModel("kvtier/model-" + std::to_string(m)), 4).value());
    ids.push_back(a->RegisterKvCache(caches.back()).value());
  }
  auto store = [&](Client& c, CacheId id, uint64_t seed) {
    const std::vector<BlockKey> keys = c.ComputeKeys(id, PseudoTokens(seed, 16)).value();
    return c.Store(id, keys, std::vector<uint32_t>{0});
  };
  ASSERT_EQ(store(*a, ids[0], 1).value().blocks, 1u);
  ASSERT_EQ(store(*a, ids[1], 2).value().blocks, 1u);
  Result<OpResult> third = store(*a, ids[2], 3);
  ASSERT_FALSE(third.has_value()) << "a third layout of a tenant bound to two";
  EXPECT_EQ(third.error().code(), StatusCode::kResourceExhausted);
  EXPECT_THAT(third.error().message(), ::testing::HasSubstr("limits.max_namespaces_per_tenant"));
  const CacheId b_third = b->RegisterKvCache(caches[2]).value();
  EXPECT_EQ(store(*b, b_third, 4).value().blocks, 1u) << "b is not held back by a's layouts";
  EXPECT_EQ(a->ListNamespaces().value().size(), 2u);
  // Once one of a's layouts holds nothing, a third one is fine.
  EXPECT_EQ(ops->Evict("a", std::nullopt, LayoutOfModel("kvtier/model-0").fingerprint()).value(), 1u);
  EXPECT_EQ(store(*a, ids[2], 3).value().blocks, 1u);
  const std::vector<NamespaceStats> listed = ops->ListNamespaces("*").value();
  EXPECT_EQ(listed.size(), 2u) << "model-1 (a) and model-2 (a and b); model-0 holds nothing";
  for (const NamespaceStats& ns : listed) EXPECT_THAT(ns.description, ::testing::HasSubstr("kvtier/model-"));
}

// The victim's prompt lookups (128 keys) for `seconds` while `abuse`, if
// set, loops on another thread: their p99, in microseconds.
double LookupP99WhileAbused(Client& victim, CacheId id, std::span<const BlockKey> keys,
                            const std::function<void()>& abuse) {
  std::atomic<bool> stop{false};
  std::thread abuser;
  if (abuse) {
    abuser = std::thread([&] {
      while (!stop.load()) abuse();
    });
  }
  std::vector<double> us;
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(1);
  while (std::chrono::steady_clock::now() < end) {
    const auto t0 = std::chrono::steady_clock::now();
    Result<LookupResult> r = victim.Lookup(id, keys);
    us.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
    EXPECT_TRUE(r.has_value() && r->hits == keys.size());
  }
  stop = true;
  if (abuser.joinable()) abuser.join();
  std::sort(us.begin(), us.end());
  return us[us.size() * 99 / 100];
}

// Another tenant looping `kvtierctl namespaces` or `kvtierctl evict` (or an
// admin looping `kvtierctl namespaces --tenant '*'`) does not hold up a
// tenant's lookups: no such call walks the cache on the event loop. Before,
// each walked every block (64Ki here), and the victim's p99 went from tens
// of microseconds to tens of milliseconds. (kvtier-bench abuse measures it.)
TEST(SecurityTest, AnotherTenantsLookupLatencyHoldsWhileOneLoopsNamespacesAndEvict) {
  std::optional<ThreeTenants> tenants = StartThreeTenants(
      "", {"tiers.host.bytes=320MiB", "policy.watermarks.host={high: 1.0, low: 0.99}"});
  ASSERT_TRUE(tenants.has_value());
  auto& a = tenants->a;
  const Layout small = Layout::Create(LayoutSpec{.model_id = "kvtier/latency", .num_layers = 1,
                                                 .kv_kind = KvKind::kSeparateKv, .num_kv_heads = 1,
                                                 .head_dim = 64, .dtype = DType::kBf16, .block_tokens = 16})
                           .value();
  ASSERT_EQ(small.block_bytes(), 4096u);
  constexpr uint32_t kPrompt = 4096;
  ShmKvCache cache = ShmKvCache::Create(small, kPrompt).value();
  const CacheId id = a->RegisterKvCache(cache).value();
  std::vector<BlockKey> first;
  for (uint64_t p = 0; p < 16; ++p) {
    const std::vector<BlockKey> keys = a->ComputeKeys(id, PseudoTokens(100 + p, kPrompt * 16)).value();
    std::vector<uint32_t> ids(kPrompt);
    for (uint32_t i = 0; i < kPrompt; ++i) ids[i] = i;
    ASSERT_EQ(a->Store(id, keys, ids).value().blocks, kPrompt);
    if (p == 0) first.assign(keys.begin(), keys.begin() + 128);
  }
  Client& abuser = *tenants->b;  // (lambdas cannot capture structured bindings in C++20)
  Client& admin_client = *tenants->ops;
  const double alone = LookupP99WhileAbused(*a, id, first, nullptr);
  // Generous: the abuser's own round trips take CPU from the victim on a
  // small (and, under sanitizers, slow) machine; a walk of the cache costs
  // milliseconds per call (before: 2-4 ms p99 here against 0.2 ms alone, in a
  // Debug build on an idle 2-core machine; 70 ms and more on a busy one).
  const double bound = 3 * alone + 1000;
  // The best of up to three rounds: a walk of the cache slows every round,
  // while the other tests that ctest runs beside this one (2 cores, ASan)
  // slow some (seen: 4.5 ms against a bound of 4.1 ms once, in one round).
  auto best_of_three = [&](const std::function<void()>& abuse) {
    double best = LookupP99WhileAbused(*a, id, first, abuse);
    for (int round = 1; round < 3 && best >= bound; ++round) {
      best = std::min(best, LookupP99WhileAbused(*a, id, first, abuse));
    }
    return best;
  };
  const double tenant = best_of_three([&, i = 0]() mutable {
    if (i++ % 2) {
      (void)abuser.ListNamespaces();
    } else {
      (void)abuser.Evict();
    }
  });
  const double admin = best_of_three([&] { (void)admin_client.ListNamespaces("*"); });
  std::printf("victim lookup p99: alone %.0f us, tenant abusing %.0f us, admin abusing %.0f us\n", alone, tenant, admin);
  EXPECT_EQ(a->ListNamespaces().value().at(0).blocks, 16u * kPrompt);
  if (kUnderTsan) {
    // TSan's own cost on every round trip of the abuser (up to 2 ms p99 here
    // next to other tests) is no walk of the cache: the bound holds in the
    // Debug and ASan runs; this one checks the calls for races.
    return;
  }
  EXPECT_LT(tenant, bound) << "p99 alone " << alone << " us";
  EXPECT_LT(admin, bound) << "p99 alone " << alone << " us";
}

}  // namespace
}  // namespace kvtier::testing
