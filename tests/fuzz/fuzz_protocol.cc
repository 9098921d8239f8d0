// Fuzz target: the wire protocol, through the daemon's own code. A real
// kvtier::Server (the whole of kvtierd but main) runs in this process on a
// temporary socket with two tenants: "victim", which stored a prompt's blocks
// once at start-up, and "mallory" (no admin, with quotas), whose session each
// input drives: it says a valid Hello, registers a small memfd KV cache
// (namespace 1, so fuzzed Lookup, Load, Store, Wait and Evict reach the cache,
// not just the "unknown namespace" check), and then sends the input as
// messages: [u16 little-endian length, bytes]...
//
// Properties: the daemon never crashes (the sanitizers watch its threads
// too), never hangs, and always still answers Stats after whatever a client
// sent; and nothing mallory sends reaches the victim's blocks: after every
// input they are all still there and load byte for byte (mallory's quotas
// keep the tiers from filling, so no eviction may take them either).
#include <poll.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "common/block_pattern.h"
#include "common/check.h"
#include "config/config_loader.h"
#include "daemon/server.h"
#include "ipc/seqpacket.h"
#include "ipc/wire.h"
#include "kvtier/client.h"
#include "kvtier/shm_kv_cache.h"

namespace {

using namespace kvtier;  // NOLINT(google-build-using-namespace): a fuzz target's file

const std::string kVictimToken(32, 'v');
const std::string kMalloryToken(32, 'm');
constexpr uint32_t kVictimBlocks = 8;

std::string g_socket;
std::unique_ptr<ShmKvCache> g_cache;  // mallory's
// The victim: its client, cache and the keys of the blocks it stored.
std::unique_ptr<Client> g_victim;
std::unique_ptr<ShmKvCache> g_victim_cache;
CacheId g_victim_id = 0;
std::vector<BlockKey> g_victim_keys;
// The in-process daemon and its loop thread, stopped and joined at exit
// before any static is destroyed (its threads must not outlive what they use).
std::unique_ptr<Server> g_server;
std::thread g_loop;

void StopDaemon() {
  if (!g_server) return;
  g_victim.reset();
  g_server->Stop();
  g_loop.join();
  g_server.reset();
}

Layout SmallLayout() {
  return Layout::Create(LayoutSpec{.model_id = "fuzz/kv", .num_layers = 2, .kv_kind = KvKind::kSeparateKv,
                                   .num_kv_heads = 2, .head_dim = 16, .dtype = DType::kBf16, .block_tokens = 4})
      .value();
}

// The next message on `fd`, waiting at most `ms`; nullopt on timeout, EOF or error.
std::optional<std::vector<uint8_t>> Receive(int fd, int ms) {
  pollfd p{fd, POLLIN, 0};
  if (::poll(&p, 1, ms) <= 0) return std::nullopt;
  Result<ipc::ReceivedMessage> m = ipc::ReceiveMessage(fd, ipc::kMaxReplyBytes);
  if (!m || m->eof) return std::nullopt;
  return std::move(m->bytes);
}

// A session of mallory's that said Hello (and registered the cache when
// `with_cache`).
UniqueFd OpenSession(bool with_cache) {
  Result<UniqueFd> fd = ipc::Connect(g_socket);
  KVTIER_CHECK_MSG(fd.has_value(), "the daemon stopped accepting connections");
  flatbuffers::FlatBufferBuilder b;
  KVTIER_CHECK(ipc::SendMessage(fd->get(),
                                ipc::FinishMessage(b, 1,
                                                   wire::CreateHelloDirect(b, ipc::kProtocolVersion,
                                                                           kMalloryToken.c_str())))
                   .ok());
  KVTIER_CHECK_MSG(Receive(fd->get(), 10000).has_value(), "no Welcome");
  if (with_cache) {
    b.Clear();
    std::vector<flatbuffers::Offset<wire::MemoryRegion>> regions = {
        wire::CreateMemoryRegion(b, wire::MemoryKind::HostMemfd, g_cache->size_bytes(), 0)};
    std::vector<wire::Placement> placements;
    for (const Placement& p : g_cache->placements()) placements.push_back(ipc::PlacementToWire(p));
    const int memfd = g_cache->fd();
    KVTIER_CHECK(ipc::SendMessage(fd->get(),
                                  ipc::FinishMessage(b, 2, wire::CreateRegisterKvCacheDirect(
                                                               b, ipc::LayoutToWire(b, SmallLayout()),
                                                               g_cache->num_blocks(), &regions, &placements)),
                                  std::span(&memfd, 1))
                     .ok());
    KVTIER_CHECK_MSG(Receive(fd->get(), 10000).has_value(), "no reply to RegisterKvCache");
  }
  return std::move(*fd);
}

// The daemon is alive: a fresh session gets a StatsReply.
void CheckAlive() {
  UniqueFd fd = OpenSession(false);
  flatbuffers::FlatBufferBuilder b;
  KVTIER_CHECK(ipc::SendMessage(fd.get(), ipc::FinishMessage(b, 9, wire::CreateStats(b))).ok());
  std::optional<std::vector<uint8_t>> reply = Receive(fd.get(), 10000);
  KVTIER_CHECK_MSG(reply.has_value(), "the daemon does not answer Stats any more");
  Result<const wire::Message*> m = ipc::VerifyMessage(*reply);
  KVTIER_CHECK(m.has_value() && (*m)->body_type() == wire::Body::StatsReply);
}

// The victim's blocks are all there and load exactly.
void CheckVictimUntouched() {
  Result<LookupResult> hit = g_victim->Lookup(g_victim_id, g_victim_keys);
  KVTIER_CHECK_MSG(hit.has_value() && hit->hits == kVictimBlocks,
                   "another tenant's blocks went missing");
  std::vector<uint32_t> ids;
  for (uint32_t i = 0; i < kVictimBlocks; ++i) {
    ids.push_back(kVictimBlocks + i);
    std::memset(g_victim_cache->block(kVictimBlocks + i).data(), 0,
                g_victim_cache->block(0).size());
  }
  Result<OpResult> loaded = g_victim->Load(g_victim_id, g_victim_keys, ids);
  KVTIER_CHECK_MSG(loaded.has_value() && loaded->blocks == kVictimBlocks,
                   "another tenant's blocks do not load");
  for (uint32_t i = 0; i < kVictimBlocks; ++i) {
    KVTIER_CHECK_MSG(MatchesKey(g_victim_keys[i], g_victim_cache->block(kVictimBlocks + i)),
                     "another tenant's block changed");
  }
}

// Writes seed inputs (KVTIER_FUZZ_WRITE_SEEDS=DIR): valid requests of every
// kind on namespace 1, as the corpus in tests/fuzz/corpus/ was made.
void WriteSeeds(const std::string& dir) {
  std::vector<wire::Key> keys;
  for (uint8_t i = 0; i < 4; ++i) {
    BlockKey k;
    for (uint8_t j = 0; j < 16; ++j) k.bytes[j] = static_cast<uint8_t>(i * 16 + j);
    keys.push_back(ipc::ToWire(k));
  }
  std::vector<uint32_t> ids = {0, 1, 2, 3};
  std::vector<uint32_t> other = {4, 5, 6, 7};
  auto frame = [](std::vector<uint8_t>& out, const std::vector<uint8_t>& msg) {
    out.push_back(static_cast<uint8_t>(msg.size()));
    out.push_back(static_cast<uint8_t>(msg.size() >> 8));
    out.insert(out.end(), msg.begin(), msg.end());
  };
  auto seed = [&](const std::string& name, const std::vector<std::vector<uint8_t>>& msgs) {
    std::vector<uint8_t> out;
    for (const auto& m : msgs) frame(out, m);
    FILE* f = std::fopen((dir + "/" + name).c_str(), "wb");
    KVTIER_CHECK(f != nullptr && std::fwrite(out.data(), 1, out.size(), f) == out.size());
    std::fclose(f);
  };
  flatbuffers::FlatBufferBuilder b;
  auto msg = [&](auto make) {
    b.Clear();
    return make(b);
  };
  const auto store = msg([&](auto& x) { return ipc::FinishMessage(x, 10, wire::CreateStoreDirect(x, 1, &keys, &ids, nullptr, true)); });
  const auto lookup = msg([&](auto& x) { return ipc::FinishMessage(x, 11, wire::CreateLookupDirect(x, 1, &keys)); });
  const auto load = msg([&](auto& x) { return ipc::FinishMessage(x, 12, wire::CreateLoadDirect(x, 1, &keys, &other, false)); });
  const auto wait = msg([&](auto& x) { return ipc::FinishMessage(x, 13, wire::CreateWait(x, 1, 100)); });
  const auto poll = msg([&](auto& x) { return ipc::FinishMessage(x, 14, wire::CreatePoll(x, 1)); });
  const auto prefetch = msg([&](auto& x) { return ipc::FinishMessage(x, 15, wire::CreatePrefetchDirect(x, 1, &keys)); });
  const auto stats = msg([&](auto& x) { return ipc::FinishMessage(x, 16, wire::CreateStats(x)); });
  const auto evict = msg([&](auto& x) { return ipc::FinishMessage(x, 17, wire::CreateEvictDirect(x, "", nullptr, wire::Tier::Host)); });
  const auto namespaces = msg([&](auto& x) { return ipc::FinishMessage(x, 18, wire::CreateListNamespacesDirect(x, "*")); });
  const auto tenants = msg([&](auto& x) { return ipc::FinishMessage(x, 19, wire::CreateListTenants(x)); });
  // Reaching for the victim's blocks.
  const auto evict_victim = msg([&](auto& x) {
    return ipc::FinishMessage(x, 20,
                              wire::CreateEvictDirect(x, "victim", nullptr, wire::Tier::None));
  });
  const auto evict_all = msg([&](auto& x) {
    return ipc::FinishMessage(x, 21, wire::CreateEvictDirect(x, "*", nullptr, wire::Tier::None));
  });
  const auto list_victim = msg([&](auto& x) {
    return ipc::FinishMessage(x, 22, wire::CreateListNamespacesDirect(x, "victim"));
  });
  const auto flush = msg([&](auto& x) { return ipc::FinishMessage(x, 23, wire::CreateFlush(x)); });
  seed("store-lookup-load-wait", {store, lookup, load, wait});
  seed("store-prefetch-poll", {store, prefetch, load, poll});
  seed("admin", {stats, evict, namespaces, tenants});
  seed("lookup", {lookup});
  seed("cross-tenant", {evict_victim, evict_all, list_victim, flush});
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  spdlog::set_level(spdlog::level::off);
  char tmpl[] = "/tmp/kvtier-fuzz-XXXXXX";
  KVTIER_CHECK(::mkdtemp(tmpl) != nullptr);
  const std::string dir = tmpl;
  g_socket = dir + "/kvtierd.sock";
  Result<Config> config = LoadConfig(ConfigSource{
      .overrides = {
          "socket.path=" + g_socket, "state_dir=" + dir + "/state", "tiers.disk.enabled=false",
          "metrics.enabled=false", "tiers.host.bytes=8MiB", "tiers.hbm.enabled=true",
          "tiers.hbm.bytes=1MiB", "limits.max_keys_per_request=64",
          "tenants=[{name: victim, token: " + kVictimToken + "}, {name: mallory, token: " +
              kMalloryToken + ", quotas: {hbm: 256KiB, host: 2MiB}}]"}});
  KVTIER_CHECK(config.has_value());
  Server::Options options;
  options.config = *config;
  Result<std::unique_ptr<Server>> server = Server::Create(std::move(options));
  KVTIER_CHECK_MSG(server.has_value(), "cannot start the in-process daemon");
  g_server = std::move(*server);
  g_loop = std::thread([] { (void)g_server->Run(); });
  std::atexit(StopDaemon);  // runs before the statics above are destroyed
  g_cache = std::make_unique<ShmKvCache>(ShmKvCache::Create(SmallLayout(), 32).value());
  g_victim = Client::Connect({.socket_path = g_socket, .token = kVictimToken}).value();
  g_victim_cache =
      std::make_unique<ShmKvCache>(ShmKvCache::Create(SmallLayout(), 2 * kVictimBlocks).value());
  g_victim_id = g_victim->RegisterKvCache(*g_victim_cache).value();
  g_victim_keys = g_victim->ComputeKeys(g_victim_id, PseudoTokens(7, kVictimBlocks * 4)).value();
  std::vector<uint32_t> ids;
  for (uint32_t i = 0; i < kVictimBlocks; ++i) {
    FillFromKey(g_victim_keys[i], g_victim_cache->block(i));
    ids.push_back(i);
  }
  KVTIER_CHECK(g_victim->Store(g_victim_id, g_victim_keys, ids).value().blocks == kVictimBlocks);
  if (const char* seeds = std::getenv("KVTIER_FUZZ_WRITE_SEEDS"); seeds != nullptr) {
    WriteSeeds(seeds);
    std::exit(0);
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  UniqueFd fd = OpenSession(/*with_cache=*/true);
  bool open = true;
  for (size_t at = 0; open && at + 2 <= size;) {
    const size_t len = std::min<size_t>(data[at] | (size_t{data[at + 1]} << 8), size - at - 2);
    at += 2;
    open = ipc::SendMessage(fd.get(), std::span(data + at, len)).ok();
    at += len;
    // Take whatever answers come quickly; a Wait may hold its answer.
    while (open && Receive(fd.get(), 0).has_value()) {
    }
  }
  fd.Reset();
  CheckAlive();
  CheckVictimUntouched();
  return 0;
}
