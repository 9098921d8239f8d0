#include "tiers/namespace_table.h"

#include <algorithm>

#include "common/check.h"

namespace kvtier {

NamespaceTable::NamespaceTable(uint32_t max_namespaces, uint32_t max_per_tenant)
    : max_namespaces_(std::min(max_namespaces, kMaxIds)), max_per_tenant_(max_per_tenant) {
  KVTIER_CHECK(max_namespaces_ > 0 && max_per_tenant_ > 0);
}

void NamespaceTable::Counts::Add(Tier t, uint64_t n, int sign) {
  if (sign > 0) {
    ++blocks;
    bytes[static_cast<size_t>(t)] += n;
  } else {
    KVTIER_CHECK(blocks > 0 && bytes[static_cast<size_t>(t)] >= n);
    --blocks;
    bytes[static_cast<size_t>(t)] -= n;
  }
}

Result<uint32_t> NamespaceTable::IdFor(const LayoutFingerprint& fingerprint,
                                       const std::function<std::string()>& describe) {
  if (auto it = ids_.find(fingerprint); it != ids_.end()) {
    Namespace& ns = by_id_[it->second];
    if (ns.description.empty() && describe) ns.description = describe();  // known from disk until now
    return it->second;
  }
  Reclaim();
  uint32_t id;
  if (!free_ids_.empty()) {
    id = free_ids_.back();
    free_ids_.pop_back();
  } else if (by_id_.size() < max_namespaces_) {
    id = static_cast<uint32_t>(by_id_.size());
    by_id_.emplace_back();
  } else {
    return Err(Status(StatusCode::kResourceExhausted,
                      "all " + std::to_string(max_namespaces_) +
                          " namespace ids of the node hold blocks: a new layout's blocks are stored once "
                          "another layout's blocks are evicted"));
  }
  Namespace& ns = by_id_[id];
  ns = Namespace{};
  ns.fingerprint = fingerprint;
  if (describe) ns.description = describe();
  ns.in_use = true;
  ids_.emplace(fingerprint, id);
  maybe_empty_.push_back(id);  // until a block is charged to it
  return id;
}

std::optional<uint32_t> NamespaceTable::Find(const LayoutFingerprint& fingerprint) const {
  auto it = ids_.find(fingerprint);
  if (it == ids_.end()) return std::nullopt;
  return it->second;
}

const LayoutFingerprint& NamespaceTable::FingerprintOf(uint32_t id) const {
  KVTIER_CHECK(id < by_id_.size() && by_id_[id].in_use);
  return by_id_[id].fingerprint;
}

bool NamespaceTable::SetFormat(uint32_t id, const NamespaceFormat& format) {
  KVTIER_CHECK(id < by_id_.size() && by_id_[id].in_use);
  NamespaceFormat& mine = by_id_[id].format;
  if (mine.block_bytes == 0) {
    mine = format;
    return true;
  }
  return mine == format;
}

const NamespaceFormat& NamespaceTable::FormatOf(uint32_t id) const {
  KVTIER_CHECK(id < by_id_.size() && by_id_[id].in_use);
  return by_id_[id].format;
}

Status NamespaceTable::Admit(TenantId tenant, uint32_t id) const {
  if (parts_.contains(PartKey(tenant, id))) return Status::Ok();
  const uint32_t held = TenantNamespaces(tenant);
  if (held < max_per_tenant_) return Status::Ok();
  return Status(StatusCode::kResourceExhausted,
                "the tenant holds blocks in " + std::to_string(held) +
                    " layouts (limits.max_namespaces_per_tenant): a new layout's blocks are stored once "
                    "one of them is evicted");
}

void NamespaceTable::Charge(uint32_t id, TenantId owner, Tier t, uint64_t bytes, int sign) {
  KVTIER_CHECK(id < by_id_.size() && by_id_[id].in_use);
  Namespace& ns = by_id_[id];
  ns.total.Add(t, bytes, sign);
  const uint64_t key = PartKey(owner, id);
  if (sign > 0) {
    auto [it, created] = parts_.try_emplace(key);
    if (created) {
      if (tenant_ids_.size() <= owner) tenant_ids_.resize(size_t{owner} + 1);
      it->second.index = tenant_ids_[owner].size();
      tenant_ids_[owner].push_back(static_cast<uint16_t>(id));
    }
    it->second.counts.Add(t, bytes, sign);
  } else {
    auto it = parts_.find(key);
    KVTIER_CHECK(it != parts_.end());
    it->second.counts.Add(t, bytes, sign);
    if (it->second.counts.blocks == 0) {
      // Out of its tenant's list: the last one takes its place.
      std::vector<uint16_t>& mine = tenant_ids_[owner];
      const size_t at = it->second.index;
      mine[at] = mine.back();
      mine.pop_back();
      if (at < mine.size()) parts_.at(PartKey(owner, mine[at])).index = at;
      parts_.erase(it);
    }
  }
  UpdateLive(id);
}

void NamespaceTable::Pin(uint32_t id) {
  KVTIER_CHECK(id < by_id_.size() && by_id_[id].in_use);
  ++by_id_[id].pins;
  UpdateLive(id);
}

void NamespaceTable::Unpin(uint32_t id) {
  KVTIER_CHECK(id < by_id_.size() && by_id_[id].pins > 0);
  --by_id_[id].pins;
  UpdateLive(id);
}

void NamespaceTable::UpdateLive(uint32_t id) {
  Namespace& ns = by_id_[id];
  const bool held = ns.total.blocks > 0 || ns.pins > 0;
  if (held == ns.counted) return;
  ns.counted = held;
  if (held) {
    ++live_;
  } else {
    --live_;
    maybe_empty_.push_back(id);
  }
}

void NamespaceTable::Reclaim() {
  for (uint32_t id : maybe_empty_) {
    Namespace& ns = by_id_[id];
    if (!ns.in_use || ns.counted) continue;  // freed already, or holds blocks again
    ids_.erase(ns.fingerprint);
    ns = Namespace{};
    free_ids_.push_back(id);
  }
  maybe_empty_.clear();
}

uint32_t NamespaceTable::TenantNamespaces(TenantId tenant) const {
  return tenant < tenant_ids_.size() ? static_cast<uint32_t>(tenant_ids_[tenant].size()) : 0;
}

std::vector<NamespaceUsage> NamespaceTable::Usage(std::optional<TenantId> owner) const {
  std::vector<NamespaceUsage> out;
  auto add = [&](uint32_t id, const Counts& c) {
    NamespaceUsage& u = out.emplace_back();
    u.fingerprint = by_id_[id].fingerprint;
    u.description = by_id_[id].description;
    u.blocks = c.blocks;
    std::copy(std::begin(c.bytes), std::end(c.bytes), std::begin(u.used_bytes));
  };
  if (owner) {
    if (*owner < tenant_ids_.size()) {
      for (uint16_t id : tenant_ids_[*owner]) add(id, parts_.at(PartKey(*owner, id)).counts);
    }
  } else {
    for (uint32_t id = 0; id < by_id_.size(); ++id) {
      if (by_id_[id].in_use && by_id_[id].total.blocks > 0) add(id, by_id_[id].total);
    }
  }
  return out;
}

}  // namespace kvtier
