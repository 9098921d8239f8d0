// The session's requests: Hello (who the peer is, which protocol and tenant)
// and RegisterKvCache (a KV cache's layout, memory and codec; mapped off the
// loop, the reply deferred until it is).
#include <sys/stat.h>

#include <spdlog/spdlog.h>

#include <algorithm>

#include "common/version.h"
#include "daemon/server.h"
#include "devices/host_backend.h"
#include "tiers/disk/record.h"

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

}  // namespace

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
  if (Status st = node_->sessions.Take(t.id, t.config.name, 1); !st.ok()) {
    ++sessions_refused_;
    MarkClosing(s, "node limit");
    return ipc::ErrorMessage(id, st);
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
                                     b.CreateString(kVersion), /*layer_progress=*/true,
                                     /*layer_stores=*/backend_->GatesStoreLayers());
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
  uint64_t host_bytes = 0;  // of them, the node's memory (not a GPU's)
  for (size_t i = 0; i < handles.size(); ++i) {
    if (handles[i].kind == ClientMemoryKind::kHostMemfd) {
      handles[i].size_bytes = std::min(handles[i].size_bytes, AlignUpToPage(needed[i]));
      host_bytes += handles[i].size_bytes;
    }
    charged_bytes += handles[i].size_bytes;
  }
  uint64_t pages = 0;
  for (const auto& [index, bytes] : {std::pair{m.completion_fd_index(), CompletionPage::kBytes},
                                     std::pair{m.fence_fd_index(), FencePage::kBytes}}) {
    if (index < 0) continue;
    ++pages;
    charged_bytes += bytes;
    host_bytes += bytes;
  }
  Result<MappedCharge> charge =
      MappedCharge::Take(*s.tenant, options_.config.limits, node_, handles.size() + pages, charged_bytes,
                         host_bytes);
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
  // mapped shared: `most` bytes where it holds them, else `least`.
  auto map_page = [&](int index, const char* what, size_t least,
                      size_t most) -> Result<std::optional<MemoryMapping>> {
    if (index < 0) return std::optional<MemoryMapping>();
    if (static_cast<size_t>(index) >= fds.size() || fd_used[static_cast<size_t>(index)]) {
      return Err(InvalidArgument(std::string(what) + ": its fd index does not name an unused descriptor"));
    }
    fd_used[static_cast<size_t>(index)] = true;
    ClientRegionHandle page;
    page.kind = ClientMemoryKind::kHostMemfd;
    page.memfd = std::move(fds[static_cast<size_t>(index)]);
    struct stat st {};
    page.size_bytes =
        ::fstat(page.memfd.get(), &st) == 0 && static_cast<uint64_t>(st.st_size) >= most ? most : least;
    KVTIER_ASSIGN_OR_RETURN(MemoryMapping mapped, HostBackend::MapSealedMemfd(page, what));
    return std::optional<MemoryMapping>(std::move(mapped));
  };
  std::shared_ptr<CompletionPage> completions;
  std::shared_ptr<FencePage> fences;
  {
    Result<std::optional<MemoryMapping>> page =
        map_page(m.completion_fd_index(), "the completion page", CompletionPage::kBytes, CompletionPage::kBytes);
    if (!page) return ipc::ErrorMessage(id, page.error());
    if (*page) completions = std::make_shared<CompletionPage>(std::move(**page));
    // A client from before layer progress sends a page of fence words only.
    page = map_page(m.fence_fd_index(), "the fence page", FencePage::kFenceBytes, FencePage::kBytes);
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

}  // namespace kvtier
