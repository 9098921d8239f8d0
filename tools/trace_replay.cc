#include "tools/trace_replay.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <new>
#include <optional>
#include <thread>

#include "common/block_pattern.h"
#include "kernels/codec.h"
#include "kvtier/client.h"

namespace kvtier::bench {
namespace {

using Clock = std::chrono::steady_clock;

// One client's counts and outcome, in shared memory; written only by that
// client, read by the parent after it exited.
struct ClientSlot {
  ReplayCounts counts;
  bool done = false;
  StatusCode code = StatusCode::kOk;
  char error[256] = {};
};

struct Shared {
  std::atomic<uint64_t> next_request{0};  // relaxed: it only hands out indices
  ClientSlot slots[kMaxReplayClients];
};
static_assert(std::atomic<uint64_t>::is_always_lock_free,
              "the ticket counter is shared between processes");

struct Prepared {
  const ReplayPlan& plan;
  std::vector<std::vector<std::array<uint8_t, 16>>> hashes;  // per request
  uint32_t max_blocks = 1;                                   // the longest request
  Layout layout;
};

void Fail(ClientSlot& slot, const std::string& what, const Status& status) {
  slot.code = status.code();
  std::snprintf(slot.error, sizeof(slot.error), "%s: %s", what.c_str(), status.ToString().c_str());
}

std::vector<uint32_t> Range(uint32_t first, uint32_t n) {
  std::vector<uint32_t> v(n);
  for (uint32_t i = 0; i < n; ++i) v[i] = first + i;
  return v;
}

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// A block's contents from its key, and whether a loaded block holds them:
// exactly, or within fp8's bound for an fp8 cache.
bool KvData(const Prepared& p) { return p.plan.kv_data || p.plan.codec != CodecKind::kNone; }
void Fill(const Prepared& p, const BlockKey& key, std::span<uint8_t> out) {
  if (KvData(p)) {
    FillKvFromKey(key, out);
  } else {
    FillFromKey(key, out);
  }
}
bool Matches(const Prepared& p, const BlockKey& key, std::span<const uint8_t> got) {
  if (p.plan.codec == CodecKind::kFp8) {
    std::vector<uint8_t> want(got.size());
    FillKvFromKey(key, want);
    const LayoutSpec& spec = p.layout.spec();
    return WithinFp8Bound({.kind = CodecKind::kFp8, .dtype = spec.dtype, .group_elems = spec.head_dim}, want, got);
  }
  return KvData(p) ? MatchesKvKey(key, got) : MatchesKey(key, got);
}

// One engine process: connect, register, write a byte to `ready_fd`, wait
// for `go_fd` to close, then take requests until none are left.
void RunClient(uint32_t index, const Prepared& p, Shared* shared, int ready_fd, int go_fd) {
  ClientSlot& slot = shared->slots[index];
  ReplayCounts& rep = slot.counts;
  auto client = Client::Connect(
      {.socket_path = p.plan.socket, .client_name = "kvtier-bench-trace-" + std::to_string(index)});
  if (!client) return Fail(slot, "connect", client.error());
  auto cache = ShmKvCache::Create(p.layout, p.max_blocks);
  if (!cache) return Fail(slot, "shm cache", cache.error());
  auto id = (*client)->RegisterKvCache(*cache, {.kind = p.plan.codec});
  if (!id) return Fail(slot, "register", id.error());
  char c = 1;
  if (::write(ready_fd, &c, 1) != 1)
    return Fail(slot, "ready pipe", Status::FromErrno(errno, "write"));
  while (::read(go_fd, &c, 1) > 0) {
  }
  const std::vector<trace::TraceRequest>& requests = p.plan.requests;
  const auto t0 = Clock::now();
  const uint64_t ts0 = requests.empty() ? 0 : requests.front().timestamp_ms;
  std::vector<BlockKey> keys;
  for (uint64_t i;
       (i = shared->next_request.fetch_add(1, std::memory_order_relaxed)) < requests.size();) {
    if (p.plan.speed > 0) {
      const double at_s =
          static_cast<double>(requests[i].timestamp_ms - ts0) / 1000.0 / p.plan.speed;
      std::this_thread::sleep_until(
          t0 + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(at_s)));
    }
    const auto r0 = Clock::now();
    keys.clear();
    for (const auto& h : p.hashes[i]) {
      auto k = (*client)->KeyFromEngineHash(*id, h);
      if (!k) return Fail(slot, "key", k.error());
      keys.push_back(*k);
    }
    const auto n = static_cast<uint32_t>(keys.size());
    auto found = (*client)->Lookup(*id, keys);
    if (!found) return Fail(slot, "lookup", found.error());
    if (i >= p.plan.count_from_request) {
      rep.requests += 1;
      rep.accesses += n;
      rep.hits += found->hits;
      rep.tokens += requests[i].Tokens();
      rep.hit_tokens += requests[i].TokensOf(found->hits);
      for (BlockTier t : found->tiers) rep.tier_hits[static_cast<int>(t) - 1] += 1;
    }
    // The hit prefix into engine blocks 0..hits-1; the engine computes the
    // rest and stores it.
    uint32_t loaded = 0;
    if (found->hits > 0) {
      auto l = (*client)->Load(*id, std::span(keys).first(found->hits), Range(0, found->hits));
      if (!l) return Fail(slot, "load", l.error());
      loaded = l->blocks;
      rep.short_loads += loaded < found->hits;
      for (uint32_t j = 0; j < loaded; ++j) rep.mismatches += !Matches(p, keys[j], cache->block(j));
      rep.loaded += loaded;
    }
    if (loaded < n) {
      for (uint32_t j = loaded; j < n; ++j) Fill(p, keys[j], cache->block(j));
      std::optional<BlockKey> parent;
      if (loaded > 0) parent = keys[loaded - 1];
      auto s =
          (*client)->Store(*id, std::span(keys).subspan(loaded), Range(loaded, n - loaded), parent);
      if (s) {
        rep.stored += s->blocks;
        rep.already += s->already;
      } else if (s.error().code() == StatusCode::kResourceExhausted) {
        rep.rejected += n - loaded;  // some may have been stored before the refusal
      } else {
        return Fail(slot, "store", s.error());
      }
    }
    rep.busy_s += Seconds(Clock::now() - r0);
  }
  slot.done = true;
}

}  // namespace

void ReplayCounts::Add(const ReplayCounts& r) {
  requests += r.requests;
  accesses += r.accesses;
  hits += r.hits;
  tokens += r.tokens;
  hit_tokens += r.hit_tokens;
  for (int t = 0; t < 3; ++t) tier_hits[t] += r.tier_hits[t];
  loaded += r.loaded;
  short_loads += r.short_loads;
  mismatches += r.mismatches;
  stored += r.stored;
  already += r.already;
  rejected += r.rejected;
  busy_s += r.busy_s;
}

Result<Layout> TraceLayout(uint64_t block_bytes) {
  // 2 (K and V) x 512 tokens x 1 head x head_dim x 2 bytes (bf16).
  return Layout::Create({.model_id = "kvtier/trace-replay",
                         .num_layers = 1,
                         .kv_kind = KvKind::kSeparateKv,
                         .num_kv_heads = 1,
                         .head_dim = static_cast<uint32_t>(block_bytes / 2048),
                         .dtype = DType::kBf16,
                         .block_tokens = trace::kTraceBlockTokens,
                         .tp_rank = 0,
                         .tp_size = 1,
                         .scale_bytes_per_layer = 0});
}

std::vector<std::array<uint8_t, 16>> ChainHashes(std::span<const uint64_t> hash_ids,
                                                 uint64_t salt) {
  std::vector<std::array<uint8_t, 16>> out;
  out.reserve(hash_ids.size());
  uint64_t a = salt, b = ~salt;
  for (uint64_t id : hash_ids) {
    uint64_t s1 = a ^ (id * 0x9e3779b97f4a7c15ull), s2 = b + id;
    a = SplitMix64(s1);
    b = SplitMix64(s2) ^ a;
    std::array<uint8_t, 16>& h = out.emplace_back();
    std::memcpy(h.data(), &a, 8);
    std::memcpy(h.data() + 8, &b, 8);
  }
  return out;
}

Result<ReplayResult> Replay(const ReplayPlan& plan, uint32_t clients, const ReplayTick& tick) {
  if (clients == 0 || clients > kMaxReplayClients) {
    return Err(InvalidArgument("clients must be 1-" + std::to_string(kMaxReplayClients)));
  }
  if (plan.block_bytes == 0 || plan.block_bytes % 2048 != 0) {
    return Err(InvalidArgument("block_bytes must be a positive multiple of 2 KiB"));
  }
  KVTIER_ASSIGN_OR_RETURN(Layout layout, TraceLayout(plan.block_bytes));
  Prepared p{.plan = plan, .hashes = {}, .max_blocks = 1, .layout = std::move(layout)};
  for (const trace::TraceRequest& r : plan.requests) {
    p.hashes.push_back(ChainHashes(r.hash_ids, plan.salt));
    p.max_blocks = std::max<uint32_t>(p.max_blocks, static_cast<uint32_t>(r.hash_ids.size()));
  }

  void* mem =
      ::mmap(nullptr, sizeof(Shared), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (mem == MAP_FAILED) return Err(Status::FromErrno(errno, "mmap"));
  auto* shared = new (mem) Shared();
  int ready[2], go[2];
  if (::pipe2(ready, O_CLOEXEC) != 0 || ::pipe2(go, O_CLOEXEC) != 0) {
    const int err = errno;
    ::munmap(mem, sizeof(Shared));
    return Err(Status::FromErrno(err, "pipe"));
  }
  std::fflush(stdout);
  std::fflush(stderr);
  std::vector<pid_t> pids;
  Status status;
  for (uint32_t i = 0; i < clients; ++i) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::close(ready[0]);
      ::close(go[1]);
      RunClient(i, p, shared, ready[1], go[0]);
      ::_exit(shared->slots[i].done ? 0 : 1);
    }
    if (pid < 0) {
      status = Status::FromErrno(errno, "fork");
      break;
    }
    pids.push_back(pid);
  }
  ::close(ready[1]);
  ::close(go[0]);
  // Every client connected and registered (or gone: end of file), then go.
  char c;
  for (size_t n = 0; n < pids.size() && ::read(ready[0], &c, 1) == 1; ++n) {
  }
  const auto t0 = Clock::now();
  ::close(go[1]);
  if (tick) {
    std::vector<pid_t> running = pids;
    while (!running.empty()) {
      std::erase_if(running, [](pid_t pid) { return ::waitpid(pid, nullptr, WNOHANG) == pid; });
      tick(shared->next_request.load(std::memory_order_relaxed), Seconds(Clock::now() - t0));
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }
  for (pid_t pid : pids) ::waitpid(pid, nullptr, 0);
  ReplayResult result;
  result.wall_s = Seconds(Clock::now() - t0);
  ::close(ready[0]);
  for (uint32_t i = 0; i < pids.size(); ++i) {
    const ClientSlot& slot = shared->slots[i];
    if (!slot.done && status.ok()) {
      status = slot.error[0] != '\0'
                   ? Status(slot.code == StatusCode::kOk ? StatusCode::kInternal : slot.code,
                            "client " + std::to_string(i) + ": " + slot.error)
                   : Internal("client " + std::to_string(i) + " died");
    }
    result.counts.Add(slot.counts);
  }
  shared->~Shared();
  ::munmap(mem, sizeof(Shared));
  if (!status.ok()) return Err(status);
  return result;
}

}  // namespace kvtier::bench
