// kvtier::Client: the engine side of kvtier (libkvtier).
//
// An engine connects to the node's kvtierd, registers its KV cache once,
// computes chain keys for its prompts, asks how much of a prompt is cached
// (Lookup), and has the daemon copy blocks into (Load) and out of (Store) its
// own KV cache pages:
//
//   auto client = kvtier::Client::Connect({.socket_path = "/run/kvtier/kvtierd.sock"});
//   auto cache = kvtier::ShmKvCache::Create(layout, 1024);            // CPU engines
//   auto id = (*client)->RegisterKvCache(*cache);
//   auto keys = (*client)->ComputeKeys(*id, prompt_tokens);
//   auto hit = (*client)->Lookup(*id, *keys);                         // no pin
//   auto loaded = (*client)->Load(*id, first_n_keys, engine_blocks);  // blocking
//   auto op = (*client)->StoreAsync(*id, new_keys, engine_blocks);    // then Wait(*op)
//
// Restarts: when the daemon goes away every call returns kUnavailable (an
// engine treats that as a miss) and the client reconnects and re-registers
// its caches by itself on a later call. Handles (cache ids) stay valid; ops
// started before the restart report kUnavailable.
//
// Thread-safe: calls are serialised on one connection, so a blocking call or
// Wait in one thread delays the others; use one Client per engine thread that
// needs independent progress.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/chain_hash.h"
#include "common/default_socket.h"  // ClientDefaultSocket: the socket when none is named
#include "common/key128.h"
#include "common/kv_cache_layout.h"
#include "common/layout.h"
#include "common/status.h"
#include "kvtier/shm_kv_cache.h"

namespace kvtier {

struct ClientOptions {
  std::string socket_path;          // REQUIRED
  std::string token = {};           // when the tenant is identified by a token
  std::string client_name = {};     // shown in the daemon's logs
  // After losing the daemon, the shortest time between reconnect attempts.
  std::chrono::milliseconds reconnect_interval{200};
  // How long a call waits for the daemon's reply (a Wait: its own timeout
  // more); past it the call fails with kDeadlineExceeded and the connection
  // is dropped (the next call connects again). 0: no limit. An engine's
  // scheduler sets one, so that a hung daemon costs it a bounded wait.
  std::chrono::milliseconds call_timeout{0};
};

// How a KV cache's blocks are stored below the daemon's host memory
// (docs/compression.md): as they are (the default); kLossless, bit-exact,
// about 1.4x smaller for bf16 KV; or kFp8, LOSSY: E4M3 with one scale per
// `fp8_group` elements (0: a head's head_dim values of one token), about 2x
// smaller, for fp16 and bf16 caches only, each element within
// 0.0665·|x| + 2^-10·scale of its value; loads give back the engine's dtype.
// fp8 blocks form a namespace of their own: a cache registered without fp8
// never loads them. The tenant's `codecs` must allow the choice
// (kPermissionDenied otherwise).
struct CodecChoice {
  CodecKind kind = CodecKind::kNone;
  uint32_t fp8_group = 0;
};

// One region of engine memory for RegisterKvCache: a memfd sealed with
// F_SEAL_SHRINK (borrowed: the client dups it, for re-registration).
struct KvRegion {
  int memfd = -1;
  uint64_t size_bytes = 0;
};

// One region of GPU memory for RegisterCudaKvCache: a device pointer (an
// engine KV tensor; it may lie inside a larger allocation, as PyTorch's
// caching allocator makes them) and its size.
struct CudaKvRegion {
  void* device_ptr = nullptr;
  uint64_t size_bytes = 0;
};

// An engine's cudaStream_t / cudaEvent_t, opaque so that this header needs no
// CUDA include.
using CudaStream = void*;
using CudaEvent = void*;

using CacheId = uint32_t;

// kRemote: in the shared remote tier (Redis Cluster) only; a load fetches it
// into this node's host tier first.
enum class BlockTier : uint8_t { kHbm = 1, kHost = 2, kDisk = 3, kRemote = 4 };
// "hbm", "host", "disk" or "remote" ("?" for a value outside the enum; each a string
// literal, so .data() is NUL-terminated), and back.
// ParseBlockTier takes the local tiers (hbm, host, disk: what an Evict names);
// errors: kInvalidArgument naming the text.
std::string_view BlockTierName(BlockTier tier);
Result<BlockTier> ParseBlockTier(std::string_view name);

struct LookupResult {
  uint32_t hits = 0;              // leading keys cached
  std::vector<BlockTier> tiers;   // tier of each hit
  // Given a prefill rate: keys cached past `hits` that kvtierd left out, as
  // loading them was expected to take longer than computing them.
  uint32_t recompute = 0;
};

// What a KV-aware router needs of the blocks of a Store (KV events,
// docs/kv-events.md), as the engine knows them: kvtierd keeps it with the
// blocks and publishes it for tenants whose config says so. The spans are
// the caller's and need live only for the call. Every hash has hash_bytes
// bytes (1-32; an engine's digest, or its low 64 bits as 8 big-endian bytes).
struct BlockEventInfo {
  uint32_t hash_bytes = 0;
  std::span<const uint8_t> engine_hashes;  // hash_bytes per key, in key order
  std::span<const uint8_t> parent_hash;    // the block before keys[0]; empty at a sequence start
  std::span<const uint32_t> token_ids;     // block_size per key, or empty
  uint32_t block_size = 0;                 // tokens per block
  std::string_view lora_name;              // empty: none
};

// The engine's retention hint (docs/policy.md): for the new blocks of a
// Store, or for a request's cached blocks (Client::Hint). Optional; the
// eviction policy decides for blocks without one.
struct BlockHint {
  // -1: evict these before unhinted blocks; 0: no hint; 1: keep them over
  // unhinted blocks (at most policy.hints.max_share of a tier). Any other
  // value is refused.
  int priority = 0;
  // Their next use is expected within this many ms (a conversation's next
  // turn, a tool call's return): kept over unhinted blocks until a hit, or
  // until twice this long has passed. 0: none; at most 3,600,000 (an hour).
  uint32_t next_use_ms = 0;
  // Hint only: the session is over; its blocks go first (a hit undoes it).
  bool session_over = false;
  // Store only: the last key's block covers part of a block's tokens. It is
  // not stored (partial blocks are almost never reused).
  bool last_partial = false;
  // Store: the engine keeps a copy of these blocks in its own cache;
  // kvtier evicts them first (unless priority or next_use_ms say
  // otherwise) until a hit, or a Hint with engine_dropped (docs/policy.md,
  // "Exclusive caching"). Load (the only field a load takes): the engine
  // keeps the blocks it loads; the load is a use, after which they are
  // evicted first as a store's are (blocks hinted to be kept stay kept).
  bool engine_holds = false;
  // Hint only: the engine let go of its own copies: those stored with
  // engine_holds are kvtier's only copies now (the other fields are not
  // read). HintResult::hinted says how many.
  bool engine_dropped = false;
};

struct HintResult {
  uint32_t hinted = 0;   // cached blocks that took the hint
  uint32_t refused = 0;  // of which hinted to be kept past the tier's share: kept as unhinted
};

struct OpResult {
  uint32_t blocks = 0;   // loaded, or newly stored
  uint32_t already = 0;  // Store: keys already present or in flight
};

struct OpHandle {
  uint64_t op = 0;
  uint64_t connection = 0;  // which connection started it
  // GPU caches, ops given a stream: a CUDA event an engine stream can wait
  // on. Load: recorded on the daemon's copy stream after the copies of
  // `event_blocks` blocks. Store: completes once the store is over. Null when
  // that cannot be promised (a load's blocks read from disk first, every
  // event busy): then Wait. Valid until Wait has returned the op's result.
  CudaEvent event = nullptr;
  uint32_t event_blocks = 0;
};

struct TierStats {
  BlockTier tier = BlockTier::kHost;
  uint64_t capacity_bytes = 0;
  uint64_t used_bytes = 0;
  uint64_t blocks = 0;
};

// Stats as the caller may see them: the node's for an admin tenant, else
// only the caller's own tenant's share (scope says which).
struct DaemonStats {
  std::string release;  // kvtierd's version, e.g. "0.1.0" (empty from a daemon before 0.1.0)
  std::string scope;    // "node", or "tenant <name>"
  std::string backend;  // the device backend, its devices and driver
  std::string metrics;  // where /metrics is served ("host:port"), or empty
  std::vector<TierStats> tiers;
  uint64_t sessions = 0;
  uint64_t leases = 0;
  uint64_t mappings = 0;
  uint64_t inflight_ops = 0;
  std::vector<std::pair<std::string, uint64_t>> counters;
  // The value of a counter, 0 if absent.
  uint64_t Counter(std::string_view name) const;
};

struct NamespaceStats {
  LayoutFingerprint fingerprint;
  std::string description;  // the layout, as its stores described it ("" if only known from disk after a restart)
  uint64_t blocks = 0;
  uint64_t used_bytes[3] = {};  // hbm, host, disk
};

struct VerifyStatus {
  uint64_t total = 0;    // disk records to check
  uint64_t checked = 0;
  uint64_t bad = 0;      // failed their checks: dropped, never served
  uint64_t skipped = 0;  // left the disk tier before their turn
  bool done = false;
};

struct TenantStats {
  std::string name;
  uint64_t sessions = 0;
  uint64_t used_bytes[3] = {};  // hbm, host, disk
  uint64_t blocks = 0;
};

class Client {
 public:
  // Connects and says Hello. Errors: kUnavailable when no daemon listens,
  // kUnauthenticated when this process is no configured tenant, others as
  // the daemon answers.
  static Result<std::unique_ptr<Client>> Connect(ClientOptions options);
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  // The tenant the daemon identified this process as.
  std::string tenant() const;
  // kvtierd's version as its Welcome said (e.g. "0.1.0"), and this
  // library's (kvtier::kVersion in common/version.h, the same string when
  // both come from one release).
  std::string daemon_release() const;
  static const char* release();
  bool connected() const;
  // The most keys the daemon takes in one request (its Welcome's
  // limits.max_keys_per_request). Lookup, Prefetch and Hint split longer
  // key lists into requests of this size themselves; a Load or Store (and
  // their Async forms) of more keys is refused with kInvalidArgument, so
  // the caller splits those into ops of at most this many keys.
  uint32_t max_keys_per_request() const;

  // Registers engine memory described by `placements` over `regions`.
  Result<CacheId> RegisterKvCache(const Layout& layout, uint32_t num_blocks,
                                  std::vector<Placement> placements, std::vector<KvRegion> regions,
                                  CodecChoice codec = {});
  Result<CacheId> RegisterKvCache(const ShmKvCache& cache, CodecChoice codec = {});
  // Registers a KV cache in GPU memory (e.g. vLLM's per-layer tensors): each
  // region is exported as a CUDA IPC handle, and a pool of interprocess
  // events is created for GPU-side completion. Errors: kInvalidArgument for
  // memory that is not on one GPU; kUnimplemented when libkvtier was built
  // without CUDA, or the daemon runs the host backend.
  Result<CacheId> RegisterCudaKvCache(const Layout& layout, uint32_t num_blocks, std::vector<Placement> placements,
                                      std::vector<CudaKvRegion> regions, CodecChoice codec = {});

  // Chain keys of every full block of `tokens` (docs/hashing.md), keyed by
  // this tenant's hash secret. Works offline once connected.
  Result<std::vector<BlockKey>> ComputeKeys(CacheId cache, std::span<const uint32_t> tokens,
                                            std::span<const ExtraKeys> extra_keys_per_block = {},
                                            const std::optional<BlockKey>& parent = std::nullopt);
  // An engine's own 16- or 32-byte block hash as a key.
  Result<BlockKey> KeyFromEngineHash(CacheId cache, std::span<const uint8_t> hash);

  // How many leading keys are cached, and in which tier, for any number of
  // keys: past max_keys_per_request(), one request per that many keys, the
  // next sent only while every key so far was a hit.
  //
  // Load or recompute (docs/policy.md): `prefill_tokens_per_s`, the rate at
  // which the engine computes prefill as it measures it, has kvtierd leave
  // out the hits it expects to load slower than the engine computes them,
  // from its own timings of this layout's loads from each tier
  // (LookupResult::recompute counts them). 0: every hit.
  Result<LookupResult> Lookup(CacheId cache, std::span<const BlockKey> keys, double prefill_tokens_per_s = 0);
  // Starts moving cached blocks of `keys` to faster tiers. Returns how many
  // leading keys are cached (with a prefill rate: worth loading; only those
  // move). Split as Lookup.
  Result<uint32_t> Prefetch(CacheId cache, std::span<const BlockKey> keys, double prefill_tokens_per_s = 0);

  // Copies the blocks of `keys` into the engine's blocks `block_ids`. A load
  // that fails (its Wait's error, e.g. kCorruption for a coded block that
  // does not decode) may have written some of its blocks and not others:
  // the engine recomputes every block of a failed load, as it would have
  // without kvtier, and never takes what is in them for its old contents.
  // `hint`: null, or engine_holds (BlockHint); any other field is
  // kInvalidArgument.
  Result<OpHandle> LoadAsync(CacheId cache, std::span<const BlockKey> keys,
                             std::span<const uint32_t> block_ids, const BlockHint* hint = nullptr);
  // As LoadAsync, copied layer by layer: every block's layer l before any
  // block's layer l + 1, so that the engine may compute layer l while later
  // layers are still on their way (WaitLayers says when they are in place).
  // On a GPU cache too: kvtierd's copy stream records an event after each
  // layer and reports the layer once it has completed (WaitLayers waits on
  // the host, StreamWaitLayers on the GPU).
  // Errors: kUnimplemented from a kvtierd that does not report layers (a
  // release before them): load whole.
  Result<OpHandle> LoadLayersAsync(CacheId cache, std::span<const BlockKey> keys,
                                   std::span<const uint32_t> block_ids, const BlockHint* hint = nullptr);
  // Waits until the first `layers` layers (of the cache's layout) of every
  // block a LoadLayersAsync op loads are in place: true. False once the op
  // is over without them (its Wait gives its result: an error, or fewer
  // blocks), or its result was collected. It takes no lock of the client's
  // calls and no round trip: the daemon reports layers in shared memory.
  // Errors: kDeadlineExceeded after `timeout` (0: no limit; the op runs on),
  // kInvalidArgument for an op that is not a LoadLayersAsync.
  Result<bool> WaitLayers(const OpHandle& op, uint32_t layers,
                          std::chrono::milliseconds timeout = std::chrono::milliseconds(0));
  // GPU engines: `stream` waits, on the GPU, until the first `layers`
  // layers of every block a LoadLayersAsync op loads are in place, or the
  // op is over (done, failed or cancelled: what the stream runs after the
  // wait may then read blocks the load did not fill, and Wait says how many
  // it loaded). No host thread waits and no round trip: the stream polls the
  // op's progress word in shared memory. Should kvtierd die, the stream
  // goes on once this client has seen it (the op's Wait or Cancel returns)
  // or is destroyed. Any CUDA stream of this process, on any device; one
  // stream per op (the client's teardown waits for the last stream that
  // waited for an op's slot before it lets go of the page streams read).
  // Errors: kInvalidArgument for a null stream, or an op that is not a
  // running LoadLayersAsync (its result collected, or cancelled);
  // kUnavailable where the device has no 64-bit stream memory operations
  // (wait with WaitLayers); kUnimplemented without CUDA.
  Status StreamWaitLayers(const OpHandle& op, uint32_t layers, CudaStream stream);
  // `events`: what KV events publish of these blocks (BlockEventInfo), or
  // null. Errors: kInvalidArgument when its sizes do not match the keys.
  // `hint`: the engine's retention hint for the new blocks (BlockHint), or
  // null. Errors: kInvalidArgument for a bad hint (session_over on a store).
  Result<OpHandle> StoreAsync(CacheId cache, std::span<const BlockKey> keys,
                              std::span<const uint32_t> block_ids,
                              const std::optional<BlockKey>& parent = std::nullopt,
                              const BlockEventInfo* events = nullptr, const BlockHint* hint = nullptr);
  // As StoreAsync, for blocks the engine is still writing, layer after
  // layer (its forward pass): the daemon copies layer l of every block once
  // LayersWritten says more than l layers are written, so the store runs
  // while later layers compute. Until then it holds the blocks' host room;
  // one not written whole within limits.store_layers_timeout_ms ends
  // kCancelled. Host (CPU) caches. Errors: kUnimplemented from a kvtierd
  // whose backend copies stores whole (Welcome.layer_stores): store whole.
  Result<OpHandle> StoreLayersAsync(CacheId cache, std::span<const BlockKey> keys,
                                    std::span<const uint32_t> block_ids,
                                    const std::optional<BlockKey>& parent = std::nullopt,
                                    const BlockEventInfo* events = nullptr, const BlockHint* hint = nullptr);
  // The first `layers` layers of a StoreLayersAsync op's blocks are written
  // (more than num_layers: all of them). One message, no reply awaited. Ok
  // for an op that is over, cancelled, or whose connection was lost (the
  // daemon gave it up then). Errors: kInvalidArgument for an op that is not
  // a StoreLayersAsync.
  Status LayersWritten(const OpHandle& op, uint32_t layers);
  // GPU caches: as LoadAsync, and when the daemon could queue the copies at
  // once (OpHandle::event set), `stream` is made to wait for them on the GPU
  // before this returns, so the engine's next kernels on it read the loaded
  // blocks with no Wait; event_blocks says how many leading blocks that is.
  // `stream` may be 0 (the legacy default stream). Wait for every op anyway:
  // that collects its result and frees its event.
  Result<OpHandle> LoadAsync(CacheId cache, std::span<const BlockKey> keys, std::span<const uint32_t> block_ids,
                             CudaStream stream, const BlockHint* hint = nullptr);
  // GPU caches: as StoreAsync, and the copies read what was queued on
  // `stream` before this call (the engine's writes of these blocks): the
  // daemon starts them once an event recorded here completes (or, with every
  // event busy, this call synchronises `stream`). OpHandle::event, when set,
  // completes once the store is over (done or failed): a stream that waits
  // on it may overwrite the blocks. When it is null, Wait instead.
  Result<OpHandle> StoreAsync(CacheId cache, std::span<const BlockKey> keys, std::span<const uint32_t> block_ids,
                              const std::optional<BlockKey>& parent, CudaStream stream,
                              const BlockEventInfo* events = nullptr, const BlockHint* hint = nullptr);
  // Waits for an op (timeout 0 = no limit). Errors: the op's own error
  // (e.g. kResourceExhausted for a store), kDeadlineExceeded on timeout (the
  // op keeps running; wait again, or Cancel), kUnavailable if the connection
  // was lost (the daemon restarted, or a call ran past call_timeout),
  // kNotFound if its result was taken already or dropped unread (a session
  // keeps the results of only its last max_inflight_ops finished ops that
  // nobody waited for; an op handle may be dropped without a Wait).
  // After any error but kDeadlineExceeded, no copy of the op touches its
  // blocks any more (kAborted if one is still in progress after
  // call_timeout: see Cancel). The same holds for a LoadAsync or StoreAsync
  // that fails.
  Result<OpResult> Wait(const OpHandle& op, std::chrono::milliseconds timeout = std::chrono::milliseconds(0));
  // Cancels an op without the daemon (it works while kvtierd is hung, and
  // from another thread than one waiting on it): its copies not started yet
  // never start, and this waits for any in progress to end (timeout 0 = no
  // limit). Once it returns Ok, the daemon never touches the op's blocks
  // again, so the engine may reuse them; the op then ends with kCancelled,
  // or with its own result if it was over, and need not be waited for. Ok
  // for an op that is over. Errors: kDeadlineExceeded when a copy is still in
  // progress after `timeout` (kvtierd stopped or died in the middle of one,
  // which takes microseconds otherwise): its blocks are not safe to reuse
  // yet; cancel again.
  Status Cancel(const OpHandle& op, std::chrono::milliseconds timeout = std::chrono::milliseconds(0));
  // Blocking forms: one round trip.
  Result<OpResult> Load(CacheId cache, std::span<const BlockKey> keys, std::span<const uint32_t> block_ids,
                        const BlockHint* hint = nullptr);
  Result<OpResult> Store(CacheId cache, std::span<const BlockKey> keys, std::span<const uint32_t> block_ids,
                         const std::optional<BlockKey>& parent = std::nullopt,
                         const BlockEventInfo* events = nullptr, const BlockHint* hint = nullptr);
  // The engine's retention hint for the cached blocks of `keys` (a
  // request's, or a session's when it is over), replacing theirs; keys not
  // cached are skipped. Errors: kInvalidArgument for a bad hint
  // (last_partial, a priority other than -1/0/1, next_use_ms past an hour).
  // Past max_keys_per_request(), one request per that many keys, the counts
  // summed.
  Result<HintResult> Hint(CacheId cache, std::span<const BlockKey> keys, const BlockHint& hint);

  Result<DaemonStats> Stats();
  // Drops unleased blocks: the caller's own, or (admin) another tenant's or
  // everyone's (`tenant` = "*"). `tier`: nullopt = all tiers.
  Result<uint64_t> Evict(const std::string& tenant = "", std::optional<BlockTier> tier = std::nullopt,
                         std::optional<LayoutFingerprint> ns = std::nullopt);
  // Namespaces (layouts) with blocks: the caller's, or (admin) another
  // tenant's or everyone's ("*").
  Result<std::vector<NamespaceStats>> ListNamespaces(const std::string& tenant = "");
  // Admin: starts reading back and checking every disk record (`start`), or
  // reports how the running (or last) verification is going.
  Result<VerifyStatus> VerifyDisk(bool start);
  Result<std::vector<TenantStats>> ListTenants();
  // Admin: starts writing every host block that is not on disk yet to the
  // disk tier. Returns how many writes were queued.
  Result<uint64_t> Flush();

 private:
  class Impl;
  explicit Client(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvtier
