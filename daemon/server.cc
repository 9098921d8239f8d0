#include "daemon/server.h"

#include <malloc.h>
#include <signal.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/signalfd.h>
#include <unistd.h>

#include <filesystem>

#include <spdlog/spdlog.h>

#include "common/check.h"
#include "daemon/logging.h"
#include "tiers/codec_pool.h"

namespace kvtier {
namespace {

// epoll data for the fixed descriptors; sessions use their id (>= kFirstSessionId).
constexpr uint64_t kListenTag = 1;
constexpr uint64_t kSignalTag = 2;
constexpr uint64_t kWakeTag = 3;
constexpr uint64_t kFirstSessionId = 16;
constexpr size_t kMaxOutbox = 4096;
// Requests read in one turn of the loop, at most (the rest wait for the
// next turn, behind timers and completions).
constexpr int kMaxRequestsPerTurn = 256;
// The readable_ flow of sessions that have not said Hello (tenant ids are
// 16-bit).
constexpr uint32_t kUnauthenticatedFlow = UINT32_MAX - 1;
// A connection must say Hello this soon, and at most this many may be
// waiting to: idle connections cannot exhaust the daemon's descriptors.
constexpr auto kHelloTimeout = std::chrono::seconds(10);
constexpr size_t kMaxUnauthenticated = NodeBudgets::kMaxUnauthenticated;
constexpr auto kAcceptPause = std::chrono::milliseconds(100);
// Posted work (completions, write-back pumps) runs for at most about this
// long a turn; the rest waits for the next turn, after the requests that
// arrived meanwhile, so a request waits behind one slice, not behind a
// burst of completions.
constexpr auto kPostedSlice = std::chrono::milliseconds(2);

Status EpollAdd(int epoll, int fd, uint32_t events, uint64_t tag) {
  epoll_event ev{};
  ev.events = events;
  ev.data.u64 = tag;
  if (::epoll_ctl(epoll, EPOLL_CTL_ADD, fd, &ev) != 0) return Status::FromErrno(errno, "epoll_ctl ADD");
  return Status::Ok();
}

// Gives the socket to group `gid` (socket.group): engines in it may
// connect, without being in the daemon's own group, which may read its
// config.
Status GiveSocketToGroup(const std::string& path, uint32_t gid) {
  if (::chown(path.c_str(), static_cast<uid_t>(-1), static_cast<gid_t>(gid)) != 0) {
    const int err = errno;
    return Status::FromErrno(err, "socket.group: giving " + path + " to gid " + std::to_string(gid) +
                                      (err == EPERM ? " (kvtierd must be root or a member of that group)" : ""));
  }
  return Status::Ok();
}

}  // namespace

Result<std::unique_ptr<Server>> Server::Create(Options options) {
  std::unique_ptr<Server> server(new Server(std::move(options)));
  KVTIER_RETURN_IF_ERROR(server->Setup());
  server->undo_.Commit();
  return server;
}

Server::Server(Options options) : options_(std::move(options)), next_session_id_(kFirstSessionId) {}

Server::~Server() {
  // No scrape may ask the loop for figures from here on.
  metrics_.reset();
  // A mapping still being made uses the backend; what it posted back is
  // dropped with posted_.
  registrar_.reset();
  {
    MutexLock lock(&posted_mu_);
    posted_.clear();
  }
  // Every copy must have finished before the cache (and its arenas) go.
  sessions_.clear();
  cache_.reset();
  remote_.reset();
  disk_.reset();
  disk_devices_.clear();
  io_engine_.reset();
  backend_.reset();
}

Status Server::Setup() {
  const Config& c = options_.config;
  // Signals are taken through a signalfd; block them before any thread starts
  // so that no worker thread receives them.
  sigset_t mask;
  sigemptyset(&mask);
  sigaddset(&mask, SIGTERM);
  sigaddset(&mask, SIGINT);
  sigaddset(&mask, SIGHUP);
  if (::pthread_sigmask(SIG_BLOCK, &mask, nullptr) != 0) return Internal("pthread_sigmask failed");
  ::signal(SIGPIPE, SIG_IGN);
  signal_fd_ = UniqueFd(::signalfd(-1, &mask, SFD_NONBLOCK | SFD_CLOEXEC));
  if (!signal_fd_) return Status::FromErrno(errno, "signalfd");

  KVTIER_RETURN_IF_ERROR(SetupBackend());
  registrar_ = std::make_unique<SerialExecutor>();
  spdlog::info("device backend: {}", backend_->Describe());
  if (c.tiers.disk.enabled) KVTIER_RETURN_IF_ERROR(SetupDisk());
  if (c.tiers.remote.enabled) KVTIER_RETURN_IF_ERROR(SetupRemote());
  // The codec pool: host, disk and remote tiers all hold coded blocks.
  if (c.tiers.compression.threads > 0) {
    KVTIER_ASSIGN_OR_RETURN(codecs_, CodecPool::Create({.threads = c.tiers.compression.threads,
                                                        .max_queued = c.tiers.compression.max_queued}));
  }


  KVTIER_ASSIGN_OR_RETURN(tenants_, TenantRegistry::Create(c));
  if (c.events.enabled) KVTIER_RETURN_IF_ERROR(SetupEvents());
  BlockCache::Options cache_options{
      .backend = backend_.get(),
      .post = [this](std::function<void()> fn) { Post(std::move(fn), "cache"); },
      .hbm_bytes = c.tiers.hbm.enabled ? c.tiers.hbm.bytes : 0,
      .hbm_device = hbm_device_,
      .host_bytes = c.tiers.host.bytes,
      .hbm_watermarks = {c.policy.watermarks.hbm.high, c.policy.watermarks.hbm.low},
      .host_watermarks = {c.policy.watermarks.host.high, c.policy.watermarks.host.low},
      .prefix_aware = c.policy.prefix_aware,
      .policy = c.policy.eviction == EvictionKind::kS3Fifo   ? PolicyKind::kS3Fifo
                : c.policy.eviction == EvictionKind::kClasses ? PolicyKind::kClasses
                                                              : PolicyKind::kLru,
      .hint_share = c.policy.hints.max_share,
      .eviction_scan_limit = 1024,
      .disk = disk_.get(),
      .disk_min_hits = c.policy.disk_admission.min_hits,
      .disk_admit_on_reuse = c.policy.disk_admission.reuse,
      .disk_admit_learned = c.policy.disk_admission.learned,
      .disk_promotion_min_hits = c.policy.disk_promotion_min_hits,
      .disk_write_budget_bytes_per_day =
          c.policy.disk_admission.write_budget_bytes_per_day.value_or(0),
      .disk_write_through = c.policy.write_policy == WritePolicy::kWriteThrough,
      .disk_max_writes_in_flight = std::max<uint32_t>(1024, 16 * c.tiers.disk.queue_depth),
      .max_namespaces = NamespaceTable::kMaxIds,
      .max_namespaces_per_tenant = c.limits.max_namespaces_per_tenant,
      .remote = remote_.get(),
      .listener = events_.get(),
      .codecs = codecs_.get(),
      .codec_staging_bytes = c.tiers.compression.staging_bytes,
      .remote_write = c.tiers.remote.write == RemoteWritePolicy::kOnDemote
                          ? BlockCache::Options::RemoteWrite::kOnDemote
                          : BlockCache::Options::RemoteWrite::kOnStore,
      .clock = nullptr};
  KVTIER_ASSIGN_OR_RETURN(cache_, BlockCache::Create(std::move(cache_options)));
  for (const auto& t : tenants_->tenants()) {
    cache_->SetQuota(t->id, TenantRegistry::QuotaOf(t->config));
    cache_->SetTenantName(t->id, t->config.name);
  }
  if (disk_) {
    const std::span<uint8_t> host = cache_->host_arena();
    if (Status st = io_engine_->RegisterBuffers(std::span(&host, 1)); !st.ok()) {
      spdlog::warn("disk I/O: the host pool is not registered for fixed-buffer I/O ({}); using plain I/O",
                   st.ToString());
    }
    std::vector<DiskRecord> records = disk_->TakeRecovered();
    if (events_) events_->Adopt(records);
    const uint64_t adopted = cache_->AdoptDiskRecords(std::move(records));
    // The recovered records were a large transient vector: hand the freed
    // heap back, so the daemon's memory is what the index really needs.
    ::malloc_trim(0);
    spdlog::info("disk tier: {} bytes on {} path(s); {} blocks warm from the index", disk_->capacity_bytes(),
                 disk_devices_.size(), adopted);
  }
  spdlog::info("tiers: hbm {} bytes, host {} bytes", cache_->Usage(Tier::kHbm).capacity_bytes,
               cache_->Usage(Tier::kHost).capacity_bytes);
  if (events_) {
    // What a restart holds: routers drop what they knew of this node.
    events_->Snapshot(*cache_);
    spdlog::info("KV events: {} block(s) with metadata announced after the start",
                 events_->counters().blocks_tracked);
  }

  epoll_ = UniqueFd(::epoll_create1(EPOLL_CLOEXEC));
  if (!epoll_) return Status::FromErrno(errno, "epoll_create1");
  wake_fd_ = UniqueFd(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  if (!wake_fd_) return Status::FromErrno(errno, "eventfd");

  // Metrics before the socket: a daemon that accepts clients serves metrics.
  if (c.metrics.enabled) {
    KVTIER_ASSIGN_OR_RETURN(metrics_,
                            MetricsExporter::Start(c.metrics.listen, [this] { return SnapshotFromLoop(); }));
    spdlog::info("metrics on http://{}/metrics", metrics_->address());
  }
  const std::filesystem::path dir = std::filesystem::path(c.socket.path).parent_path();
  if (!dir.empty()) {
    KVTIER_RETURN_IF_ERROR(undo_.CreateDirectories(dir.string()).WithContext("socket.path"));
  }
  KVTIER_ASSIGN_OR_RETURN(listen_, ipc::Listen(c.socket.path, c.socket.mode));
  if (c.socket.group) KVTIER_RETURN_IF_ERROR(GiveSocketToGroup(c.socket.path, *c.socket.group));
  KVTIER_RETURN_IF_ERROR(EpollAdd(epoll_.get(), listen_.get(), EPOLLIN, kListenTag));
  KVTIER_RETURN_IF_ERROR(EpollAdd(epoll_.get(), signal_fd_.get(), EPOLLIN, kSignalTag));
  KVTIER_RETURN_IF_ERROR(EpollAdd(epoll_.get(), wake_fd_.get(), EPOLLIN, kWakeTag));
  // The node's budgets, once everything of kvtierd's own is open (what it
  // maps and holds open now is its own).
  KVTIER_ASSIGN_OR_RETURN(const NodeLimits node, ReadNodeLimits(c.limits));
  node_ = std::make_shared<NodeBudgets>(node, c, tenants_->tenants().size());
  for (const NodeBudget* b : node_->all()) {
    spdlog::info("node budget: {}", b->Describe());
  }
  spdlog::info("listening on {} (mode {:04o}{}), {} tenant(s)", c.socket.path, c.socket.mode,
               c.socket.group ? ", gid " + std::to_string(*c.socket.group) : "", tenants_->tenants().size());
  return Status::Ok();
}

void Server::Stop() {
  stop_requested_.store(true, std::memory_order_relaxed);
  Wake();
}

void Server::Wake() {
  // A full eventfd counter (never in practice) still leaves it readable.
  const uint64_t one = 1;
  [[maybe_unused]] ssize_t n = ::write(wake_fd_.get(), &one, sizeof(one));
}

void Server::Post(std::function<void()> fn, const char* what) {
  {
    MutexLock lock(&posted_mu_);
    posted_.emplace_back(what, std::move(fn));
  }
  Wake();
}

void Server::RunPosted() {
  uint64_t count = 0;
  [[maybe_unused]] ssize_t n = ::read(wake_fd_.get(), &count, sizeof(count));
  std::deque<std::pair<const char*, std::function<void()>>> batch;
  {
    MutexLock lock(&posted_mu_);
    batch.swap(posted_);
  }
  const auto until = std::chrono::steady_clock::now() + kPostedSlice;
  while (!batch.empty()) {
    auto [what, fn] = std::move(batch.front());
    batch.pop_front();
    turn_.Time(what, fn);
    if (batch.empty() || std::chrono::steady_clock::now() < until) continue;
    // Slice used: the rest goes back ahead of what was posted meanwhile,
    // and the wake descriptor stays readable for the next turn.
    {
      MutexLock lock(&posted_mu_);
      posted_.insert(posted_.begin(), std::make_move_iterator(batch.begin()),
                     std::make_move_iterator(batch.end()));
    }
    ++posted_deferred_;
    Wake();
    break;
  }
}

int Server::NextTimeoutMs() const {
  std::optional<std::chrono::steady_clock::time_point> next;
  auto consider = [&](std::chrono::steady_clock::time_point t) {
    if (!next || t < *next) next = t;
  };
  if (!wait_deadlines_.empty()) consider(wait_deadlines_.begin()->first);
  if (!gate_deadlines_.empty()) consider(gate_deadlines_.begin()->first);
  if (!hello_deadlines_.empty()) consider(hello_deadlines_.front().first);
  if (accept_paused_until_) consider(*accept_paused_until_);
  if (!readable_.empty()) return 0;  // requests left from the last turn
  if (!next) return stopping_ ? 100 : -1;
  const auto until = *next - std::chrono::steady_clock::now();
  const auto ms = std::chrono::ceil<std::chrono::milliseconds>(until).count();
  return static_cast<int>(std::clamp<int64_t>(ms, 0, 60000));
}

Status Server::Run() {
  if (options_.on_ready) options_.on_ready();
  epoll_event events[64];
  while (true) {
    if (stop_requested_.load(std::memory_order_relaxed) && !stopping_) {
      stopping_ = true;
      // A running verify is no promise: it stops reading.
      cache_->CancelVerify();
      // Host blocks not on disk yet are written now, so that a clean restart
      // finds them warm (the loop below waits for those writes), for a
      // bounded time.
      const uint32_t flush_s = options_.config.tiers.disk.stop_flush_seconds;
      const uint64_t flushing = disk_ && flush_s > 0 ? cache_->FlushToDisk() : 0;
      stop_flush_until_ = std::chrono::steady_clock::now() + std::chrono::seconds(flush_s);
      spdlog::info("stopping: closing {} session(s), waiting for {} copies; writing {} host block(s) to disk",
                   sessions_.size(), cache_->inflight_copies(), flushing);
      ::epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, listen_.get(), nullptr);
      listen_.Reset();
      ::unlink(options_.config.socket.path.c_str());
      std::vector<uint64_t> ids;
      for (const auto& [id, s] : sessions_) ids.push_back(id);
      for (uint64_t id : ids) CloseSession(id, "daemon stopping");
    }
    if (stop_flush_until_ && std::chrono::steady_clock::now() >= *stop_flush_until_) {
      if (const uint64_t left = cache_->pending_disk_writes(); left > 0) {
        spdlog::warn(
            "stopping: {} host block(s) not written to disk within tiers.disk.stop_flush_seconds",
            left);
      }
      cache_->CancelFlush();
      stop_flush_until_.reset();
    }
    if (stopping_ && cache_->inflight_copies() == 0 && (!disk_ || disk_->inflight() == 0) &&
        registrations_inflight_ == 0) {
      break;
    }
    const int n = ::epoll_wait(epoll_.get(), events, 64, NextTimeoutMs());
    if (n < 0 && errno != EINTR) return Status::FromErrno(errno, "epoll_wait");
    turn_.Begin(std::chrono::steady_clock::now());
    for (int i = 0; i < n; ++i) {
      const uint64_t tag = events[i].data.u64;
      if (tag == kListenTag) {
        turn_.Time("accept", [&] { AcceptAll(); });
      } else if (tag == kSignalTag) {
        turn_.Time("signal", [&] { OnSignal(); });
      } else if (tag == kWakeTag) {
        RunPosted();  // each closure timed under the name it was posted with
      } else {
        OnSessionEvent(tag, events[i].events);
      }
      turn_.Time("close sessions", [&] { CloseMarkedSessions(); });
    }
    ServeReadable();
    turn_.Time("expire", [&] {
      ExpireWaits();
      ExpireHellos();
      ResumeAccepting();
      CloseMarkedSessions();
      CheckBackend();
    });
    EndTurn();
  }
  spdlog::info("stopped");
  return backend_lost_;
}

void Server::EndTurn() {
  const auto now = std::chrono::steady_clock::now();
  const auto length = turn_.Length(now);
  loop_turns_.Record(length);
  if (length < kSlowTurn) return;
  ++slow_turns_;
  // At most one line a second: a loop that is slow all the time says so
  // once a second, not once a turn.
  if (now < next_slow_turn_log_) return;
  next_slow_turn_log_ = now + std::chrono::seconds(1);
  spdlog::info("slow loop turn: {:.1f} ms, {:.1f} ms of it on a core ({} slow turn(s) so far): {}",
               std::chrono::duration<double, std::milli>(length).count(),
               std::chrono::duration<double, std::milli>(turn_.Cpu()).count(), slow_turns_, turn_.Describe());
}

void Server::CheckBackend() {
  if (!backend_lost_.ok()) return;
  Status health = backend_->health();
  if (health.ok()) return;
  spdlog::critical("device backend: {}; stopping (host blocks are written to disk) and exiting non-zero for the "
                   "supervisor to start kvtierd again",
                   health.ToString());
  backend_lost_ = std::move(health);
  Stop();
}

void Server::AcceptAll() {
  while (true) {
    Result<UniqueFd> fd = ipc::Accept(listen_.get());
    if (!fd) {
      const int err = fd.error().raw_code();
      if (err == EMFILE || err == ENFILE || err == ENOBUFS || err == ENOMEM) {
        // The pending connection stays queued and epoll would report it again
        // at once: stop listening for a moment instead of spinning.
        spdlog::warn("accept: {}; pausing new connections for {} ms", fd.error().message(), kAcceptPause.count());
        ::epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, listen_.get(), nullptr);
        accept_paused_until_ = std::chrono::steady_clock::now() + kAcceptPause;
      } else {
        spdlog::warn("accept: {}", fd.error().ToString());
      }
      return;
    }
    if (!fd->valid()) return;
    if (unauthenticated_ >= kMaxUnauthenticated) {
      spdlog::warn("refusing a connection: {} connections have not said Hello yet", unauthenticated_);
      continue;  // closing it is the refusal
    }
    Result<ipc::PeerCredentials> peer = ipc::GetPeerCredentials(fd->get());
    if (!peer) {
      spdlog::warn("peer credentials: {}", peer.error().ToString());
      continue;
    }
    auto s = std::make_unique<Session>(options_.config.limits.max_inflight_ops_per_session);
    s->id = next_session_id_++;
    s->fd = std::move(*fd);
    s->peer = *peer;
    if (Status st = EpollAdd(epoll_.get(), s->fd.get(), EPOLLIN, s->id); !st.ok()) {
      spdlog::warn("session: {}", st.ToString());
      continue;
    }
    spdlog::debug("session {}: connected, pid {} uid {} gid {}", s->id, peer->pid, peer->uid, peer->gid);
    ++unauthenticated_;
    hello_deadlines_.emplace_back(std::chrono::steady_clock::now() + kHelloTimeout, s->id);
    sessions_.emplace(s->id, std::move(s));
  }
}

void Server::ResumeAccepting() {
  if (!accept_paused_until_ || std::chrono::steady_clock::now() < *accept_paused_until_) return;
  accept_paused_until_.reset();
  if (listen_.valid()) {
    if (Status st = EpollAdd(epoll_.get(), listen_.get(), EPOLLIN, kListenTag); !st.ok()) {
      spdlog::error("resuming accept: {}", st.ToString());
    }
  }
}

void Server::ExpireHellos() {
  const auto now = std::chrono::steady_clock::now();
  while (!hello_deadlines_.empty() && hello_deadlines_.front().first <= now) {
    auto it = sessions_.find(hello_deadlines_.front().second);
    hello_deadlines_.pop_front();
    if (it != sessions_.end() && it->second->tenant == nullptr)
      MarkClosing(*it->second, "no Hello in time");
  }
}

void Server::QueueReadable(Session& s) {
  if (s.readable_queued || s.close_reason() != nullptr) return;
  s.readable_queued = true;
  readable_.Push(s.tenant != nullptr ? s.tenant->id : kUnauthenticatedFlow, /*cost=*/1, s.id);
}

void Server::ServeReadable() {
  for (int served = 0; served < kMaxRequestsPerTurn;) {
    // A round: one request of each tenant queued.
    for (size_t n = readable_.active_flows(); n > 0 && served < kMaxRequestsPerTurn; --n, ++served) {
      const std::optional<uint64_t> id = readable_.Pop();
      auto it = sessions_.find(*id);
      if (it == sessions_.end()) continue;  // closed since it was queued
      Session& s = *it->second;
      s.readable_queued = false;
      ReadOneRequest(s);
      turn_.Time("close sessions", [&] { CloseMarkedSessions(); });
    }
    // Sessions with more to read, and those that became readable meanwhile,
    // join the next round (epoll is level-triggered): a tenant whose request
    // arrives now waits behind one request of each other tenant, not behind
    // the rest of this turn. Everything else epoll reports waits for the
    // next turn.
    epoll_event events[64];
    const int k = ::epoll_wait(epoll_.get(), events, 64, 0);
    for (int i = 0; i < k; ++i) {
      const uint64_t tag = events[i].data.u64;
      if (tag >= kFirstSessionId) OnSessionEvent(tag, events[i].events);
    }
    if (readable_.empty()) return;
  }
}

void Server::OnSessionEvent(uint64_t session, uint32_t events) {
  auto it = sessions_.find(session);
  if (it == sessions_.end()) return;
  Session& s = *it->second;
  if (events & EPOLLOUT) turn_.Time("write", [&] { OnSessionWritable(s); });
  // Read in ServeReadable, tenants in turn; each request is timed by its
  // type, in Handle.
  if (events & (EPOLLIN | EPOLLHUP | EPOLLERR)) QueueReadable(s);
}

void Server::ReadOneRequest(Session& s) {
  if (s.close_reason() != nullptr) return;
  Result<ipc::ReceivedMessage> m = ipc::ReceiveMessage(s.fd.get(), options_.config.limits.max_message_bytes);
  if (!m) {
    if (m.error().code() != StatusCode::kUnavailable) MarkClosing(s, "receive failed");
    return;
  }
  if (m->eof) {
    MarkClosing(s, "client closed the connection");
    return;
  }
  if (m->truncated) {
    ++messages_rejected_;
    Send(s, ipc::ErrorMessage(0, InvalidArgument("message larger than limits.max_message_bytes (" +
                                                 std::to_string(options_.config.limits.max_message_bytes) +
                                                 ") or with too many descriptors")));
    MarkClosing(s, "oversized message");
    return;
  }
  Result<const wire::Message*> msg = ipc::VerifyMessage(m->bytes);
  if (!msg) {
    ++messages_rejected_;
    Send(s, ipc::ErrorMessage(0, msg.error()));
    MarkClosing(s, "malformed message");
    return;
  }
  Handle(s, **msg, std::move(m->fds));
}

void Server::Send(Session& s, std::vector<uint8_t> bytes) {
  // Sessions about to close still send: the reply may explain the close.
  if (bytes.empty()) return;
  if (s.outbox.empty()) {
    const Status st = ipc::SendMessage(s.fd.get(), bytes);
    if (st.ok()) return;
    if (st.code() != StatusCode::kUnavailable) {
      MarkClosing(s, "send failed");
      return;
    }
  }
  if (s.outbox.size() >= kMaxOutbox) {
    MarkClosing(s, "client does not read its replies");
    return;
  }
  s.outbox.push_back(std::move(bytes));
  if (!s.want_write) {
    epoll_event ev{};
    ev.events = EPOLLIN | EPOLLOUT;
    ev.data.u64 = s.id;
    ::epoll_ctl(epoll_.get(), EPOLL_CTL_MOD, s.fd.get(), &ev);
    s.want_write = true;
  }
}

void Server::OnSessionWritable(Session& s) {
  while (!s.outbox.empty()) {
    const Status st = ipc::SendMessage(s.fd.get(), s.outbox.front());
    if (st.code() == StatusCode::kUnavailable) return;
    if (!st.ok()) {
      MarkClosing(s, "send failed");
      return;
    }
    s.outbox.pop_front();
  }
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = s.id;
  ::epoll_ctl(epoll_.get(), EPOLL_CTL_MOD, s.fd.get(), &ev);
  s.want_write = false;
}

void Server::CloseMarkedSessions() {
  if (closing_.empty()) return;
  for (uint64_t id : closing_.Take()) {
    // Gone already if it was closed another way (a stop closes every session).
    if (auto it = sessions_.find(id); it != sessions_.end())
      CloseSession(id, it->second->close_reason());
  }
}

void Server::CloseSession(uint64_t id, const char* why) {
  auto it = sessions_.find(id);
  if (it == sessions_.end()) return;
  Session& s = *it->second;
  // Flush what fits (e.g. the error that explains the close).
  while (!s.outbox.empty() && ipc::SendMessage(s.fd.get(), s.outbox.front()).ok()) s.outbox.pop_front();
  ::epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, s.fd.get(), nullptr);
  if (s.tenant != nullptr) {
    --s.tenant->sessions;
    node_->sessions.Give(s.tenant->id, 1);
  } else {
    --unauthenticated_;
  }
  spdlog::info("session {} ({}{}): closed: {}; {} op(s) in flight are abandoned", id,
               s.tenant != nullptr ? s.tenant->config.name : "unauthenticated",
               s.client_name.empty() ? "" : ", " + s.client_name, why, s.ops.in_flight());
  // Its pending Waits go with it, and so do their deadlines.
  s.ops.ForEach([this](SessionOp& o) {
    for (const OpWaiter& w : o.waiters) {
      if (w.deadline) wait_deadlines_.erase(*w.deadline);
    }
    // A store by layer not written whole aborts with its gate, which the
    // session's ops hold.
    if (o.gate_deadline) gate_deadlines_.erase(*o.gate_deadline);
  });
  // Dropping the session drops `alive` (so its in-flight stores are discarded
  // when they finish) and its namespaces; each mapping goes once the last
  // copy that uses it is done.
  sessions_.erase(it);
}

void Server::ExpireWaits() {
  const auto now = std::chrono::steady_clock::now();
  while (!gate_deadlines_.empty() && gate_deadlines_.begin()->first <= now) {
    // Its op, running (one that is over, or whose session closed, took
    // its entry along).
    const PendingGate g = gate_deadlines_.begin()->second;
    gate_deadlines_.erase(gate_deadlines_.begin());
    auto sit = sessions_.find(g.session);
    KVTIER_CHECK(sit != sessions_.end());
    Result<SessionOp*> op = sit->second->ops.Find(g.op);
    KVTIER_CHECK(op && !(*op)->done && (*op)->gate != nullptr);
    (*op)->gate_deadline.reset();
    if ((*op)->gate->open() < (*op)->gate->layers()) {
      ++stores_by_layer_expired_;
      (*op)->gate->Abort();
    }
  }
  while (!wait_deadlines_.empty() && wait_deadlines_.begin()->first <= now) {
    const WaitDeadlines::iterator entry = wait_deadlines_.begin();
    const PendingWait w = entry->second;
    // The waiter that holds this entry (matched by entry: a client may reuse
    // request ids) goes with it. Closed sessions and finished ops took their
    // waiters' entries along, so it is there.
    Session* s = nullptr;
    bool found = false;
    if (auto sit = sessions_.find(w.session); sit != sessions_.end()) {
      s = sit->second.get();
      if (Result<SessionOp*> op = s->ops.Find(w.op); op) {
        auto& waiters = (*op)->waiters;
        auto wit = std::find_if(waiters.begin(), waiters.end(),
                                [&](const OpWaiter& x) { return x.deadline == entry; });
        if (wit != waiters.end()) {
          waiters.erase(wit);
          found = true;
        }
      }
    }
    wait_deadlines_.erase(entry);
    if (!found) continue;
    SessionOp timed_out;
    timed_out.outcome.status = Status(StatusCode::kDeadlineExceeded, "op still running");
    Send(*s, OpResultMessage(w.request, w.op, timed_out));
  }
}

void Server::OnSignal() {
  signalfd_siginfo info{};
  while (::read(signal_fd_.get(), &info, sizeof(info)) == sizeof(info)) {
    if (info.ssi_signo == SIGHUP) {
      Reload();
    } else {
      spdlog::info("signal {}: shutting down", info.ssi_signo);
      stop_requested_.store(true, std::memory_order_relaxed);
    }
  }
}

void Server::Reload() {
  if (!options_.source) {
    spdlog::warn("SIGHUP: no config source to reload");
    return;
  }
  Result<Config> fresh = LoadConfig(*options_.source);
  if (!fresh) {
    spdlog::error("SIGHUP: config not reloaded, it is invalid:\n{}", fresh.error().message());
    return;
  }
  const Config& c = *fresh;
  cache_->SetWatermarks({c.policy.watermarks.hbm.high, c.policy.watermarks.hbm.low},
                        {c.policy.watermarks.host.high, c.policy.watermarks.host.low});
  if (disk_) disk_->SetWatermarks(c.policy.watermarks.disk.high, c.policy.watermarks.disk.low);
  std::vector<std::string> need_restart = tenants_->Reload(c);
  if (!(c.events == options_.config.events)) need_restart.push_back("events");
  for (const std::string& what : need_restart) {
    spdlog::warn("SIGHUP: {} changed; that takes a restart", what);
  }
  for (const auto& t : tenants_->tenants()) cache_->SetQuota(t->id, TenantRegistry::QuotaOf(t->config));
  SetLogLevel(c.log.level);
  options_.config.policy.watermarks = c.policy.watermarks;
  options_.config.log.level = c.log.level;
  spdlog::info("SIGHUP: reloaded watermarks, quotas and log level ({})", LogLevelName(c.log.level));
}

}  // namespace kvtier
