// Client::Impl's operator calls (client_impl.h): Stats, Evict,
// ListNamespaces, VerifyDisk, Flush and ListTenants.
#include "client/client_impl.h"

namespace kvtier {

namespace w = wire;
using client_detail::Reply;
using client_detail::TierFromWire;
using flatbuffers::FlatBufferBuilder;

Result<DaemonStats> Client::Impl::Stats() {
  MutexLock lock(&mu_);
  KVTIER_RETURN_IF_ERROR(EnsureConnected());
  FlatBufferBuilder b(64);
  const uint64_t rid = next_id_++;
  KVTIER_ASSIGN_OR_RETURN(Reply r, Call(ipc::FinishMessage(b, rid, w::CreateStats(b)), {}, rid, w::Body::StatsReply));
  const w::StatsReply* s = r.msg->body_as_StatsReply();
  DaemonStats out;
  if (s->backend() != nullptr) out.backend = s->backend()->str();
  if (s->metrics() != nullptr) out.metrics = s->metrics()->str();
  if (s->scope() != nullptr) out.scope = s->scope()->str();
  if (s->release() != nullptr) out.release = s->release()->str();
  if (s->tiers() != nullptr) {
    for (const w::TierStats* t : *s->tiers()) {
      out.tiers.push_back(TierStats{TierFromWire(t->tier()), t->capacity_bytes(), t->used_bytes(), t->blocks()});
    }
  }
  out.sessions = s->sessions();
  out.leases = s->leases();
  out.mappings = s->mappings();
  out.inflight_ops = s->inflight_ops();
  if (s->counters() != nullptr) {
    for (const w::Counter* c : *s->counters()) {
      out.counters.emplace_back(c->name() != nullptr ? c->name()->str() : "", c->value());
    }
  }
  return out;
}

Result<uint64_t> Client::Impl::Evict(const std::string& tenant, std::optional<BlockTier> tier,
                                     std::optional<LayoutFingerprint> ns) {
  MutexLock lock(&mu_);
  KVTIER_RETURN_IF_ERROR(EnsureConnected());
  FlatBufferBuilder b(128);
  const uint64_t rid = next_id_++;
  const w::Tier wt = tier ? static_cast<w::Tier>(*tier) : w::Tier::None;
  const w::Key fp = ns ? ipc::ToWire(*ns) : w::Key();
  KVTIER_ASSIGN_OR_RETURN(
      Reply r, Call(ipc::FinishMessage(b, rid, w::CreateEvictDirect(b, tenant.c_str(), ns ? &fp : nullptr, wt)),
                    {}, rid, w::Body::EvictReply));
  return r.msg->body_as_EvictReply()->evicted();
}

Result<std::vector<NamespaceStats>> Client::Impl::ListNamespaces(const std::string& tenant) {
  MutexLock lock(&mu_);
  KVTIER_RETURN_IF_ERROR(EnsureConnected());
  FlatBufferBuilder b(128);
  const uint64_t rid = next_id_++;
  KVTIER_ASSIGN_OR_RETURN(Reply r, Call(ipc::FinishMessage(b, rid, w::CreateListNamespacesDirect(b, tenant.c_str())),
                                        {}, rid, w::Body::NamespaceList));
  std::vector<NamespaceStats> out;
  const w::NamespaceList* list = r.msg->body_as_NamespaceList();
  if (list->namespaces() == nullptr) return out;
  for (const w::NamespaceInfo* n : *list->namespaces()) {
    NamespaceStats ns;
    if (n->fingerprint() != nullptr) ns.fingerprint = ipc::FromWire<LayoutFingerprint>(*n->fingerprint());
    if (n->description() != nullptr) ns.description = n->description()->str();
    ns.blocks = n->blocks();
    if (n->used_bytes() != nullptr) {
      for (flatbuffers::uoffset_t i = 0; i < n->used_bytes()->size() && i < 3; ++i) {
        ns.used_bytes[i] = n->used_bytes()->Get(i);
      }
    }
    out.push_back(std::move(ns));
  }
  return out;
}

Result<VerifyStatus> Client::Impl::VerifyDisk(bool start) {
  MutexLock lock(&mu_);
  KVTIER_RETURN_IF_ERROR(EnsureConnected());
  FlatBufferBuilder b(64);
  const uint64_t rid = next_id_++;
  KVTIER_ASSIGN_OR_RETURN(Reply r, Call(ipc::FinishMessage(b, rid, w::CreateVerifyDisk(b, start)), {}, rid,
                                        w::Body::VerifyDiskProgress));
  const w::VerifyDiskProgress* p = r.msg->body_as_VerifyDiskProgress();
  return VerifyStatus{p->total(), p->checked(), p->bad(), p->skipped(), p->done()};
}

Result<uint64_t> Client::Impl::Flush() {
  MutexLock lock(&mu_);
  KVTIER_RETURN_IF_ERROR(EnsureConnected());
  FlatBufferBuilder b(64);
  const uint64_t rid = next_id_++;
  KVTIER_ASSIGN_OR_RETURN(Reply r, Call(ipc::FinishMessage(b, rid, w::CreateFlush(b)), {}, rid, w::Body::FlushReply));
  return r.msg->body_as_FlushReply()->flushed();
}

Result<std::vector<TenantStats>> Client::Impl::ListTenants() {
  MutexLock lock(&mu_);
  KVTIER_RETURN_IF_ERROR(EnsureConnected());
  FlatBufferBuilder b(64);
  const uint64_t rid = next_id_++;
  KVTIER_ASSIGN_OR_RETURN(Reply r, Call(ipc::FinishMessage(b, rid, w::CreateListTenants(b)), {}, rid,
                                        w::Body::TenantList));
  std::vector<TenantStats> out;
  const w::TenantList* tl = r.msg->body_as_TenantList();
  if (tl->tenants() == nullptr) return out;
  for (const w::TenantInfo* t : *tl->tenants()) {
    TenantStats ts;
    ts.name = t->name() != nullptr ? t->name()->str() : "";
    ts.sessions = t->sessions();
    ts.blocks = t->blocks();
    if (t->used_bytes() != nullptr) {
      for (flatbuffers::uoffset_t i = 0; i < t->used_bytes()->size() && i < 3; ++i) ts.used_bytes[i] = t->used_bytes()->Get(i);
    }
    out.push_back(std::move(ts));
  }
  return out;
}

}  // namespace kvtier
