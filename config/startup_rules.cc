#include "config/startup_rules.h"

#include <algorithm>
#include <cstdint>

#include "config/size.h"

namespace kvtier {

void CheckStartupRules(
    const Config& config,
    const std::function<void(const std::string& key, const std::string& what)>& error) {
  const Config::Tiers& t = config.tiers;
  // The hbm tier is one arena on one GPU (BlockCache's hbm_device).
  if (t.hbm.enabled && t.hbm.devices.size() > 1) {
    error("tiers.hbm.devices",
          "lists " + std::to_string(t.hbm.devices.size()) +
              " devices, but one kvtierd serves the hbm tier of one GPU in this version: list one, "
              "and run one kvtierd per GPU, each with its own socket.path, state_dir, "
              "tiers.disk.paths and metrics.listen");
  }
#if !KVTIER_HAVE_CUDA
  if (config.device.backend == DeviceBackendKind::kCuda) {
    error("device.backend",
          "cuda, but this kvtierd was built without the CUDA toolkit; use host or auto");
  }
#endif
  // A segment file is preallocated and read with O_DIRECT in 4 KiB units
  // (FileDevice::kAlignment); a region's offset is counted in 4 KiB units
  // in 32 bits (DiskTier).
  constexpr uint64_t kAlign = 4096;
  if (t.disk.bytes % kAlign != 0) {
    error("tiers.disk.bytes", "must be a multiple of 4KiB (e.g. in MiB or GiB), got " +
                                  FormatSize(t.disk.bytes) + " (" + std::to_string(t.disk.bytes) +
                                  " bytes)");
  }
  // The node holds at most 65,536 layouts (NamespaceTable::kMaxIds: 16-bit
  // ids in disk records). Each tenant's limit times the tenants must fit,
  // so that no tenant is refused a layout because the others took the ids:
  // a refusal, not fair shares, since a layout's id is shared by every
  // tenant serving that model and the default (256 a tenant) only adds up
  // past the node's ids with more than 256 tenants.
  constexpr uint64_t kNodeNamespaces = uint64_t{UINT16_MAX} + 1;
  const uint64_t tenants = std::max<uint64_t>(1, config.tenants.size());
  if (tenants * config.limits.max_namespaces_per_tenant > kNodeNamespaces) {
    error("limits.max_namespaces_per_tenant",
          std::to_string(config.limits.max_namespaces_per_tenant) + " layouts a tenant for " + std::to_string(tenants) +
              " tenants add up to " + std::to_string(tenants * config.limits.max_namespaces_per_tenant) +
              ", past the 65536 layouts a node holds: set it to at most " +
              std::to_string(kNodeNamespaces / tenants));
  }
  constexpr uint64_t kMaxRegionBytes = kAlign * UINT32_MAX;
  if (t.disk.region_bytes > kMaxRegionBytes) {
    error("tiers.disk.region_bytes", "must be below 16TiB, got " + FormatSize(t.disk.region_bytes));
  }
}

}  // namespace kvtier
