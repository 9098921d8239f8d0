// RedisClusterProcess: a real Redis Cluster of a test's own, from Debian's
// redis-server and redis-cli: `masters` nodes with `replicas` replicas each
// on TCP ports of 127.0.0.1 (or Options::host; each also uses its port +
// 10000 for the cluster bus, kept below the ephemeral port range), joined by
// `redis-cli --cluster create`, persistence off. A node whose port another
// process took before it could bind starts again on other ports. Nodes can
// be killed and started again to inject faults; all are killed (SIGKILL,
// then their directories removed) when it is destroyed, and if the test
// process dies (PR_SET_PDEATHSIG).
//
// For tests and kvtier-bench; thread-compatible.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/status.h"
#include "tiers/remote/cluster_slots.h"

namespace kvtier::testing {

class RedisClusterProcess {
 public:
  static constexpr int kBusOffset = 10000;  // a node's cluster bus port: its port + this

  struct Options {
    int masters = 3;
    int replicas = 1;  // per master
    std::string maxmemory = "64mb";
    std::string maxmemory_policy = "allkeys-lru";
    int node_timeout_ms = 1500;  // failure detection; Redis' default is 15000
    // false: the nodes keep serving their slots while another has none.
    bool require_full_coverage = false;
    // A standalone redis-server (no cluster) instead: masters = 1, no replicas.
    bool standalone = false;
    // The IPv4 address the nodes listen on and announce (a veth's, for
    // clients in other network namespaces).
    std::string host = "127.0.0.1";
    // The default user's password (requirepass, and masterauth for the
    // replicas); empty: none, and then Redis' protected mode takes only
    // loopback clients.
    std::string password = "";
  };

  // Errors: kNotFound without redis-server / redis-cli; kUnavailable when the
  // cluster does not form within 30 s (the logs' tails in the message).
  static Result<std::unique_ptr<RedisClusterProcess>> Start(const Options& options);
  ~RedisClusterProcess();
  RedisClusterProcess(const RedisClusterProcess&) = delete;
  RedisClusterProcess& operator=(const RedisClusterProcess&) = delete;

  size_t size() const { return ports_.size(); }
  NodeAddress node(size_t i) const { return NodeAddress{options_.host, ports_[i]}; }
  std::vector<NodeAddress> seeds() const;
  // The nodes that are masters now (asked from a live node).
  Result<std::vector<NodeAddress>> Masters() const;

  void Kill(size_t i);
  Status Restart(size_t i);
  // Until every live node reports cluster_state:ok and agrees on the
  // masters. Errors: kDeadlineExceeded.
  Status WaitHealthy(std::chrono::seconds timeout = std::chrono::seconds(30)) const;
  // Runs redis-cli with `args` (shell words), output to the cluster's log.
  // Errors: kInternal with the exit status and the log's tail.
  Status Cli(const std::string& args) const;

 private:
  RedisClusterProcess(Options options, std::string dir) : options_(std::move(options)), dir_(std::move(dir)) {}
  Status Spawn(size_t i);
  std::string LogTails() const;

  Options options_;
  std::string dir_;
  std::vector<uint16_t> ports_;
  std::vector<pid_t> pids_;
};

// `n` ports in [lo, hi) for cluster nodes: each with its bus port
// (+kBusOffset) free by `is_free`, and neither of them equal to another
// picked port or bus port, nor to one of `avoid` or its bus port. Its own
// for its test.
std::vector<uint16_t> PickClusterPorts(size_t n, std::mt19937& random, uint16_t lo, uint16_t hi,
                                       const std::function<bool(uint16_t)>& is_free,
                                       const std::vector<uint16_t>& avoid);

}  // namespace kvtier::testing
