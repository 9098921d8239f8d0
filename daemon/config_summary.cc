#include "daemon/config_summary.h"

#include <cstdio>
#include <sstream>

#include "config/config_loader.h"
#include "config/size.h"

namespace kvtier {
namespace {

std::string Ratio(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.2f", v);
  return buf;
}

std::string Marks(const Watermarks& w) { return "high " + Ratio(w.high) + ", low " + Ratio(w.low); }

}  // namespace

std::string ConfigSummary(const Config& c) {
  std::ostringstream o;
  char mode[8];
  std::snprintf(mode, sizeof(mode), "%04o", c.socket.mode);
  o << "socket:   " << c.socket.path << " (mode " << mode
    << (c.socket.group ? ", gid " + std::to_string(*c.socket.group) : std::string()) << ")\n";
  o << "state:    " << c.state_dir << "\n";
  o << "device:   " << DeviceBackendName(c.device.backend) << "\n";
  o << "tiers:\n";
  if (c.tiers.hbm.enabled) {
    o << "  hbm:    " << FormatSize(c.tiers.hbm.bytes) << " per device, devices ";
    if (c.tiers.hbm.devices.empty()) o << "all";
    for (size_t i = 0; i < c.tiers.hbm.devices.size(); ++i) o << (i ? "," : "") << c.tiers.hbm.devices[i];
    o << "\n";
  } else {
    o << "  hbm:    disabled\n";
  }
  o << "  host:   " << FormatSize(c.tiers.host.bytes)
    << (c.tiers.host.prefault ? ", prefaulted" : ", faulted on first use") << "\n";
  if (c.tiers.disk.enabled) {
    o << "  disk:   " << FormatSize(c.tiers.disk.bytes) << " per path, regions of "
      << FormatSize(c.tiers.disk.region_bytes) << ", queue depth " << c.tiers.disk.queue_depth
      << (c.tiers.disk.direct_io ? ", O_DIRECT" : ", buffered") << "\n";
    for (const std::string& p : c.tiers.disk.paths) o << "          " << p << "\n";
  } else {
    o << "  disk:   disabled\n";
  }
  if (c.tiers.remote.enabled) {
    o << "  remote: " << c.tiers.remote.key_prefix << " on";
    for (const std::string& s : c.tiers.remote.seeds) o << " " << s;
    o << ", written on " << (c.tiers.remote.write == RemoteWritePolicy::kOnStore ? "store" : "demote") << "\n";
  } else {
    o << "  remote: disabled\n";
  }
  o << "policy:   watermarks hbm (" << Marks(c.policy.watermarks.hbm) << "), host ("
    << Marks(c.policy.watermarks.host) << "), disk (" << Marks(c.policy.watermarks.disk) << ")\n";
  o << "          " << (c.policy.prefix_aware ? "prefix-aware " : "")
    << (c.policy.eviction == EvictionKind::kS3Fifo   ? "s3fifo"
        : c.policy.eviction == EvictionKind::kClasses ? "classes"
                                                      : "lru")
    << " (hints keep at most " << c.policy.hints.max_share << " of a tier), "
    << (c.policy.write_policy == WritePolicy::kWriteBack ? "write-back" : "write-through")
    << ", disk admission after " << c.policy.disk_admission.min_hits << " hits"
    << (c.policy.disk_admission.reuse ? " and reuse" : "")
    << (c.policy.disk_admission.learned ? " and the learned gate" : "") << ", budget "
    << (c.policy.disk_admission.write_budget_bytes_per_day
            ? FormatSize(*c.policy.disk_admission.write_budget_bytes_per_day) + "/day"
            : std::string("unlimited"))
    << "\n";
  o << "tenants:\n";
  for (const TenantConfig& t : c.tenants) {
    o << "  " << t.name << ":";
    if (t.uid) o << " uid " << *t.uid;
    if (t.gid) o << " gid " << *t.gid;
    if (t.token) o << " token (set)";
    if (!t.sharing_group.empty()) o << " group " << t.sharing_group;
    if (t.admin) o << " admin";
    if (t.publish_events) o << " events (model " << (t.model.empty() ? t.name : t.model) << ")";
    if (t.quotas.hbm_bytes) o << " quota hbm " << FormatSize(*t.quotas.hbm_bytes);
    if (t.quotas.host_bytes) o << " quota host " << FormatSize(*t.quotas.host_bytes);
    if (t.quotas.disk_bytes) o << " quota disk " << FormatSize(*t.quotas.disk_bytes);
    o << "\n";
  }
  if (c.events.enabled) {
    o << "events:   " << c.events.endpoint << ", replay "
      << (c.events.replay_endpoint.empty() ? "off" : c.events.replay_endpoint) << ", topic " << c.events.topic
      << ", " << (c.events.encoding == EventEncoding::kMap ? "map" : "positional") << " encoding, hashes "
      << (c.events.hashes_as_bytes ? "bytes" : "u64") << "\n";
  } else {
    o << "events:   disabled\n";
  }
  o << "metrics:  " << (c.metrics.enabled ? "http://" + c.metrics.listen + "/metrics" : "disabled")
    << "\n";
  o << "log:      " << LogLevelName(c.log.level) << ", "
    << (c.log.format == LogFormat::kJson ? "json" : "text") << "\n";
  return o.str();
}

}  // namespace kvtier
