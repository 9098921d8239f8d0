// Node budgets: what the machine allows kvtierd as a whole, shared between
// the named tenants, so that tenants each within their own limits cannot
// together take what another one needs.
//
// At start the Server reads the node's limits (ReadNodeLimits):
//   - vm.max_map_count: memory maps of the whole process; each region of a
//     registered KV cache is one;
//   - RLIMIT_NOFILE, its soft limit raised to the hard one: each session
//     holds one descriptor;
//   - memory: the memory cgroup's limit, else the machine's RAM; pages
//     kvtierd writes into holes of a client's memfd are charged to it, and
//     so is what a load or store holds while it runs (kOpBytesPerKey).
// limits.node_* set any of them lower. From each, kvtierd keeps its own
// reserve (what it uses once its tiers are open, and headroom), and a
// NodeBudget shares the rest (the capacity) between the named tenants:
//   - where the tenants' limits add up to no more than the capacity, each
//     may use its whole limit, guaranteed;
//   - past that, a part of the capacity (limits.node_guaranteed_fraction,
//     half by default) is split evenly into guaranteed shares, and the rest
//     is a pool that any tenant borrows from, up to its own limit, while
//     there is some. A tenant below its share always gets what it asks up to
//     it, whatever the others did: nothing is lent out of a guarantee, since
//     nothing lent can be taken back (a mapping or a session stays until its
//     client lets it go).
// A take past that is refused with kResourceExhausted naming the node limit,
// counted per limit, and logged at WARNING at most once a minute per limit.
//
// Fair shares, not a refusal of the config: the defaults (4,096 maps and 256
// sessions a tenant) add up past a stock vm.max_map_count with 16 tenants;
// a config that each tenant fits but all of them do not only at once still
// serves them all, and the pool lets the busy ones have more than an even
// split where the others are idle. `kvtierd --check-config` prints each
// budget, its shares and its pool.
//
// Take is called by the event loop; Give by any thread (a mapping is
// released where its last user drops it). Thread-safe.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/mutex.h"
#include "common/status.h"
#include "config/config.h"

namespace kvtier {

struct NodeLimits {
  uint64_t max_map_count = 0;
  uint64_t open_files = 0;  // RLIMIT_NOFILE's soft limit, raised to its hard one
  uint64_t memory_bytes = 0;
  std::string memory_source;  // where memory_bytes comes from, for messages
};

// Reads the node's limits, raising this process's RLIMIT_NOFILE soft limit
// to its hard one, and caps each by limits.node_* where set. Errors:
// kInvalidArgument when a limits.node_* is above the node's; kInternal when
// /proc cannot be read.
Result<NodeLimits> ReadNodeLimits(const Config::Limits& limits);

// What this process uses now: lines of /proc/self/maps, entries of
// /proc/self/fd. 0 where /proc cannot be read.
uint64_t MapsInUse();
uint64_t FdsInUse();

struct NodeBudgetFigures {
  std::string limit;      // Spec::label
  uint64_t node = 0;      // the node's value
  uint64_t reserve = 0;   // kvtierd's own
  uint64_t capacity = 0;  // for tenants: node - reserve
  uint64_t share = 0;     // each named tenant's guaranteed share
  uint64_t pool = 0;      // capacity less the shares: lent on demand
  uint64_t used = 0;      // by all tenants
  uint64_t refusals = 0;  // takes refused for this limit
  uint64_t warnings = 0;  // WARNING lines logged about them
};

class NodeBudget {
 public:
  struct Spec {
    std::string label;     // short, for metrics: "vm.max_map_count", "RLIMIT_NOFILE", "memory"
    std::string limit;     // the node's limit, for messages: "vm.max_map_count"
    std::string unit;      // what is counted, plural: "maps", "sessions", "bytes"
    std::string per_tenant_setting;  // "limits.max_mappings_per_tenant"
    std::string remedy;    // how an operator raises the node's limit
    uint64_t node = 0;
    uint64_t reserve = 0;
    uint64_t per_tenant_limit = 0;
    size_t tenants = 1;  // named tenants, at least 1
    double guaranteed_fraction = 0.5;  // in (0, 1]
  };
  static constexpr std::chrono::seconds kWarningInterval{60};

  explicit NodeBudget(Spec spec);

  // `n` more for tenant `tenant` (< spec.tenants), or kResourceExhausted
  // naming the node limit, the tenant's use and its guaranteed share.
  // Checks only the node's budget: the per-tenant limit is its caller's.
  Status Take(uint32_t tenant, std::string_view tenant_name, uint64_t n,
              std::chrono::steady_clock::time_point now = std::chrono::steady_clock::now());
  // Gives back what a Take took (any part of it, once).
  void Give(uint32_t tenant, uint64_t n);

  uint64_t used(uint32_t tenant) const;
  NodeBudgetFigures figures() const;
  const Spec& spec() const { return spec_; }

  // "vm.max_map_count 65530 maps: 2530 maps kept for kvtierd, 63000 maps
  // for 24 tenants (...)": the capacity, shares and pool, for
  // --check-config and the start-up log.
  std::string Describe() const;

 private:
  uint64_t Unused(uint64_t used) const { return used < share_ ? share_ - used : 0; }

  const Spec spec_;
  const size_t tenants_;  // spec_.tenants, at least 1
  const uint64_t capacity_;
  const uint64_t share_;
  mutable Mutex mu_;
  std::vector<uint64_t> used_ KVTIER_GUARDED_BY(mu_);
  uint64_t total_ KVTIER_GUARDED_BY(mu_) = 0;
  // What the tenants are guaranteed and do not use yet: sum of
  // max(0, share - used) over the tenants.
  uint64_t unused_guarantees_ KVTIER_GUARDED_BY(mu_) = 0;
  uint64_t refusals_ KVTIER_GUARDED_BY(mu_) = 0;
  uint64_t warnings_ KVTIER_GUARDED_BY(mu_) = 0;
  uint64_t refused_since_warning_ KVTIER_GUARDED_BY(mu_) = 0;
  std::chrono::steady_clock::time_point last_warning_ KVTIER_GUARDED_BY(mu_){};
};

// The three budgets of a daemon: maps (vm.max_map_count, by
// max_mappings_per_tenant), sessions (RLIMIT_NOFILE, by
// max_sessions_per_tenant) and mapped host memory (by
// max_mapped_bytes_per_tenant). What kvtierd keeps of each, with headroom:
// the maps and descriptors this process uses when they are made (once its
// tiers are open), the descriptors that connections before their Hello and
// the disk index may still open, and the host tier's memory.
struct NodeBudgets {
  NodeBudgets(const NodeLimits& node, const Config& config, size_t tenants);
  NodeBudgets(const NodeLimits& node, const Config::Limits& limits, size_t tenants, uint64_t maps_in_use,
              uint64_t fds_reserved, uint64_t host_tier_bytes);
  NodeBudget maps;
  NodeBudget sessions;
  NodeBudget memory;
  // The three, for what reports each alike.
  std::array<const NodeBudget*, 3> all() const { return {&maps, &sessions, &memory}; }

  // What a load or store holds in kvtierd's memory per key while it runs,
  // at most (its keys, leases, engine block ids and copies, in the request,
  // the cache and the backend): charged to `memory` from its start to its
  // end (NodeCharge), so that a tenant's ops in flight (sessions times
  // limits.max_inflight_ops_per_session) stay within its share.
  static constexpr uint64_t kOpBytesPerKey = 128;
  // Connections that have not said Hello yet, at most (Server refuses more).
  static constexpr uint64_t kMaxUnauthenticated = 256;
  static constexpr uint64_t kMapsHeadroom = 1024;
  static constexpr uint64_t kFdsHeadroom = 64;  // metrics scrapes, remote connections, files
  static constexpr uint64_t kMemoryHeadroom = 1ull << 30;
};

// One Take of a NodeBudgets budget, given back when the last copy of the
// charge is dropped (an op's memory: its completion callback holds it, on
// whatever thread that callback is let go).
class NodeCharge {
 public:
  // Errors: NodeBudget::Take's.
  static Result<std::shared_ptr<NodeCharge>> Take(std::shared_ptr<NodeBudgets> node, NodeBudget NodeBudgets::*budget,
                                                  uint32_t tenant, std::string_view tenant_name, uint64_t n);
  NodeCharge(const NodeCharge&) = delete;
  NodeCharge& operator=(const NodeCharge&) = delete;
  ~NodeCharge() { ((*node_).*budget_).Give(tenant_, n_); }

 private:
  NodeCharge(std::shared_ptr<NodeBudgets> node, NodeBudget NodeBudgets::*budget, uint32_t tenant, uint64_t n)
      : node_(std::move(node)), budget_(budget), tenant_(tenant), n_(n) {}
  const std::shared_ptr<NodeBudgets> node_;
  NodeBudget NodeBudgets::*const budget_;
  const uint32_t tenant_;
  const uint64_t n_;
};

}  // namespace kvtier
