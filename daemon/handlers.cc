// Server's request handlers: one per message type. Each validates every count,
// index and length it reads from the (already verified) message before use,
// and answers with a reply or an Error; a handler that returns no bytes has
// deferred its reply (Wait, Load/Store with wait=true, a Lookup/Prefetch
// waiting on the remote tier, or a RegisterKvCache being mapped). Past 800
// lines on purpose: every request's validation sits with its handler, one per
// message type, in one place.
#include <spdlog/spdlog.h>

#include <algorithm>
#include <future>

#include "common/chain_hash.h"
#include "common/version.h"
#include "daemon/server.h"
#include "tiers/disk/record.h"
#include "devices/host_backend.h"

namespace kvtier {

namespace w = wire;
using flatbuffers::FlatBufferBuilder;

namespace {

constexpr size_t kMaxRegions = 1024;
// IPC events one cache may register (a client needs one per op in flight
// that an engine stream waits on).
constexpr size_t kMaxCudaEvents = 64;
constexpr size_t kMaxNamespacesPerSession = 64;
constexpr size_t kMaxClientNameBytes = 128;
constexpr size_t kMaxTokenBytes = 4096;
constexpr size_t kMaxWaitersPerOp = 8;

w::Tier TierToWire(Tier t) {
  switch (t) {
    case Tier::kHbm: return w::Tier::Hbm;
    case Tier::kHost: return w::Tier::Host;
    case Tier::kDisk: return w::Tier::Disk;
  }
  return w::Tier::None;
}

}  // namespace

void Server::Handle(Session& s, const w::Message& msg, std::vector<UniqueFd> fds) {
  const uint64_t id = msg.id();
  if (s.tenant == nullptr && msg.body_type() != w::Body::Hello) {
    Send(s, ipc::ErrorMessage(id, Status(StatusCode::kUnauthenticated, "send Hello first")));
    MarkClosing(s, "request before Hello");
    return;
  }
  if (!fds.empty() && msg.body_type() != w::Body::RegisterKvCache) {
    // The descriptors are closed when `fds` goes; the request itself is fine.
    spdlog::debug("session {}: ignoring {} descriptor(s) sent with a {}", s.id, fds.size(),
                  w::EnumNameBody(msg.body_type()));
  }
  const auto start = std::chrono::steady_clock::now();
  std::vector<uint8_t> reply;
  switch (msg.body_type()) {
    case w::Body::Hello:
      reply = HandleHello(s, id, *msg.body_as_Hello());
      break;
    case w::Body::RegisterKvCache:
      reply = HandleRegister(s, id, *msg.body_as_RegisterKvCache(), std::move(fds));
      break;
    case w::Body::Lookup:
      reply = HandleLookup(s, id, *msg.body_as_Lookup());
      break;
    case w::Body::Prefetch:
      reply = HandlePrefetch(s, id, *msg.body_as_Prefetch());
      break;
    case w::Body::Hint:
      reply = HandleHint(s, id, *msg.body_as_Hint());
      break;
    case w::Body::Load:
      reply = HandleLoadOrStore(s, id, true, msg.body_as_Load(), nullptr);
      break;
    case w::Body::Store:
      reply = HandleLoadOrStore(s, id, false, nullptr, msg.body_as_Store());
      break;
    case w::Body::Wait:
      reply = HandleWaitOrPoll(s, id, msg.body_as_Wait()->op(), msg.body_as_Wait()->timeout_ms());
      break;
    case w::Body::Poll:
      reply = HandleWaitOrPoll(s, id, msg.body_as_Poll()->op(), std::nullopt);
      break;
    case w::Body::Stats:
      reply = HandleStats(s, id);
      break;
    case w::Body::Evict:
      reply = HandleEvict(s, id, *msg.body_as_Evict());
      break;
    case w::Body::Flush:
      if (!s.tenant->config.admin) {
        reply = ipc::ErrorMessage(id, Status(StatusCode::kPermissionDenied, "flush is an admin call"));
      } else if (!disk_) {
        reply = ipc::ErrorMessage(id, Status(StatusCode::kFailedPrecondition, "flush: there is no disk tier"));
      } else {
        FlatBufferBuilder b(64);
        reply = ipc::FinishMessage(b, id, w::CreateFlushReply(b, cache_->FlushToDisk()));
      }
      break;
    case w::Body::ListTenants:
      reply = HandleListTenants(s, id);
      break;
    case w::Body::ListNamespaces:
      reply = HandleListNamespaces(s, id, *msg.body_as_ListNamespaces());
      break;
    case w::Body::VerifyDisk:
      reply = HandleVerify(s, id, *msg.body_as_VerifyDisk());
      break;
    default:
      ++messages_rejected_;
      reply = ipc::ErrorMessage(id, InvalidArgument(std::string("not a request: ") +
                                                    w::EnumNameBody(msg.body_type())));
      break;
  }
  Send(s, std::move(reply));
  turn_.Add(w::EnumNameBody(msg.body_type()), std::chrono::steady_clock::now() - start);
}

std::vector<uint8_t> Server::HandleHello(Session& s, uint64_t id, const w::Hello& m) {
  if (s.tenant != nullptr) return ipc::ErrorMessage(id, InvalidArgument("Hello was already sent"));
  if (m.version() != ipc::kProtocolVersion) {
    MarkClosing(s, "protocol version mismatch");
    return ipc::ErrorMessage(id, Status(StatusCode::kFailedPrecondition,
                                        "protocol version " + std::to_string(m.version()) +
                                            " is not supported; kvtierd speaks " +
                                            std::to_string(ipc::kProtocolVersion) + " (release " + kVersion +
                                            ")"));
  }
  if ((m.token() != nullptr && m.token()->size() > kMaxTokenBytes) ||
      (m.client_name() != nullptr && m.client_name()->size() > kMaxClientNameBytes)) {
    MarkClosing(s, "oversized Hello");
    return ipc::ErrorMessage(id, InvalidArgument("token or client name too long"));
  }
  std::optional<std::string_view> token;
  if (m.token() != nullptr && m.token()->size() > 0) token = m.token()->string_view();
  Result<Tenant*> tenant = tenants_->Authenticate(s.peer, token);
  if (!tenant) {
    ++sessions_refused_;
    spdlog::warn("session {}: refused: {}", s.id, tenant.error().message());
    MarkClosing(s, "unauthenticated");
    return ipc::ErrorMessage(id, tenant.error());
  }
  Tenant& t = **tenant;
  if (t.sessions >= options_.config.limits.max_sessions_per_tenant) {
    ++sessions_refused_;
    MarkClosing(s, "too many sessions");
    return ipc::ErrorMessage(id, Status(StatusCode::kResourceExhausted,
                                        "tenant " + t.config.name + " has reached limits.max_sessions_per_tenant"));
  }
  s.tenant = &t;
  ++t.sessions;
  --unauthenticated_;
  if (m.client_name() != nullptr) s.client_name = m.client_name()->str();
  spdlog::info("session {}: tenant {} (pid {}{})", s.id, t.config.name, s.peer.pid,
               s.client_name.empty() ? "" : ", " + s.client_name);
  const Config::Limits& l = options_.config.limits;
  FlatBufferBuilder b(512);
  const auto secret = b.CreateVector(t.hash_secret.bytes().data(), t.hash_secret.bytes().size());
  const auto body = w::CreateWelcome(b, ipc::kProtocolVersion, b.CreateString(t.config.name), s.id,
                                     secret, l.max_message_bytes, l.max_keys_per_request,
                                     l.max_inflight_ops_per_session, b.CreateString(backend_->name()),
                                     b.CreateString(kVersion));
  return ipc::FinishMessage(b, id, body);
}

std::vector<uint8_t> Server::HandleRegister(Session& s, uint64_t id, const w::RegisterKvCache& m,
                                            std::vector<UniqueFd> fds) {
  if (s.registering) {
    return ipc::ErrorMessage(id, Status(StatusCode::kFailedPrecondition,
                                        "a RegisterKvCache of this session is still in progress: wait for its reply"));
  }
  if (s.namespaces.size() >= kMaxNamespacesPerSession) {
    return ipc::ErrorMessage(id, Status(StatusCode::kResourceExhausted, "too many registered KV caches"));
  }
  Result<Layout> layout = ipc::LayoutFromWire(m.layout());
  if (!layout) return ipc::ErrorMessage(id, layout.error());
  if (disk_ && RecordBytes(layout->block_bytes()) > disk_->max_record_bytes()) {
    // Such a block could never be written to disk: refused now, not at
    // every demotion.
    return ipc::ErrorMessage(
        id,
        InvalidArgument(
            "a block of this layout (" + std::to_string(layout->block_bytes()) + " bytes, " +
            std::to_string(RecordBytes(layout->block_bytes())) +
            " on disk with its header) is larger than a disk region (tiers.disk.region_bytes = " +
            std::to_string(disk_->max_record_bytes()) + "); raise tiers.disk.region_bytes"));
  }
  Result<CodecParams> codec = CodecFor(*s.tenant, *layout, m);
  if (!codec) return ipc::ErrorMessage(id, codec.error());
  const auto* regions = m.regions();
  if (regions == nullptr || regions->size() == 0 || regions->size() > kMaxRegions) {
    return ipc::ErrorMessage(id, InvalidArgument("RegisterKvCache needs 1 to " + std::to_string(kMaxRegions) +
                                                 " regions"));
  }
  std::vector<ClientRegionHandle> handles;
  std::vector<uint64_t> sizes;
  std::vector<bool> fd_used(fds.size(), false);
  for (size_t i = 0; i < regions->size(); ++i) {
    const w::MemoryRegion& r = *regions->Get(static_cast<flatbuffers::uoffset_t>(i));
    ClientRegionHandle h;
    h.size_bytes = r.size_bytes();
    if (r.kind() == w::MemoryKind::HostMemfd) {
      const int idx = r.fd_index();
      if (idx < 0 || static_cast<size_t>(idx) >= fds.size() || fd_used[static_cast<size_t>(idx)]) {
        return ipc::ErrorMessage(id, InvalidArgument("region " + std::to_string(i) +
                                                     ": fd_index does not name an unused descriptor"));
      }
      fd_used[static_cast<size_t>(idx)] = true;
      h.kind = ClientMemoryKind::kHostMemfd;
      h.memfd = std::move(fds[static_cast<size_t>(idx)]);
    } else if (r.kind() == w::MemoryKind::CudaIpc) {
      if (r.cuda_ipc_handle() == nullptr || r.cuda_ipc_handle()->size() != ClientRegionHandle::kCudaIpcHandleBytes) {
        return ipc::ErrorMessage(id, InvalidArgument("region " + std::to_string(i) +
                                                     ": a CUDA IPC handle is 64 bytes"));
      }
      h.kind = ClientMemoryKind::kCudaIpc;
      h.owner = s.tenant->config.name;
      std::copy(r.cuda_ipc_handle()->begin(), r.cuda_ipc_handle()->end(), h.cuda_ipc_handle.begin());
      h.cuda_offset = r.cuda_offset();
      h.device = r.device();
      if (r.device_uuid() != nullptr) {
        if (r.device_uuid()->size() != h.device_uuid.size()) {
          return ipc::ErrorMessage(id, InvalidArgument("region " + std::to_string(i) +
                                                       ": a device UUID is 16 bytes"));
        }
        std::copy(r.device_uuid()->begin(), r.device_uuid()->end(), h.device_uuid.begin());
        h.has_device_uuid = true;
      }
    } else {
      return ipc::ErrorMessage(id, InvalidArgument("region " + std::to_string(i) + ": unknown memory kind"));
    }
    sizes.push_back(h.size_bytes);
    handles.push_back(std::move(h));
  }
  std::vector<Placement> placements;
  if (m.placements() != nullptr) {
    for (const w::Placement* p : *m.placements()) placements.push_back(ipc::PlacementFromWire(*p));
  }
  Result<KvCacheLayout> kv = KvCacheLayout::Create(*layout, m.num_blocks(), std::move(placements), sizes);
  if (!kv) return ipc::ErrorMessage(id, kv.error());
  // A memfd is mapped only as far as the placements reach (a sealed memfd of
  // any size, mostly holes, costs what the cache uses); then the tenant's
  // budget of maps and bytes is charged, before anything is mapped.
  const std::vector<uint64_t> needed = KvCacheLayout::MinRegionSizes(*layout, m.num_blocks(), kv->placements());
  uint64_t charged_bytes = 0;
  for (size_t i = 0; i < handles.size(); ++i) {
    if (handles[i].kind == ClientMemoryKind::kHostMemfd) {
      handles[i].size_bytes = std::min(handles[i].size_bytes, AlignUpToPage(needed[i]));
    }
    charged_bytes += handles[i].size_bytes;
  }
  uint64_t pages = 0;
  for (const auto& [index, bytes] : {std::pair{m.completion_fd_index(), CompletionPage::kBytes},
                                     std::pair{m.fence_fd_index(), FencePage::kBytes}}) {
    if (index < 0) continue;
    ++pages;
    charged_bytes += bytes;
  }
  Result<MappedCharge> charge =
      MappedCharge::Take(*s.tenant, options_.config.limits, handles.size() + pages, charged_bytes);
  if (!charge) return ipc::ErrorMessage(id, charge.error());
  std::vector<IpcEventHandle> events;
  if (m.cuda_events() != nullptr) {
    if (m.cuda_events()->size() > kMaxCudaEvents) {
      return ipc::ErrorMessage(id, InvalidArgument("at most " + std::to_string(kMaxCudaEvents) +
                                                   " CUDA events per KV cache"));
    }
    for (const w::CudaEventHandle* e : *m.cuda_events()) {
      IpcEventHandle& h = events.emplace_back();
      std::copy(e->bytes()->begin(), e->bytes()->end(), h.begin());
    }
  }
  // A page sent with the message (`index` -1: none): the client's memfd,
  // mapped shared.
  auto map_page = [&](int index, const char* what, size_t bytes) -> Result<std::optional<MemoryMapping>> {
    if (index < 0) return std::optional<MemoryMapping>();
    if (static_cast<size_t>(index) >= fds.size() || fd_used[static_cast<size_t>(index)]) {
      return Err(InvalidArgument(std::string(what) + ": its fd index does not name an unused descriptor"));
    }
    fd_used[static_cast<size_t>(index)] = true;
    ClientRegionHandle page;
    page.kind = ClientMemoryKind::kHostMemfd;
    page.size_bytes = bytes;
    page.memfd = std::move(fds[static_cast<size_t>(index)]);
    KVTIER_ASSIGN_OR_RETURN(MemoryMapping mapped, HostBackend::MapSealedMemfd(page, what));
    return std::optional<MemoryMapping>(std::move(mapped));
  };
  std::shared_ptr<CompletionPage> completions;
  std::shared_ptr<FencePage> fences;
  {
    Result<std::optional<MemoryMapping>> page =
        map_page(m.completion_fd_index(), "the completion page", CompletionPage::kBytes);
    if (!page) return ipc::ErrorMessage(id, page.error());
    if (*page) completions = std::make_shared<CompletionPage>(std::move(**page));
    page = map_page(m.fence_fd_index(), "the fence page", FencePage::kBytes);
    if (!page) return ipc::ErrorMessage(id, page.error());
    if (*page) fences = std::make_shared<FencePage>(std::move(**page));
  }
  // Mapping may take long (cuda: pinning a CPU engine's whole cache, opening
  // IPC handles): it runs on the registrar thread, and the reply goes once
  // it ends; the loop serves every other request meanwhile.
  auto r = std::make_shared<PendingRegistration>(PendingRegistration{
      .session = s.id,
      .request = id,
      .layout = std::move(*layout),
      .kv = std::move(*kv),
      .codec = *codec,
      .handles = std::move(handles),
      .events = std::move(events),
      .charge = std::move(*charge),
      .completions = std::move(completions),
      .fences = std::move(fences),
      .mapping = Err(Internal("not mapped yet"))});
  s.registering = true;
  ++registrations_inflight_;
  registrar_->Post([this, r]() mutable {
    r->mapping = backend_->MapClientMemory(std::move(r->handles), std::move(r->events));
    // Finished (and destroyed) on the loop, which owns the session and the
    // tenant's charge.
    Post([this, r = std::move(r)] { FinishRegister(*r); }, "registration");
  });
  return {};
}

void Server::FinishRegister(PendingRegistration& r) {
  --registrations_inflight_;
  auto it = sessions_.find(r.session);
  if (it == sessions_.end()) return;  // closed meanwhile: the mapping and its charge go with `r`
  Session& s = *it->second;
  s.registering = false;
  if (!r.mapping) {
    Send(s, ipc::ErrorMessage(r.request, r.mapping.error()));
    return;
  }
  std::shared_ptr<ClientMapping> mapping = std::move(r.charge).Hold(std::move(*r.mapping));
  const uint32_t ns_id = s.next_namespace_id++;
  const uint32_t num_blocks = r.kv.num_blocks();
  auto shared_layout = std::make_shared<const KvCacheLayout>(std::move(r.kv));
  const LayoutFingerprint fingerprint = CodedFingerprint(r.layout.fingerprint(), r.codec);
  s.namespaces[ns_id] = SessionNamespace{shared_layout,      std::move(mapping), std::move(r.completions),
                                         std::move(r.fences), r.codec,            fingerprint};
  spdlog::info("session {}: registered KV cache {}: {} blocks, {}, codec {}", s.id, ns_id, num_blocks,
               r.layout.ToString(), CodecName(r.codec.kind));
  FlatBufferBuilder b(128);
  const w::Key fp = ipc::ToWire(fingerprint);
  const auto body = w::CreateRegistered(b, ns_id, &fp, r.layout.block_bytes(), static_cast<w::Codec>(r.codec.kind),
                                        r.codec.group_elems);
  Send(s, ipc::FinishMessage(b, r.request, body));
}

Result<CodecParams> Server::CodecFor(const Tenant& tenant, const Layout& layout, const w::RegisterKvCache& m) {
  const auto kind = static_cast<CodecKind>(m.codec());
  if (kind != CodecKind::kNone && kind != CodecKind::kLossless && kind != CodecKind::kFp8) {
    return Err(InvalidArgument("unknown codec " + std::to_string(static_cast<int>(m.codec()))));
  }
  const std::vector<CodecKind>& allowed = tenant.config.codecs;
  if (std::find(allowed.begin(), allowed.end(), kind) == allowed.end()) {
    return Err(Status(StatusCode::kPermissionDenied,
                      "codec " + std::string(CodecName(kind)) + " is not allowed for tenant " + tenant.config.name +
                          " (tenants[].codecs)"));
  }
  const LayoutSpec& spec = layout.spec();
  CodecParams p{.kind = kind, .dtype = spec.dtype, .group_elems = 0};
  if (kind == CodecKind::kFp8) {
    if (spec.kv_kind == KvKind::kLatent) {
      return Err(InvalidArgument("fp8 is for K and V caches; an MLA latent cache takes none or lossless"));
    }
    p.group_elems = m.codec_group() == 0 ? spec.head_dim : m.codec_group();
  } else if (m.codec_group() != 0) {
    return Err(InvalidArgument("codec_group is for fp8 only"));
  }
  if (Status st = CheckCodec(p); !st.ok()) return Err(st);
  return p;
}

Result<std::vector<StoredKey>> Server::StoredKeys(const Session& s, const SessionNamespace& ns,
                                                  const flatbuffers::Vector<const w::Key*>* keys) {
  const size_t n = keys == nullptr ? 0 : keys->size();
  if (n > options_.config.limits.max_keys_per_request) {
    return Err(InvalidArgument(std::to_string(n) + " keys exceed limits.max_keys_per_request (" +
                               std::to_string(options_.config.limits.max_keys_per_request) + ")"));
  }
  std::vector<StoredKey> out;
  out.reserve(n);
  const LayoutFingerprint& fp = ns.fingerprint;
  for (size_t i = 0; i < n; ++i) {
    out.push_back(DeriveStoredKey(s.tenant->salt, fp,
                                  ipc::FromWire<BlockKey>(*keys->Get(static_cast<flatbuffers::uoffset_t>(i)))));
  }
  return out;
}

namespace {
Result<const SessionNamespace*> FindNamespace(const Session& s, uint32_t ns_id) {
  auto it = s.namespaces.find(ns_id);
  if (it == s.namespaces.end()) {
    return Err(Status(StatusCode::kNotFound, "namespace " + std::to_string(ns_id) + " is not registered"));
  }
  return &it->second;
}
}  // namespace

std::vector<uint8_t> Server::HandleHint(Session& s, uint64_t id, const w::Hint& m) {
  Result<const SessionNamespace*> ns = FindNamespace(s, m.namespace_id());
  if (!ns) return ipc::ErrorMessage(id, ns.error());
  Result<std::vector<StoredKey>> keys = StoredKeys(s, **ns, m.keys());
  if (!keys) return ipc::ErrorMessage(id, keys.error());
  if (Status bad = ipc::CheckRetentionHint(m.priority(), m.next_use_ms()); !bad.ok()) {
    return ipc::ErrorMessage(id, bad);
  }
  const RetentionHint hint{.priority = m.priority(), .next_use_ms = m.next_use_ms(), .session_over = m.session_over()};
  uint32_t refused = 0;
  const uint32_t hinted = cache_->Hint(*keys, hint, &refused);
  FlatBufferBuilder b(64);
  return ipc::FinishMessage(b, id, w::CreateHintReply(b, hinted, refused));
}

std::vector<uint8_t> Server::HandleLookup(Session& s, uint64_t id, const w::Lookup& m) {
  const auto start = std::chrono::steady_clock::now();
  Result<const SessionNamespace*> ns = FindNamespace(s, m.namespace_id());
  if (!ns) return ipc::ErrorMessage(id, ns.error());
  Result<std::vector<StoredKey>> keys = StoredKeys(s, **ns, m.keys());
  if (!keys) return ipc::ErrorMessage(id, keys.error());
  const CacheLookup r = cache_->Lookup(s.tenant->id, *keys);
  auto reply = [id, local = r](uint32_t remote_hits) {
    std::vector<w::Tier> tiers;
    for (Tier t : local.tiers) tiers.push_back(TierToWire(t));
    tiers.insert(tiers.end(), remote_hits, w::Tier::Remote);
    FlatBufferBuilder b(64 + tiers.size());
    const auto body = w::CreateLookupReplyDirect(b, local.hits + remote_hits, &tiers);
    return ipc::FinishMessage(b, id, body);
  };
  if (remote_ == nullptr || r.hits == keys->size()) {
    lookup_latency_.RecordSince(start);
    return reply(0);
  }
  // The tail that missed locally goes to the remote tier (one pipelined
  // batch, a round trip per node); the reply follows its answer. A remote
  // tier that is slow or down only makes this a local answer: timeouts and
  // its breaker end the wait.
  std::vector<StoredKey> tail(keys->begin() + r.hits, keys->end());
  remote_->Exists(std::move(tail), [this, session = s.id, start, reply](Result<uint32_t> remote) {
    auto it = sessions_.find(session);
    if (it == sessions_.end()) return;  // the client is gone
    lookup_latency_.RecordSince(start);
    Send(*it->second, reply(remote ? *remote : 0));
  });
  return {};
}

std::vector<uint8_t> Server::HandlePrefetch(Session& s, uint64_t id, const w::Prefetch& m) {
  Result<const SessionNamespace*> ns = FindNamespace(s, m.namespace_id());
  if (!ns) return ipc::ErrorMessage(id, ns.error());
  Result<std::vector<StoredKey>> keys = StoredKeys(s, **ns, m.keys());
  if (!keys) return ipc::ErrorMessage(id, keys.error());
  const std::pair<uint32_t, uint32_t> prefetched = cache_->Prefetch(s.tenant->id, *keys);
  const uint32_t resident = prefetched.first;
  auto reply = [id, queued = prefetched.second](uint32_t present) {
    FlatBufferBuilder b(64);
    return ipc::FinishMessage(b, id, w::CreatePrefetchReply(b, present, queued));
  };
  if (remote_ == nullptr || resident == keys->size()) return reply(resident);
  // The tail no local tier holds is fetched from the remote tier into host
  // (a later load then finds it local); the reply counts it once it is there.
  std::optional<uint32_t> local =
      cache_->FetchFromRemote(s.tenant->id, (*ns)->layout->layout(), (*ns)->codec, *keys, [this, session = s.id, reply](uint32_t n) {
        auto it = sessions_.find(session);
        if (it != sessions_.end()) Send(*it->second, reply(n));
      });
  return local ? reply(*local) : std::vector<uint8_t>{};
}

std::vector<uint8_t> Server::HandleLoadOrStore(Session& s, uint64_t id, bool load, const w::Load* l,
                                               const w::Store* st) {
  const uint32_t ns_id = load ? l->namespace_id() : st->namespace_id();
  const auto* wire_keys = load ? l->keys() : st->keys();
  const auto* block_ids = load ? l->block_ids() : st->block_ids();
  const bool wait = load ? l->wait() : st->wait();
  Result<const SessionNamespace*> ns = FindNamespace(s, ns_id);
  if (!ns) return ipc::ErrorMessage(id, ns.error());
  Result<std::vector<StoredKey>> keys = StoredKeys(s, **ns, wire_keys);
  if (!keys) return ipc::ErrorMessage(id, keys.error());
  const size_t n_ids = block_ids == nullptr ? 0 : block_ids->size();
  if (n_ids != keys->size()) {
    return ipc::ErrorMessage(id, InvalidArgument(std::to_string(keys->size()) + " keys but " +
                                                 std::to_string(n_ids) + " block ids"));
  }
  std::vector<uint32_t> ids(n_ids);
  const uint32_t num_blocks = (*ns)->layout->num_blocks();
  for (size_t i = 0; i < n_ids; ++i) {
    ids[i] = block_ids->Get(static_cast<flatbuffers::uoffset_t>(i));
    if (ids[i] >= num_blocks) {
      return ipc::ErrorMessage(id, Status(StatusCode::kOutOfRange,
                                          "block id " + std::to_string(ids[i]) + " at " + std::to_string(i) +
                                              " is not below num_blocks " + std::to_string(num_blocks)));
    }
  }
  if (load) {
    // Two keys loaded into one engine block would race on its bytes.
    std::vector<uint32_t> sorted = ids;
    std::sort(sorted.begin(), sorted.end());
    if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end()) {
      return ipc::ErrorMessage(id, InvalidArgument("a Load names the same engine block twice"));
    }
  }
  if (s.ops.full()) {
    return ipc::ErrorMessage(
        id, Status(StatusCode::kResourceExhausted,
                   "limits.max_inflight_ops_per_session ops are running: wait for one first"));
  }
  const int32_t event = load ? l->event() : st->event();
  if (event < -1 || (event >= 0 && static_cast<uint32_t>(event) >= (*ns)->mapping->num_events())) {
    return ipc::ErrorMessage(id, InvalidArgument("event " + std::to_string(event) + " is not one of the " +
                                                 std::to_string((*ns)->mapping->num_events()) +
                                                 " CUDA events this cache registered"));
  }
  const int32_t completion_slot = load ? -1 : st->completion_slot();
  if (completion_slot != -1 && ((*ns)->completions == nullptr || completion_slot < 0 ||
                                static_cast<uint32_t>(completion_slot) >= CompletionPage::kSlots)) {
    return ipc::ErrorMessage(id, InvalidArgument("completion_slot " + std::to_string(completion_slot) +
                                                 " needs a completion page and a slot below " +
                                                 std::to_string(CompletionPage::kSlots)));
  }
  const int32_t fence_slot = load ? l->fence_slot() : st->fence_slot();
  const uint64_t fence_generation = load ? l->fence_generation() : st->fence_generation();
  if (fence_slot != -1 && ((*ns)->fences == nullptr || fence_slot < 0 ||
                           static_cast<uint32_t>(fence_slot) >= FencePage::kSlots || fence_generation == 0 ||
                           fence_generation > FencePage::kGenerationMask)) {
    return ipc::ErrorMessage(id, InvalidArgument("fence_slot " + std::to_string(fence_slot) +
                                                 " needs a fence page, a slot below " +
                                                 std::to_string(FencePage::kSlots) +
                                                 " and a generation of 1 to 2^48 - 1"));
  }
  StoreHint hint;
  if (!load) {
    hint = StoreHint{.retention = {.priority = st->priority(), .next_use_ms = st->next_use_ms(), .session_over = false},
                     .last_partial = st->last_partial()};
    if (Status bad = ipc::CheckRetentionHint(st->priority(), st->next_use_ms()); !bad.ok()) {
      return ipc::ErrorMessage(id, bad);
    }
  }
  // A store's KV-event metadata: checked whatever is done with it, kept
  // when this tenant's blocks are published.
  std::optional<StoreEventFields> event_fields;
  if (!load && st->engine_hashes() != nullptr) {
    const auto* hashes = st->engine_hashes();
    const auto* parent = st->parent_engine_hash();
    const auto* tokens = st->token_ids();
    const std::string_view lora = st->lora_name() != nullptr ? st->lora_name()->string_view() : "";
    if (Status bad = ipc::CheckBlockEventSizes({.keys = keys->size(),
                                                 .hash_bytes = st->hash_bytes(),
                                                 .hashes = hashes->size(),
                                                 .parent = parent != nullptr ? parent->size() : 0,
                                                 .tokens = tokens != nullptr ? tokens->size() : 0,
                                                 .block_size = st->block_size(),
                                                 .lora_name = lora.size()});
        !bad.ok()) {
      return ipc::ErrorMessage(id, bad);
    }
    if (events_ != nullptr && events_->Publishes(s.tenant->id)) {
      event_fields = StoreEventFields{
          .hash_bytes = st->hash_bytes(),
          .engine_hashes = {hashes->data(), hashes->size()},
          .parent_hash = parent != nullptr ? std::span<const uint8_t>(parent->data(), parent->size())
                                           : std::span<const uint8_t>(),
          .token_ids = tokens != nullptr ? std::span<const uint32_t>(tokens->data(), tokens->size())
                                         : std::span<const uint32_t>(),
          .block_size = st->block_size(),
          .lora_name = lora};
    }
  }
  const std::pair<uint64_t, SessionOp*> started = s.ops.Start();
  const uint64_t op = started.first;
  SessionOp& o = *started.second;
  o.load = load;
  if (wait) o.waiters.push_back(OpWaiter{.request = id, .deadline = std::nullopt});
  if (completion_slot >= 0) {
    o.completions = (*ns)->completions;
    o.completion_slot = static_cast<uint32_t>(completion_slot);
    o.completion_value = st->completion_value();
  }
  EngineTarget target{(*ns)->layout, (*ns)->mapping, event, (*ns)->codec,
                      fence_slot < 0 ? OpFence()
                                     : OpFence((*ns)->fences, static_cast<uint32_t>(fence_slot), fence_generation)};
  OpDone done = [this, session = s.id, op](OpOutcome outcome) { OnOpDone(session, op, std::move(outcome)); };
  uint32_t queued = 0;  // blocks whose copies were queued just now
  if (load) {
    // Blocks after the local prefix that the remote tier holds are fetched
    // into host first (a remote hit is promoted); the load starts then.
    std::optional<uint32_t> local;
    if (remote_ != nullptr) {
      local = cache_->FetchFromRemote(
          s.tenant->id, (*ns)->layout->layout(), (*ns)->codec, *keys,
          [this, tenant = s.tenant->id, keys = *keys, ids, target, alive = s.alive, done](uint32_t) {
            cache_->Load(tenant, keys, ids, target, alive, done);
          });
    }
    if (remote_ == nullptr || local.has_value()) {
      queued = cache_->Load(s.tenant->id, *keys, ids, std::move(target), s.alive, std::move(done));
    }
  } else {
    std::optional<StoredKey> parent;
    if (st->parent() != nullptr) {
      parent = DeriveStoredKey(s.tenant->salt, (*ns)->fingerprint,
                               ipc::FromWire<BlockKey>(*st->parent()));
    }
    if (event_fields) {
      // Kept until the blocks are gone; a store that placed none lets go.
      events_->Remember(*keys, *event_fields);
      done = [this, keys = *keys, done = std::move(done)](OpOutcome outcome) {
        events_->Release(keys);
        done(std::move(outcome));
      };
    }
    queued = cache_->Store(s.tenant->id, *keys, ids, parent, std::move(target), s.alive, std::move(done), hint);
  }
  if (wait) return {};
  FlatBufferBuilder b(64);
  // Only a load records its event (a store waits for the engine's record).
  const bool recorded = load && event >= 0 && queued > 0;
  return ipc::FinishMessage(b, id, w::CreateOpStarted(b, op, recorded, recorded ? queued : 0));
}

void Server::OnOpDone(uint64_t session_id, uint64_t op_id, OpOutcome outcome) {
  if (outcome.status.code() == StatusCode::kCancelled) ++ops_cancelled_;
  auto sit = sessions_.find(session_id);
  if (sit == sessions_.end()) return;  // the client is gone; nothing to tell
  Session& s = *sit->second;
  SessionOp* o = s.ops.Finish(op_id, std::move(outcome));
  if (o == nullptr) return;
  (o->load ? load_latency_ : store_latency_).RecordSince(o->started);
  // Over, whether it succeeded or not: an engine stream waiting for the value
  // must never hang on a failed store.
  if (o->completions) o->completions->Write(o->completion_slot, o->completion_value);
  if (o->waiters.empty()) return;  // kept for a later Wait or Poll (SessionOps bounds how many)
  for (const OpWaiter& w : o->waiters) {
    if (w.deadline) wait_deadlines_.erase(*w.deadline);
    Send(s, OpResultMessage(w.request, op_id, *o));
  }
  s.ops.Take(op_id);
}

std::vector<uint8_t> Server::OpResultMessage(uint64_t id, uint64_t op, const SessionOp& o) {
  FlatBufferBuilder b(128);
  const auto message = b.CreateString(o.outcome.status.message());
  const auto body = w::CreateOpResult(b, op, o.done, ipc::CodeToWire(o.outcome.status.code()), message,
                                      o.outcome.blocks, o.outcome.already);
  return ipc::FinishMessage(b, id, body);
}

std::vector<uint8_t> Server::HandleWaitOrPoll(Session& s, uint64_t id, uint64_t op,
                                              std::optional<uint32_t> timeout_ms) {
  Result<SessionOp*> found = s.ops.Find(op);
  if (!found) return ipc::ErrorMessage(id, found.error());
  SessionOp& o = **found;
  if (o.done) {
    std::vector<uint8_t> reply = OpResultMessage(id, op, o);
    s.ops.Take(op);
    return reply;
  }
  if (!timeout_ms) return OpResultMessage(id, op, o);  // Poll: not done yet
  if (o.waiters.size() >= kMaxWaitersPerOp) {
    return ipc::ErrorMessage(id, Status(StatusCode::kResourceExhausted,
                                        "too many Waits on op " + std::to_string(op)));
  }
  OpWaiter& w = o.waiters.emplace_back(OpWaiter{.request = id, .deadline = std::nullopt});
  if (*timeout_ms > 0) {
    w.deadline = wait_deadlines_.emplace(
        std::chrono::steady_clock::now() + std::chrono::milliseconds(*timeout_ms),
        PendingWait{s.id, op, id});
  }
  return {};
}

namespace {

// The counters a tenant's share and the node's have in common.
std::vector<std::pair<const char*, uint64_t>> RequestCounterList(const RequestCounters& c) {
  return {
      {"lookups", c.lookups},
      {"lookup_keys", c.lookup_keys},
      {"hits_hbm", c.hits[0]},
      {"hits_host", c.hits[1]},
      {"hits_disk", c.hits[2]},
      {"misses", c.misses},
      {"stores", c.stores},
      {"already_stored", c.already_stored},
      {"store_rejected", c.store_rejected},
      {"stores_discarded", c.stores_discarded},
      {"loads", c.loads},
      {"evictions_hbm", c.evictions[0]},
      {"evictions_host", c.evictions[1]},
      {"evictions_disk", c.evictions[2]},
      {"bytes_engine_to_cache", c.bytes_engine_to_cache},
      {"bytes_cache_to_engine", c.bytes_cache_to_engine},
  };
}

// Samples of `h` above `bound_s`, one of its bucket bounds.
uint64_t TurnsOver(const LatencyHistogram& h, double bound_s) {
  uint64_t n = 0;
  for (size_t i = LatencyHistogram::kBoundsSeconds.size() + 1; i-- > 0;) {
    if (i < LatencyHistogram::kBoundsSeconds.size() && LatencyHistogram::kBoundsSeconds[i] <= bound_s) break;
    n += h.bucket(i);
  }
  return n;
}

}  // namespace

std::vector<uint8_t> Server::HandleStats(Session& s, uint64_t id) {
  // An admin sees the node. Any other tenant sees only its own share: its
  // blocks, sessions and traffic, so Stats tells it nothing of its
  // co-tenants' blocks or activity (docs/security.md).
  const Tenant* only = s.tenant->config.admin ? nullptr : s.tenant;
  std::vector<std::pair<const char*, uint64_t>> counters;
  TierUsage usage[kNumTiers];
  for (Tier t : {Tier::kHbm, Tier::kHost, Tier::kDisk})
    usage[static_cast<size_t>(t)] = cache_->Usage(t);
  uint64_t sessions = 0, leases = 0, mappings = 0, inflight = 0;
  for (const auto& [sid, session] : sessions_) {
    if (only != nullptr && session->tenant != only) continue;
    ++sessions;
    inflight += session->ops.in_flight();
    mappings += session->namespaces.size();
  }
  if (only != nullptr) {
    const TenantQuota quota = TenantRegistry::QuotaOf(only->config);
    for (Tier t : {Tier::kHbm, Tier::kHost, Tier::kDisk}) {
      TierUsage& u = usage[static_cast<size_t>(t)];
      if (const std::optional<uint64_t>& q = quota.bytes[static_cast<size_t>(t)]; q) {
        u.capacity_bytes = std::min(u.capacity_bytes, *q);
      }
    }
    const TenantShare c = cache_->ShareOf(only->id);
    for (size_t t = 0; t < kNumTiers; ++t) {
      usage[t].used_bytes = c.used_bytes[t];
      usage[t].blocks = c.blocks[t];
    }
    leases = c.leases;
    counters = RequestCounterList(c);
  } else {
    const CacheCounters c = cache_->counters();
    leases = cache_->leases();
    // Every live mapping, including dead clients' that wait for their copies.
    mappings = backend_->live_mappings();
    counters = RequestCounterList(c);
    counters.insert(counters.end(),
                    {
                        {"promotions", c.promotions},
                        {"demotions", c.demotions},
                        {"prefix_fallbacks", c.prefix_fallbacks},
                        {"victim_scan_blocks", c.victim_scan_blocks},
                        {"scan_budget_deferrals", c.scan_budget_deferrals},
                        {"extents_reclaimed", c.extents_reclaimed},
                        {"extent_slots_examined", c.extent_slots_examined},
                        {"disk_quota_evictions", c.disk_quota_evictions},
                        {"bytes_hbm_to_host", c.bytes_hbm_to_host},
                        {"bytes_host_to_hbm", c.bytes_host_to_hbm},
                        {"disk_promotions", c.disk_promotions},
                        {"disk_demotions", c.disk_demotions},
                        {"disk_returns", c.disk_returns},
                        {"disk_hits_not_promoted", c.disk_hits_not_promoted},
                        {"loads_short_gone", c.loads_short_gone},
                        {"loads_short_not_ready", c.loads_short_not_ready},
                        {"loads_short_disk", c.loads_short_disk},
                        {"disk_read_failures", c.disk_read_failures},
                        {"disk_write_failures", c.disk_write_failures},
                        {"disk_not_admitted", c.disk_not_admitted},
                        {"disk_admitted_on_return", c.disk_admitted_on_return},
                        {"disk_over_budget", c.disk_over_budget},
                        {"disk_reinsertions", c.disk_reinsertions},
                        {"disk_reinsertions_dropped", c.disk_reinsertions_dropped},
                        {"disk_writes_given_up", c.disk_writes_given_up},
                        {"disk_write_backoffs", c.disk_write_backoffs},
                        {"disk_reads_waited_for_room", c.disk_reads_waited_for_room},
                        {"disk_reads_without_room", c.disk_reads_without_room},
                        {"disk_reads_record_gone", c.disk_reads_record_gone},
                        {"disk_writes_missed", c.disk_writes_missed},
                        {"bytes_host_to_disk", c.bytes_host_to_disk},
                        {"bytes_disk_to_host", c.bytes_disk_to_host},
                        {"disk_io_errors", disk_ ? disk_->counters().io_errors : 0},
                        {"disk_checksum_failures", disk_ ? disk_->counters().checksum_failures : 0},
                        {"disk_regions_reclaimed", disk_ ? disk_->counters().regions_reclaimed : 0},
                        {"disk_recovered_records", disk_ ? disk_->counters().recovered_records : 0},
                        {"disk_group_commits", disk_ ? disk_->counters().group_commits : 0},
                        {"disk_records_reclaimed", disk_ ? disk_->counters().records_reclaimed : 0},
                        {"disk_records_carried", disk_ ? disk_->counters().records_carried : 0},
                        {"disk_reclaim_failures", disk_ ? disk_->counters().reclaim_failures : 0},
                        {"disk_appends_waited", disk_ ? disk_->counters().appends_waited : 0},
                        {"disk_index_errors", disk_ ? disk_->counters().index_errors : 0},
                        {"disk_index_recoveries", disk_ ? disk_->counters().index_recoveries : 0},
                        {"disk_index_stopped", disk_ && disk_->index_stopped() ? 1u : 0u},
                        {"disk_free_regions", disk_ ? disk_->free_regions() : 0},
                        {"loop_turns", loop_turns_.count()},
                        {"loop_turns_over_1ms", TurnsOver(loop_turns_, 1e-3)},
                        {"loop_turns_over_5ms", TurnsOver(loop_turns_, 5e-3)},
                        {"loop_turns_over_10ms", TurnsOver(loop_turns_, 1e-2)},
                        {"loop_turns_over_25ms", TurnsOver(loop_turns_, 2.5e-2)},
                        {"loop_posted_deferred", posted_deferred_},
                        {"disk_region_bytes", disk_ ? disk_->region_bytes() : 0},
                        {"disk_record_bytes", disk_ ? disk_->used_bytes() : 0},
                        {"disk_filled_bytes", disk_ ? disk_->filled_bytes() : 0},
                        {"disk_writes_pending", cache_->pending_disk_writes()},
                        {"hinted", c.hinted},
                        {"hints_refused", c.hints_refused},
                        {"partial_not_admitted", c.partial_not_admitted},
                        {"codec_encoded", c.codec_encoded},
                        {"codec_not_worth_it", c.codec_not_worth_it},
                        {"codec_pool_busy", c.codec_pool_busy},
                        {"codec_host_coded", c.codec_host_coded},
                        {"codec_host_no_room", c.codec_host_no_room},
                        {"codec_decoded", c.codec_decoded},
                        {"codec_decode_failures", c.codec_decode_failures},
                        {"codec_raw_bytes", c.codec_raw_bytes},
                        {"codec_stored_bytes", c.codec_stored_bytes},
                        {"namespaces", cache_->live_namespaces()},
                        {"evicts_pending", cache_->pending_evicts()},
                        {"timed_waits_pending", wait_deadlines_.size()},
                        {"blocks_present_hbm", cache_->present_blocks(Presence::kHbm)},
                        {"blocks_present_host", cache_->present_blocks(Presence::kHost)},
                        {"blocks_present_disk", cache_->present_blocks(Presence::kDisk)},
                        {"blocks_present_remote", cache_->present_blocks(Presence::kRemote)},
                        {"sessions_refused", sessions_refused_},
                        {"messages_rejected", messages_rejected_},
                        {"ops_cancelled", ops_cancelled_},
                    });
    if (events_ != nullptr) {
      const KvEventPublisherCounters p = events_->publisher_counters();
      const KvEventSourceCounters e = events_->counters();
      counters.insert(counters.end(), {
                                          {"events_published", p.events_published},
                                          {"events_dropped", p.events_dropped},
                                          {"events_batches", p.batches_published},
                                          {"events_replays_served", p.replays_served},
                                          {"events_replay_batches", p.replay_batches},
                                          {"events_replays_refused", p.replays_refused},
                                          {"events_clears", e.clears_published},
                                          {"events_blocks_tracked", e.blocks_tracked},
                                          {"events_metadata_bytes", e.metadata_bytes},
                                          {"events_metadata_refused", e.metadata_refused},
                                      });
    }
    if (remote_ != nullptr) {
      const RemoteCounters r = remote_->counters();
      counters.insert(counters.end(),
                      {
                          {"remote_hits", r.hits},
                          {"remote_misses", r.misses},
                          {"remote_exists_keys", r.exists_keys},
                          {"remote_stores", r.stores},
                          {"remote_bytes_read", r.bytes_read},
                          {"remote_bytes_written", r.bytes_written},
                          {"remote_corrupt", r.corrupt},
                          {"remote_errors_unavailable", r.errors_unavailable},
                          {"remote_errors_rejected", r.errors_rejected},
                          {"remote_refused_busy", r.refused_busy},
                          {"remote_refused_breaker", r.refused_breaker},
                          {"remote_topology_refreshes", r.topology_refreshes},
                          {"remote_redirects", r.redirects},
                          {"remote_round_trips", r.round_trips},
                          {"remote_breaker_opened", r.breaker_opened},
                          {"remote_breaker_open", r.breaker_open ? 1u : 0u},
                          {"remote_promotions", c.remote_promotions},
                          {"remote_writes", c.remote_writes},
                          {"remote_write_failures", c.remote_write_failures},
                          {"remote_write_backoffs", c.remote_write_backoffs},
                          {"remote_writes_refused", c.remote_writes_refused},
                          {"remote_retries_dropped", c.remote_retries_dropped},
                          {"remote_demotions_missed", c.remote_demotions_missed},
                      });
    }
  }
  FlatBufferBuilder b(2048);
  std::vector<flatbuffers::Offset<w::TierStats>> tiers;
  for (Tier t : {Tier::kHbm, Tier::kHost, Tier::kDisk}) {
    const TierUsage& u = usage[static_cast<size_t>(t)];
    tiers.push_back(w::CreateTierStats(b, TierToWire(t), u.capacity_bytes, u.used_bytes, u.blocks));
  }
  std::vector<flatbuffers::Offset<w::Counter>> cs;
  for (const auto& [name, value] : counters) cs.push_back(w::CreateCounterDirect(b, name, value));
  const std::string backend = backend_->Describe();
  const std::string metrics = metrics_ ? metrics_->address() : "";
  const std::string scope = only != nullptr ? "tenant " + only->config.name : "node";
  const auto body = w::CreateStatsReplyDirect(b, &tiers, sessions, leases, mappings, inflight, &cs,
                                              backend.c_str(), metrics.c_str(), scope.c_str(), kVersion);
  return ipc::FinishMessage(b, id, body);
}

Result<std::optional<TenantId>> Server::TargetTenant(const Session& s, const flatbuffers::String* name,
                                                     std::string_view what) {
  // "" = the caller's own blocks; another tenant's name, or "*" for every
  // tenant, only for an admin.
  const std::string_view target = name != nullptr ? name->string_view() : "";
  if (target.empty() || target == s.tenant->config.name) return std::optional<TenantId>(s.tenant->id);
  if (!s.tenant->config.admin) {
    return Err(Status(StatusCode::kPermissionDenied,
                      "only an admin tenant may " + std::string(what) + " another tenant's blocks"));
  }
  if (target == "*") return std::optional<TenantId>();
  Tenant* other = tenants_->FindByName(target);
  if (other == nullptr) return Err(Status(StatusCode::kNotFound, "no such tenant"));
  return std::optional<TenantId>(other->id);
}

Status Server::TakeBulkCall(Tenant& t, std::string_view what) {
  if (t.config.admin) return Status::Ok();
  const double rate = options_.config.limits.bulk_calls_per_second;
  const auto now = std::chrono::steady_clock::now();
  if (t.bulk_tokens < 0) {
    t.bulk_tokens = rate;
  } else {
    const double elapsed = std::chrono::duration<double>(now - t.bulk_refilled).count();
    t.bulk_tokens = std::min(rate, t.bulk_tokens + elapsed * rate);
  }
  t.bulk_refilled = now;
  if (t.bulk_tokens < 1) {
    return Status(StatusCode::kResourceExhausted,
                  std::string(what) + ": limits.bulk_calls_per_second (" +
                      std::to_string(options_.config.limits.bulk_calls_per_second) +
                      ") reached for this tenant; retry later");
  }
  t.bulk_tokens -= 1;
  return Status::Ok();
}

std::vector<uint8_t> Server::HandleEvict(Session& s, uint64_t id, const w::Evict& m) {
  Result<std::optional<TenantId>> target = TargetTenant(s, m.tenant(), "evict");
  if (!target) return ipc::ErrorMessage(id, target.error());
  EvictFilter filter;
  if (*target) filter.owners = std::vector<TenantId>{**target};
  if (m.fingerprint() != nullptr) filter.layout = ipc::FromWire<LayoutFingerprint>(*m.fingerprint());
  switch (m.tier()) {
    case w::Tier::None: break;
    case w::Tier::Hbm: filter.tier = Tier::kHbm; break;
    case w::Tier::Host: filter.tier = Tier::kHost; break;
    case w::Tier::Disk: filter.tier = Tier::kDisk; break;
    case w::Tier::Remote:
      return ipc::ErrorMessage(id, InvalidArgument("evict: the remote tier is the cluster's to evict (maxmemory)"));
    default:
      return ipc::ErrorMessage(id, InvalidArgument("unknown tier " + std::to_string(static_cast<int>(m.tier()))));
  }
  Tenant& caller = *s.tenant;
  if (!caller.config.admin && caller.evicting) {
    return ipc::ErrorMessage(id, Status(StatusCode::kResourceExhausted,
                                        "evict: one of this tenant's evicts is still running; retry later"));
  }
  if (Status st = TakeBulkCall(caller, "evict"); !st.ok()) return ipc::ErrorMessage(id, st);
  // The walk runs in the background; the reply goes out when it is done (to
  // the session, if it is still there).
  if (!caller.config.admin) caller.evicting = true;
  // Everything of its tenants: KV events may end it with AllBlocksCleared.
  std::optional<std::optional<std::vector<TenantId>>> evict_all;
  if (!filter.tier && !filter.layout) evict_all = filter.owners;
  cache_->Evict(std::move(filter), [this, session = s.id, id, tenant = &caller, evict_all](uint64_t evicted) {
    tenant->evicting = false;  // tenants live as long as the server
    if (events_ != nullptr && evict_all) events_->AfterEvictAll(*evict_all);
    auto it = sessions_.find(session);
    if (it == sessions_.end()) return;
    spdlog::info("session {}: evicted {} block(s)", session, evicted);
    FlatBufferBuilder b(64);
    Send(*it->second, ipc::FinishMessage(b, id, w::CreateEvictReply(b, evicted)));
  });
  return {};
}

std::vector<uint8_t> Server::HandleListNamespaces(Session& s, uint64_t id, const w::ListNamespaces& m) {
  Result<std::optional<TenantId>> target = TargetTenant(s, m.tenant(), "list");
  if (!target) return ipc::ErrorMessage(id, target.error());
  if (Status st = TakeBulkCall(*s.tenant, "namespaces"); !st.ok()) return ipc::ErrorMessage(id, st);
  FlatBufferBuilder b(1024);
  std::vector<flatbuffers::Offset<w::NamespaceInfo>> list;
  for (const NamespaceUsage& u : cache_->UsageByNamespace(*target)) {
    const w::Key fp = ipc::ToWire(u.fingerprint);
    const std::vector<uint64_t> used(std::begin(u.used_bytes), std::end(u.used_bytes));
    list.push_back(w::CreateNamespaceInfoDirect(b, &fp, u.description.c_str(), u.blocks, &used));
  }
  return ipc::FinishMessage(b, id, w::CreateNamespaceListDirect(b, &list));
}

std::vector<uint8_t> Server::HandleVerify(Session& s, uint64_t id, const w::VerifyDisk& m) {
  if (!s.tenant->config.admin) {
    return ipc::ErrorMessage(id, Status(StatusCode::kPermissionDenied, "verify is an admin call"));
  }
  if (!disk_) return ipc::ErrorMessage(id, Status(StatusCode::kFailedPrecondition, "verify: there is no disk tier"));
  if (m.start() || !verify_progress_) {
    verify_progress_ = cache_->VerifyDisk();
    spdlog::info("session {}: verifying {} disk record(s)", s.id, verify_progress_->total);
  }
  const VerifyProgress& p = *verify_progress_;
  FlatBufferBuilder b(64);
  return ipc::FinishMessage(b, id, w::CreateVerifyDiskProgress(b, p.total, p.checked, p.bad, p.skipped, p.done));
}

std::vector<uint8_t> Server::HandleListTenants(Session& s, uint64_t id) {
  if (!s.tenant->config.admin) {
    return ipc::ErrorMessage(id, Status(StatusCode::kPermissionDenied, "ListTenants is an admin call"));
  }
  FlatBufferBuilder b(1024);
  std::vector<flatbuffers::Offset<w::TenantInfo>> list;
  for (const auto& t : tenants_->tenants()) {
    std::vector<uint64_t> used;
    for (Tier tier : {Tier::kHbm, Tier::kHost, Tier::kDisk}) used.push_back(cache_->TenantUsedBytes(t->id, tier));
    list.push_back(w::CreateTenantInfoDirect(b, t->config.name.c_str(), t->sessions, &used,
                                             cache_->TenantBlocks(t->id)));
  }
  return ipc::FinishMessage(b, id, w::CreateTenantListDirect(b, &list));
}

}  // namespace kvtier

namespace kvtier {

MetricsSnapshot Server::Snapshot() const {
  MetricsSnapshot m;
  m.backend = backend_->Describe();
  for (Tier t : {Tier::kHbm, Tier::kHost, Tier::kDisk}) {
    m.tiers.push_back({std::string(TierName(t)), cache_->Usage(t)});
  }
  m.cache = cache_->counters();
  if (disk_) {
    m.disk = disk_->counters();
    m.disk_free_regions = disk_->free_regions();
    m.disk_index_stopped = disk_->index_stopped();
  }
  if (events_ != nullptr) m.events = MetricsSnapshot::Events{events_->publisher_counters(), events_->counters()};
  if (remote_ != nullptr) {
    m.remote = remote_->counters();
  }
  m.disk_writes_pending = cache_->pending_disk_writes();
  m.namespaces = cache_->live_namespaces();
  m.evicts_pending = cache_->pending_evicts();
  m.timed_waits_pending = wait_deadlines_.size();
  m.sessions = sessions_.size();
  m.leases = cache_->leases();
  m.mappings = backend_->live_mappings();
  for (const auto& [sid, session] : sessions_) m.inflight_ops += session->ops.in_flight();
  m.sessions_refused = sessions_refused_;
  m.messages_rejected = messages_rejected_;
  m.ops_cancelled = ops_cancelled_;
  m.lookup_latency = lookup_latency_;
  m.loop_turns = loop_turns_;
  m.loop_slow_turns = slow_turns_;
  m.loop_posted_deferred = posted_deferred_;
  m.load_latency = load_latency_;
  m.store_latency = store_latency_;
  for (const auto& t : tenants_->tenants()) {
    MetricsSnapshot::TenantRow row{
        .name = t->config.name, .sessions = t->sessions, .share = cache_->ShareOf(t->id)};
    m.tenants.push_back(std::move(row));
  }
  return m;
}

std::optional<MetricsSnapshot> Server::SnapshotFromLoop() {
  // Shared: a reply that comes after the wait gave up must not write into a
  // promise that is gone.
  auto promise = std::make_shared<std::promise<MetricsSnapshot>>();
  std::future<MetricsSnapshot> result = promise->get_future();
  Post([this, promise] { promise->set_value(Snapshot()); }, "metrics snapshot");
  if (result.wait_for(std::chrono::seconds(2)) != std::future_status::ready) return std::nullopt;
  return result.get();
}

}  // namespace kvtier
