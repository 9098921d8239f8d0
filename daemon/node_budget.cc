#include "daemon/node_budget.h"

#include <dirent.h>
#include <errno.h>
#include <sys/resource.h>

#include <algorithm>
#include <charconv>
#include <fstream>
#include <optional>
#include <utility>

#include <spdlog/spdlog.h>

#include "config/size.h"
#include "tiers/disk/disk_tier.h"

namespace kvtier {
namespace {

std::optional<uint64_t> ReadNumberFile(const std::string& path) {
  std::ifstream in(path);
  std::string text;
  if (!(in >> text)) return std::nullopt;
  uint64_t v = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || end != text.data() + text.size()) return std::nullopt;  // "max" too
  return v;
}

// The tightest memory limit of this process's cgroup and its parents (v2),
// or of its memory cgroup (v1); nullopt where none is set.
std::optional<std::pair<uint64_t, std::string>> CgroupMemoryLimit() {
  std::ifstream in("/proc/self/cgroup");
  std::string line;
  std::optional<std::pair<uint64_t, std::string>> best;
  auto consider = [&best](const std::string& file) {
    const std::optional<uint64_t> v = ReadNumberFile(file);
    // v1 says "no limit" with a page-rounded LONG_MAX.
    if (!v || *v >= (1ull << 62)) return;
    if (!best || *v < best->first) best = std::pair{*v, file};
  };
  while (std::getline(in, line)) {
    const size_t first = line.find(':');
    const size_t second = line.find(':', first + 1);
    if (first == std::string::npos || second == std::string::npos) continue;
    const std::string controllers = line.substr(first + 1, second - first - 1);
    std::string path = line.substr(second + 1);
    std::string root, file;
    if (controllers.empty()) {
      root = "/sys/fs/cgroup", file = "memory.max";
    } else if (controllers == "memory" || controllers.find("memory,") == 0 ||
               controllers.find(",memory") != std::string::npos) {
      root = "/sys/fs/cgroup/memory", file = "memory.limit_in_bytes";
    } else {
      continue;
    }
    // Inside a container the own cgroup is often the namespace's root:
    // every level from the path up to the root is read.
    while (true) {
      consider(root + (path == "/" ? "" : path) + "/" + file);
      if (path.empty() || path == "/") break;
      const size_t slash = path.rfind('/');
      path = slash == 0 ? "/" : path.substr(0, slash);
    }
  }
  return best;
}

std::optional<uint64_t> MemTotal() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  uint64_t kib = 0;
  std::string unit;
  while (in >> key >> kib >> unit) {
    if (key == "MemTotal:") return kib * 1024;
  }
  return std::nullopt;
}

std::string Amount(uint64_t v, const std::string& unit) {
  return unit == "bytes" ? FormatSize(v) : std::to_string(v) + " " + unit;
}

// A node limit capped by its setting; a setting above the node's is refused.
Status Cap(uint64_t setting, const char* name, const std::string& node_name, uint64_t* value) {
  if (setting == 0) return Status::Ok();
  if (setting > *value) {
    return InvalidArgument("limits." + std::string(name) + " (" + std::to_string(setting) + ") is above the node's " +
                           node_name + " (" + std::to_string(*value) + "): it can only set it lower");
  }
  *value = setting;
  return Status::Ok();
}

uint64_t Share(const NodeBudget::Spec& spec, uint64_t capacity) {
  const uint64_t tenants = std::max<size_t>(spec.tenants, 1);
  if (spec.per_tenant_limit <= capacity / tenants) return spec.per_tenant_limit;
  const double fraction = std::clamp(spec.guaranteed_fraction, 0.0, 1.0);
  return std::min<uint64_t>(spec.per_tenant_limit,
                            static_cast<uint64_t>(static_cast<double>(capacity) * fraction) / tenants);
}

// `spec`, shared between `tenants` as `limits` say.
NodeBudget::Spec Shared(NodeBudget::Spec spec, const Config::Limits& limits, size_t tenants) {
  spec.tenants = tenants;
  spec.guaranteed_fraction = limits.node_guaranteed_fraction;
  return spec;
}

}  // namespace

Result<NodeLimits> ReadNodeLimits(const Config::Limits& limits) {
  NodeLimits n;
  const std::optional<uint64_t> maps = ReadNumberFile("/proc/sys/vm/max_map_count");
  if (!maps) return Err(Internal("cannot read /proc/sys/vm/max_map_count"));
  n.max_map_count = *maps;

  rlimit files{};
  if (::getrlimit(RLIMIT_NOFILE, &files) != 0) return Err(Status::FromErrno(errno, "getrlimit(RLIMIT_NOFILE)"));
  if (files.rlim_cur < files.rlim_max) {
    rlimit raised = files;
    raised.rlim_cur = files.rlim_max;
    if (::setrlimit(RLIMIT_NOFILE, &raised) == 0) files = raised;
  }
  n.open_files = files.rlim_cur == RLIM_INFINITY ? UINT32_MAX : files.rlim_cur;

  const std::optional<uint64_t> ram = MemTotal();
  if (!ram) return Err(Internal("cannot read MemTotal from /proc/meminfo"));
  n.memory_bytes = *ram;
  n.memory_source = "the machine's RAM (MemTotal)";
  if (auto cgroup = CgroupMemoryLimit(); cgroup && cgroup->first < n.memory_bytes) {
    n.memory_bytes = cgroup->first;
    n.memory_source = "the memory cgroup's limit (" + cgroup->second + ")";
  }

  KVTIER_RETURN_IF_ERROR(Cap(limits.node_max_map_count, "node_max_map_count", "vm.max_map_count", &n.max_map_count));
  KVTIER_RETURN_IF_ERROR(Cap(limits.node_open_files, "node_open_files", "RLIMIT_NOFILE", &n.open_files));
  if (limits.node_memory_bytes != 0) {
    KVTIER_RETURN_IF_ERROR(Cap(limits.node_memory_bytes, "node_memory_bytes", n.memory_source, &n.memory_bytes));
    n.memory_source = "limits.node_memory_bytes";
  }
  return n;
}

uint64_t MapsInUse() {
  std::ifstream in("/proc/self/maps");
  uint64_t lines = 0;
  std::string line;
  while (std::getline(in, line)) ++lines;
  return lines;
}

uint64_t FdsInUse() {
  DIR* dir = ::opendir("/proc/self/fd");
  if (dir == nullptr) return 0;
  uint64_t n = 0;
  while (const dirent* e = ::readdir(dir)) {
    if (e->d_name[0] != '.') ++n;
  }
  ::closedir(dir);
  return n > 0 ? n - 1 : 0;  // less the directory's own descriptor
}

NodeBudget::NodeBudget(Spec spec)
    : spec_(std::move(spec)),
      tenants_(std::max<size_t>(spec_.tenants, 1)),
      capacity_(spec_.node > spec_.reserve ? spec_.node - spec_.reserve : 0),
      share_(Share(spec_, capacity_)),
      used_(tenants_, 0) {
  MutexLock lock(&mu_);
  unused_guarantees_ = share_ * tenants_;
}

Status NodeBudget::Take(uint32_t tenant, std::string_view tenant_name, uint64_t n,
                        std::chrono::steady_clock::time_point now) {
  MutexLock lock(&mu_);
  uint64_t& mine = used_.at(tenant);
  const uint64_t within = std::min(n, Unused(mine));
  // Within its guarantee a take moves room from unused_guarantees_ to
  // total_; past it, the borrowed part must fit beside everything used and
  // everything still guaranteed to others.
  if (n > within && total_ + unused_guarantees_ + (n - within) > capacity_) {
    ++refusals_;
    ++refused_since_warning_;
    const std::string message =
        "tenant " + std::string(tenant_name) + " would hold " + Amount(mine + n, spec_.unit) +
        ", past its guaranteed share of " + Amount(share_, spec_.unit) + ", and the rest of the node's " +
        spec_.limit + " is held by or guaranteed to other tenants (" + Amount(capacity_, spec_.unit) + " for " +
        std::to_string(tenants_) + " tenant(s) after kvtierd's own " + Amount(spec_.reserve, spec_.unit) + "; " +
        spec_.per_tenant_setting + " " + Amount(spec_.per_tenant_limit, spec_.unit) + ")";
    if (warnings_ == 0 || now - last_warning_ >= kWarningInterval) {
      spdlog::warn("node limit {}: {} refused since the last warning; the latest: {}; {}", spec_.limit,
                   refused_since_warning_, message, spec_.remedy);
      ++warnings_;
      refused_since_warning_ = 0;
      last_warning_ = now;
    }
    return Status(StatusCode::kResourceExhausted, message + "; " + spec_.remedy);
  }
  mine += n;
  total_ += n;
  unused_guarantees_ -= within;
  return Status::Ok();
}

void NodeBudget::Give(uint32_t tenant, uint64_t n) {
  MutexLock lock(&mu_);
  uint64_t& mine = used_.at(tenant);
  n = std::min(n, mine);
  const uint64_t before = Unused(mine);
  mine -= n;
  total_ -= n;
  unused_guarantees_ += Unused(mine) - before;
}

uint64_t NodeBudget::used(uint32_t tenant) const {
  MutexLock lock(&mu_);
  return used_.at(tenant);
}

NodeBudgetFigures NodeBudget::figures() const {
  MutexLock lock(&mu_);
  return NodeBudgetFigures{.limit = spec_.label,
                           .node = spec_.node,
                           .reserve = spec_.reserve,
                           .capacity = capacity_,
                           .share = share_,
                           .pool = capacity_ - share_ * tenants_,
                           .used = total_,
                           .refusals = refusals_,
                           .warnings = warnings_};
}

std::string NodeBudget::Describe() const {
  const uint64_t sum = spec_.per_tenant_limit * tenants_;
  std::string s = spec_.limit + " " + Amount(spec_.node, spec_.unit) + ": " + Amount(spec_.reserve, spec_.unit) +
                  " kept for kvtierd, " + Amount(capacity_, spec_.unit) + " for " + std::to_string(tenants_) +
                  (tenants_ == 1 ? " tenant (" : " tenants (") + spec_.per_tenant_setting + " " +
                  Amount(spec_.per_tenant_limit, spec_.unit) + " each";
  if (sum > capacity_) {
    s += ", " + Amount(sum, spec_.unit) + " in all: past it, so each is guaranteed " + Amount(share_, spec_.unit) +
         ", and " + Amount(capacity_ - share_ * tenants_, spec_.unit) +
         " are lent to whichever asks, up to its limit)";
  } else {
    s += ": all of it guaranteed)";
  }
  return s;
}

NodeBudgets::NodeBudgets(const NodeLimits& node, const Config& config, size_t tenants)
    : NodeBudgets(node, config.limits, tenants, MapsInUse(),
                  FdsInUse() + kMaxUnauthenticated + (config.tiers.disk.enabled ? DiskTier::kIndexMaxOpenFiles : 0),
                  config.tiers.host.bytes) {}

NodeBudgets::NodeBudgets(const NodeLimits& node, const Config::Limits& limits, size_t tenants,
                         uint64_t maps_in_use, uint64_t fds_reserved, uint64_t host_tier_bytes)
    : maps(Shared(
          {.label = "vm.max_map_count",
           .limit = "vm.max_map_count",
           .unit = "maps",
           .per_tenant_setting = "limits.max_mappings_per_tenant",
           .remedy = "close KV caches no longer used, or raise vm.max_map_count (sysctl)",
           .node = node.max_map_count,
           .reserve = maps_in_use + kMapsHeadroom,
           .per_tenant_limit = limits.max_mappings_per_tenant},
          limits, tenants)),
      sessions(Shared(
          {.label = "RLIMIT_NOFILE",
           .limit = "RLIMIT_NOFILE",
           .unit = "descriptors",
           .per_tenant_setting = "limits.max_sessions_per_tenant (a descriptor each)",
           .remedy = "close sessions no longer used, or raise kvtierd's open-files limit (LimitNOFILE=)",
           .node = node.open_files,
           .reserve = fds_reserved + kFdsHeadroom,
           .per_tenant_limit = limits.max_sessions_per_tenant},
          limits, tenants)),
      memory(Shared(
          {.label = "memory",
           .limit = "memory (" + node.memory_source + ")",
           .unit = "bytes",
           .per_tenant_setting = "limits.max_mapped_bytes_per_tenant",
           .remedy = "close KV caches no longer used, wait for ops in flight, or give kvtierd more memory",
           .node = node.memory_bytes,
           .reserve = host_tier_bytes + kMemoryHeadroom,
           .per_tenant_limit = limits.max_mapped_bytes_per_tenant},
          limits, tenants)) {}

Result<std::shared_ptr<NodeCharge>> NodeCharge::Take(std::shared_ptr<NodeBudgets> node,
                                                     NodeBudget NodeBudgets::*budget, uint32_t tenant,
                                                     std::string_view tenant_name, uint64_t n) {
  KVTIER_RETURN_IF_ERROR(((*node).*budget).Take(tenant, tenant_name, n));
  return std::shared_ptr<NodeCharge>(new NodeCharge(std::move(node), budget, tenant, n));
}

}  // namespace kvtier
