// Server: kvtierd's event loop. One thread runs epoll over the listening
// socket, every session, a signalfd (SIGTERM/SIGINT stop, SIGHUP reloads) and
// an eventfd through which copy completions come back from the backend's
// threads; all request handling, the BlockCache and the tenant registry live
// on that thread, so none of them needs a lock.
//
// Shutdown (SIGTERM, SIGINT, or Stop()): stop accepting, close every session,
// wait for copies in flight to finish, then return from Run(). A backend
// that can copy no more (a lost GPU context: DeviceBackend::health) stops it
// the same way, host blocks written to disk, and Run() returns the error, so
// that kvtierd exits non-zero and its supervisor starts a new process.
//
// Run() on one thread; Stop() is thread-safe.
#pragma once

#include <array>
#include <chrono>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "common/fair_share_queue.h"
#include "common/mutex.h"
#include "common/serial_executor.h"
#include "common/unique_fd.h"
#include "config/config.h"
#include "config/config_loader.h"
#include "daemon/close_list.h"
#include "daemon/kv_event_source.h"
#include "daemon/load_rates.h"
#include "daemon/metrics.h"
#include "daemon/node_budget.h"
#include "daemon/session.h"
#include "daemon/startup_undo.h"
#include "daemon/tenants.h"
#include "daemon/turn_profile.h"
#include "ipc/wire.h"
#include "tiers/block_cache.h"
#include "tiers/disk/disk_tier.h"
#include "tiers/disk/io_engine.h"
#include "tiers/remote/remote_tier.h"

namespace kvtier {

class CodecPool;

class Server {
 public:
  struct Options {
    Config config;
    // Where the config came from, for SIGHUP reloads (unset: no reload).
    std::optional<ConfigSource> source;
    // Called once the socket is listening (e.g. to signal readiness).
    std::function<void()> on_ready;
    // The device backend (tests: a fake at the backend seam, STYLE.md);
    // null: the one device.backend names.
    std::unique_ptr<DeviceBackend> backend;
  };

  static Result<std::unique_ptr<Server>> Create(Options options);
  ~Server();

  Status Run();
  void Stop();

 private:
  explicit Server(Options options);

  // --- loop (server.cc)
  Status Setup();
  // The device backend device.backend names (auto: cuda when a GPU is usable).
  Status SetupBackend();
  Status SetupDisk();
  Status SetupRemote();
  // KV events (events.enabled): binds the publisher's sockets.
  Status SetupEvents();
  // Stops the loop once the backend says it can copy no more.
  void CheckBackend();
  // Records the turn's length; logs a slow one's profile.
  void EndTurn();
  void AcceptAll();
  // Puts a readable session in readable_ (once), under its tenant.
  void QueueReadable(Session& s);
  // Reads and handles queued sessions' requests in rounds of one request
  // per tenant (readable_: its sessions in turn), sessions that became
  // readable meanwhile joining each next round, at most kMaxRequestsPerTurn;
  // the rest wait for the next turn.
  void ServeReadable();
  // A session's epoll events (copied out: epoll_event is packed): writes
  // what its outbox holds, queues it to be read.
  void OnSessionEvent(uint64_t session, uint32_t events);
  // Reads and handles one request of `s` (epoll reports it again while it
  // has more).
  void ReadOneRequest(Session& s);
  void OnSessionWritable(Session& s);
  void CloseSession(uint64_t id, const char* why);
  // Closes the sessions marked in closing_: O(sessions marked).
  void CloseMarkedSessions();
  // Marks `s` to be closed once the current handler has returned.
  void MarkClosing(Session& s, const char* why) { closing_.Mark(s, why); }
  void Send(Session& s, std::vector<uint8_t> bytes);
  // Runs `fn` on the loop; `what` (static storage) names it in the profile
  // of a slow turn (TurnProfile).
  void Post(std::function<void()> fn, const char* what = "posted");
  // Makes the loop's wake descriptor readable: Run() turns and RunPosted.
  void Wake();
  void RunPosted();
  void OnSignal();
  void Reload();
  void ExpireWaits();
  void ExpireHellos();
  void ResumeAccepting();
  int NextTimeoutMs() const;

  // --- requests (handlers.cc dispatches; handlers_session.cc, handlers_data.cc, handlers_admin.cc)
  void Handle(Session& s, const wire::Message& msg, std::vector<UniqueFd> fds);
  std::vector<uint8_t> HandleHello(Session& s, uint64_t id, const wire::Hello& m);
  // The codec a registration asks for, if the tenant allows it and it fits
  // the layout. Errors: kPermissionDenied (not allowed), kInvalidArgument.
  static Result<CodecParams> CodecFor(const Tenant& tenant, const Layout& layout, const wire::RegisterKvCache& m);
  // A RegisterKvCache checked and charged, its regions being mapped on the
  // registrar thread.
  struct PendingRegistration {
    uint64_t session = 0;
    uint64_t request = 0;
    Layout layout;
    KvCacheLayout kv;
    CodecParams codec;
    std::vector<ClientRegionHandle> handles;  // moved into the backend's mapping
    std::vector<IpcEventHandle> events;
    MappedCharge charge;
    std::shared_ptr<CompletionPage> completions;
    std::shared_ptr<FencePage> fences;
    Result<std::shared_ptr<ClientMapping>> mapping;
  };
  // On the loop, once the regions are mapped: the namespace, and the reply.
  void FinishRegister(PendingRegistration& r);
  std::vector<uint8_t> HandleRegister(Session& s, uint64_t id, const wire::RegisterKvCache& m,
                                      std::vector<UniqueFd> fds);
  std::vector<uint8_t> HandleLookup(Session& s, uint64_t id, const wire::Lookup& m);
  std::vector<uint8_t> HandleHint(Session& s, uint64_t id, const wire::Hint& m);
  std::vector<uint8_t> HandlePrefetch(Session& s, uint64_t id, const wire::Prefetch& m);
  std::vector<uint8_t> HandleLoadOrStore(Session& s, uint64_t id, bool load,
                                         const wire::Load* l, const wire::Store* st);
  // No reply (an empty vector) unless refused.
  std::vector<uint8_t> HandleStoreLayers(Session& s, uint64_t id, const wire::StoreLayers& m);
  std::vector<uint8_t> HandleWaitOrPoll(Session& s, uint64_t id, uint64_t op,
                                        std::optional<uint32_t> timeout_ms);
  std::vector<uint8_t> HandleStats(Session& s, uint64_t id);
  std::vector<uint8_t> HandleEvict(Session& s, uint64_t id, const wire::Evict& m);
  // One of `t`'s Evict or ListNamespaces calls (limits.bulk_calls_per_second;
  // admins are not limited), or kResourceExhausted.
  Status TakeBulkCall(Tenant& t, std::string_view what);
  std::vector<uint8_t> HandleListTenants(Session& s, uint64_t id);
  std::vector<uint8_t> HandleListNamespaces(Session& s, uint64_t id, const wire::ListNamespaces& m);
  std::vector<uint8_t> HandleVerify(Session& s, uint64_t id, const wire::VerifyDisk& m);
  // Whose blocks a request names: the caller's (""), or, for an admin,
  // another tenant's or everyone's ("*" -> nullopt). `what` words errors.
  Result<std::optional<TenantId>> TargetTenant(const Session& s, const flatbuffers::String* name,
                                               std::string_view what);
  // --- metrics (handlers_admin.cc): a copy of the figures, made on the loop; and
  // the exporter's way to get one from its own thread (nullopt after 2 s).
  MetricsSnapshot Snapshot() const;
  std::optional<MetricsSnapshot> SnapshotFromLoop();
  void OnOpDone(uint64_t session_id, uint64_t op_id, OpOutcome outcome);
  std::vector<uint8_t> OpResultMessage(uint64_t id, uint64_t op, const SessionOp& o);
  Result<std::vector<StoredKey>> StoredKeys(const Session& s, const SessionNamespace& ns,
                                            const flatbuffers::Vector<const wire::Key*>* keys);
  // --- load or recompute (load_rates.h): the rates of `s`'s tenant's loads
  // into caches of `ns`'s layout. A tenant keeps those of at most
  // limits.max_namespaces_per_tenant layouts: a new one past that drops one
  // of its own. Async completions hold the key, never the entry.
  using RatesKey = std::pair<TenantId, LayoutFingerprint>;
  LoadRates& RatesOf(const Session& s, const SessionNamespace& ns);
  // A timing for `key`'s rates, if they are still kept.
  void ObserveLoad(const RatesKey& key, LoadSource source, uint64_t bytes, std::chrono::steady_clock::time_point start);
  // Of a lookup's local hits (`tiers`), how many to report to an engine that
  // computes `prefill_tokens_per_s`; the rest is counted as recomputed.
  uint32_t ChooseLocalHits(const Session& s, const SessionNamespace& ns, float prefill_tokens_per_s,
                           std::span<const Tier> tiers);
  // Hits left to compute by choice, counted as their tier's tokens.
  void CountRecomputed(LoadSource source, uint32_t blocks, uint32_t block_tokens);
  // Whether the remote tier is worth asking for the `tail` keys after the
  // local hits, were it to hold them all.
  bool RemoteWorthAsking(const Session& s, const SessionNamespace& ns, float prefill_tokens_per_s, uint32_t tail);

  Options options_;
  // What a failed Setup created is removed when the Server goes: declared
  // first, so it runs after every member that uses those files is gone.
  StartupUndo undo_;
  std::unique_ptr<DeviceBackend> backend_;
  // Maps registered memory off the loop (HandleRegister); results come back
  // through Post(). Reset before the backend.
  std::unique_ptr<SerialExecutor> registrar_;
  uint32_t registrations_inflight_ = 0;  // being mapped; a stop waits for them
  // Why the backend can copy no more (DeviceBackend::health), once it said
  // so: the loop then stops, and Run() returns it.
  Status backend_lost_;
  // The loop's turns (issue 32): where each went, their lengths, and those
  // past kSlowTurn (the longest a request should wait behind a turn).
  static constexpr std::chrono::milliseconds kSlowTurn{10};
  TurnProfile turn_;
  LatencyHistogram loop_turns_;
  uint64_t slow_turns_ = 0;
  std::chrono::steady_clock::time_point next_slow_turn_log_{};
  // Turns whose posted work ran past kPostedSlice and left the rest for the
  // next turn.
  uint64_t posted_deferred_ = 0;
  int hbm_device_ = 0;  // the GPU whose memory holds the hbm tier (cuda)
  // The disk tier's parts, destroyed after the cache (which uses them) and
  // in reverse order of use: tier, devices, engine.
  std::unique_ptr<IoEngine> io_engine_;
  std::vector<std::unique_ptr<BlockDevice>> disk_devices_;
  std::unique_ptr<DiskTier> disk_;
  // The remote tier (tiers.remote), destroyed after the cache that uses it.
  std::unique_ptr<RemoteTier> remote_;
  // The codec pool (tiers.compression; with a disk or remote tier), idle once the
  // cache is drained and destroyed after it.
  std::unique_ptr<CodecPool> codecs_;
  // KV events (null unless events.enabled): the cache's listener, so it
  // outlives the cache.
  std::unique_ptr<KvEventSource> events_;
  std::unique_ptr<BlockCache> cache_;
  std::unique_ptr<TenantRegistry> tenants_;
  // The node's limits shared by the tenants: sessions are taken at Hello,
  // maps and memory with each registration's MappedCharge.
  std::shared_ptr<NodeBudgets> node_;
  // Sessions with a request to read, one request each time, tenants by the
  // requests read for them (issue 46: one tenant's many sessions do not
  // crowd out another's one).
  FairShareQueue<uint64_t> readable_;
  UniqueFd epoll_;
  UniqueFd listen_;
  UniqueFd signal_fd_;
  UniqueFd wake_fd_;  // eventfd: posted closures or Stop()
  std::map<uint64_t, std::unique_ptr<Session>> sessions_;
  uint64_t next_session_id_ = 1;
  bool stopping_ = false;
  // When a stop stops writing host blocks to disk (tiers.disk.stop_flush_seconds).
  std::optional<std::chrono::steady_clock::time_point> stop_flush_until_;
  uint64_t sessions_refused_ = 0;
  uint64_t messages_rejected_ = 0;
  uint64_t ops_cancelled_ = 0;  // ops that ended with kCancelled (their client's fence)
  uint64_t loads_by_layer_ = 0;  // Load.by_layer ops started
  uint64_t stores_by_layer_ = 0;  // Store.by_layer ops started
  // Load or recompute: per tenant and layout; tokens left to compute by
  // choice, by the tier that held them.
  std::map<RatesKey, LoadRates> load_rates_;
  std::array<uint64_t, kNumLoadSources> recomputed_tokens_{};
  LatencyHistogram lookup_latency_;
  LatencyHistogram load_latency_;
  LatencyHistogram store_latency_;
  std::unique_ptr<MetricsExporter> metrics_;  // null when metrics.enabled is false
  std::shared_ptr<const VerifyProgress> verify_progress_;  // the last kvtierctl verify

  // Timed Waits still pending; each waiter holds its entry and erases it
  // when the Wait is answered, times out or its session closes.
  WaitDeadlines wait_deadlines_;
  GateDeadlines gate_deadlines_;
  uint64_t stores_by_layer_expired_ = 0;  // given up: not written whole in time
  CloseList closing_;  // sessions to close after the current handler
  // Sessions that must have said Hello by then (FIFO: deadlines only grow).
  std::deque<std::pair<std::chrono::steady_clock::time_point, uint64_t>> hello_deadlines_;
  size_t unauthenticated_ = 0;
  // Out of descriptors: accepting pauses until then instead of spinning.
  std::optional<std::chrono::steady_clock::time_point> accept_paused_until_;

  Mutex posted_mu_;
  std::deque<std::pair<const char*, std::function<void()>>> posted_ KVTIER_GUARDED_BY(posted_mu_);
  std::atomic<bool> stop_requested_{false};  // relaxed: the eventfd write orders it
};

}  // namespace kvtier
