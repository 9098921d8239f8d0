#include "tools/redis_cluster_process.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <hiredis/hiredis.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <set>
#include <sstream>
#include <thread>

#include "tiers/remote/redis_connection.h"

namespace kvtier::testing {
namespace {

bool PortFree(const std::string& host, uint16_t port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  if (::inet_pton(AF_INET, host.c_str(), &addr.sin_addr) != 1) {
    ::close(fd);
    return false;
  }
  addr.sin_port = htons(port);
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  ::close(fd);
  return ok;
}

// The first port of the kernel's ephemeral range (outgoing connections take
// ports from there at any time); 32768 if it cannot be read.
uint16_t EphemeralLow() {
  std::ifstream in("/proc/sys/net/ipv4/ip_local_port_range");
  unsigned low = 0;
  return in >> low && low > 0 && low <= 65535 ? static_cast<uint16_t>(low) : 32768;
}

}  // namespace

std::vector<uint16_t> PickClusterPorts(size_t n, std::mt19937& random, uint16_t lo, uint16_t hi,
                                       const std::function<bool(uint16_t)>& is_free,
                                       const std::vector<uint16_t>& avoid) {
  constexpr int kBus = RedisClusterProcess::kBusOffset;
  // Every port in use: the picked ones and `avoid`, each with its bus port.
  std::set<int> used;
  for (const uint16_t q : avoid) used.insert({q, q + kBus});
  std::vector<uint16_t> out;
  while (out.size() < n) {
    const auto port = static_cast<uint16_t>(lo + random() % (hi - lo));
    if (used.contains(port) || used.contains(port + kBus)) continue;
    if (!is_free(port) || !is_free(static_cast<uint16_t>(port + kBus))) continue;
    out.push_back(port);
    used.insert({port, port + kBus});
  }
  return out;
}

namespace {

// Ports whose bus ports (+10000) stay below the ephemeral range.
std::vector<uint16_t> FreePorts(const std::string& host, size_t n,
                                const std::vector<uint16_t>& avoid) {
  static std::mt19937 random(static_cast<uint32_t>(::getpid()) * 7919u +
                             static_cast<uint32_t>(std::time(nullptr)));
  const uint16_t hi =
      static_cast<uint16_t>(std::max(EphemeralLow() - RedisClusterProcess::kBusOffset, 13000));
  return PickClusterPorts(
      n, random, 11000, hi, [&](uint16_t port) { return PortFree(host, port); }, avoid);
}

std::string Tail(const std::string& path, size_t bytes) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  const std::string all = s.str();
  return all.size() > bytes ? all.substr(all.size() - bytes) : all;
}

Result<std::string> Command(const NodeAddress& node, const std::string& password,
                            std::vector<std::string_view> argv) {
  KVTIER_ASSIGN_OR_RETURN(std::unique_ptr<RedisConnection> conn,
                          RedisConnection::Connect(RedisConnectionOptions{.address = node, .password = password}));
  KVTIER_ASSIGN_OR_RETURN(RedisReply reply, conn->Command(argv));
  if (reply->type == REDIS_REPLY_ERROR) return Err(StatusCode::kInternal, std::string(RedisErrorText(*reply)));
  if (reply->type != REDIS_REPLY_STRING && reply->type != REDIS_REPLY_STATUS) {
    return Err(StatusCode::kInternal, "unexpected reply type " + std::to_string(reply->type));
  }
  return std::string(reply->str, reply->len);
}

}  // namespace

Result<std::unique_ptr<RedisClusterProcess>> RedisClusterProcess::Start(const Options& options) {
  // Whoever starts (and kills) Redis nodes talks to them too: a write to a
  // node just killed must be EPIPE, as in kvtierd, not the end of the test.
  ::signal(SIGPIPE, SIG_IGN);
  for (const char* exe : {"/usr/bin/redis-server", "/usr/bin/redis-cli"}) {
    if (::access(exe, X_OK) != 0) {
      return Err(StatusCode::kNotFound, std::string(exe) + " is missing: tools/setup-deps.sh installs redis-server");
    }
  }
  char tmpl[] = "/tmp/kvtier-redis-cluster-XXXXXX";
  if (::mkdtemp(tmpl) == nullptr) return Err(Status::FromErrno(errno, "mkdtemp"));
  std::unique_ptr<RedisClusterProcess> cluster(new RedisClusterProcess(options, tmpl));
  const size_t n = options.standalone ? 1 : static_cast<size_t>(options.masters * (1 + options.replicas));
  in_addr ignored{};
  if (::inet_pton(AF_INET, options.host.c_str(), &ignored) != 1) {
    return Err(InvalidArgument("RedisClusterProcess: host '" + options.host + "' is not an IPv4 address"));
  }
  cluster->ports_ = FreePorts(options.host, n, {});
  cluster->pids_.assign(n, -1);
  for (size_t i = 0; i < n; ++i) KVTIER_RETURN_IF_ERROR(cluster->Spawn(i));
  // Every node answers PING. A node that exited lost its port (or its bus
  // port) to someone else between the check and its bind, as parallel tests
  // do: it gets other ports and starts again.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  for (size_t i = 0; i < n; ++i) {
    int moves = 0;
    while (!Command(cluster->node(i), options.password, {"PING"})) {
      if (std::chrono::steady_clock::now() > deadline) {
        return Err(StatusCode::kUnavailable, "redis-server " + cluster->node(i).ToString() +
                                                 " did not answer PING:\n" + cluster->LogTails());
      }
      if (::waitpid(cluster->pids_[i], nullptr, WNOHANG) == cluster->pids_[i] && moves++ < 5) {
        cluster->pids_[i] = -1;
        cluster->ports_[i] = FreePorts(options.host, 1, cluster->ports_).front();
        KVTIER_RETURN_IF_ERROR(cluster->Spawn(i));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  if (options.standalone) return cluster;
  std::string create = "--cluster create";
  for (size_t i = 0; i < n; ++i) create += " " + cluster->node(i).ToString();
  create += " --cluster-replicas " + std::to_string(options.replicas) + " --cluster-yes";
  KVTIER_RETURN_IF_ERROR(cluster->Cli(create));
  KVTIER_RETURN_IF_ERROR(cluster->WaitHealthy());
  return cluster;
}

Status RedisClusterProcess::Spawn(size_t i) {
  const std::string node_dir = dir_ + "/" + std::to_string(ports_[i]);
  std::filesystem::create_directories(node_dir);
  std::vector<std::string> args = {"/usr/bin/redis-server", "--port", std::to_string(ports_[i]),
                                   "--bind", options_.host, "--save", "", "--appendonly", "no",
                                   "--maxmemory", options_.maxmemory, "--maxmemory-policy",
                                   options_.maxmemory_policy, "--dir", node_dir,
                                   "--logfile", node_dir + "/redis.log", "--daemonize", "no"};
  if (!options_.password.empty()) {
    for (const std::string& a : {std::string("--requirepass"), options_.password, std::string("--masterauth"),
                                 options_.password}) {
      args.push_back(a);
    }
  }
  if (!options_.standalone) {
    for (const std::string& a : {std::string("--cluster-enabled"), std::string("yes"),
                                 std::string("--cluster-config-file"), node_dir + "/nodes.conf",
                                 std::string("--cluster-node-timeout"), std::to_string(options_.node_timeout_ms),
                                 std::string("--cluster-require-full-coverage"),
                                 std::string(options_.require_full_coverage ? "yes" : "no"),
                                 // A replica fails over however long ago it last heard its master (a
                                 // test's nodes are idle between bursts).
                                 std::string("--cluster-replica-validity-factor"), std::string("0")}) {
      args.push_back(a);
    }
  }
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) return Status::FromErrno(errno, "fork for redis-server");
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(1);
    const int in = ::open("/dev/null", O_RDWR | O_CLOEXEC);
    if (in >= 0) {
      ::dup2(in, STDIN_FILENO);
      ::dup2(in, STDOUT_FILENO);
    }
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  pids_[i] = pid;
  return Status::Ok();
}

RedisClusterProcess::~RedisClusterProcess() {
  for (size_t i = 0; i < pids_.size(); ++i) Kill(i);
  if (std::getenv("KVTIER_KEEP_TEST_DIRS") == nullptr) {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
}

std::vector<NodeAddress> RedisClusterProcess::seeds() const {
  std::vector<NodeAddress> out;
  for (size_t i = 0; i < ports_.size(); ++i) out.push_back(node(i));
  return out;
}

void RedisClusterProcess::Kill(size_t i) {
  if (pids_[i] <= 0) return;
  ::kill(pids_[i], SIGKILL);
  ::waitpid(pids_[i], nullptr, 0);
  pids_[i] = -1;
}

Status RedisClusterProcess::Restart(size_t i) {
  Kill(i);
  KVTIER_RETURN_IF_ERROR(Spawn(i));
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!Command(node(i), options_.password, {"PING"})) {
    if (std::chrono::steady_clock::now() > deadline) {
      return Status(StatusCode::kUnavailable, node(i).ToString() + " did not come back:\n" + LogTails());
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return Status::Ok();
}

Result<std::vector<NodeAddress>> RedisClusterProcess::Masters() const {
  for (size_t i = 0; i < ports_.size(); ++i) {
    if (pids_[i] <= 0) continue;
    Result<std::string> nodes = Command(node(i), options_.password, {"CLUSTER", "NODES"});
    if (!nodes) continue;
    std::vector<NodeAddress> masters;
    std::istringstream lines(*nodes);
    std::string line;
    while (std::getline(lines, line)) {
      std::istringstream words(line);
      std::string id, address, flags, master, ping, pong, epoch, link;
      words >> id >> address >> flags >> master >> ping >> pong >> epoch >> link;
      std::string slots;
      words >> slots;  // a master that serves no slot is not counted
      if (flags.find("master") == std::string::npos || flags.find("fail") != std::string::npos || slots.empty()) {
        continue;
      }
      Result<NodeAddress> a = ParseNodeAddress(address.substr(0, address.find('@')));
      if (a) masters.push_back(*a);
    }
    std::sort(masters.begin(), masters.end(),
              [](const NodeAddress& x, const NodeAddress& y) { return x.port < y.port; });
    return masters;
  }
  return Err(StatusCode::kUnavailable, "no live node answered CLUSTER NODES");
}

Status RedisClusterProcess::WaitHealthy(std::chrono::seconds timeout) const {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  std::string last;
  while (std::chrono::steady_clock::now() < deadline) {
    bool ok = true;
    std::set<std::string> views;
    for (size_t i = 0; i < ports_.size() && ok; ++i) {
      if (pids_[i] <= 0) continue;
      Result<std::string> info = Command(node(i), options_.password, {"CLUSTER", "INFO"});
      ok = info && info->find("cluster_state:ok") != std::string::npos;
      if (!ok) last = node(i).ToString() + ": " + (info ? info->substr(0, 40) : info.error().message());
    }
    if (ok) {
      Result<std::vector<NodeAddress>> masters = Masters();
      ok = masters && static_cast<int>(masters->size()) == options_.masters;
      if (!ok) last = "masters: " + (masters ? std::to_string(masters->size()) : masters.error().message());
      // Every master is a live node (a killed one has been failed over).
      for (size_t m = 0; ok && m < masters->size(); ++m) {
        const auto at = std::find(ports_.begin(), ports_.end(), (*masters)[m].port);
        ok = at != ports_.end() && pids_[static_cast<size_t>(at - ports_.begin())] > 0;
        if (!ok) last = "master " + (*masters)[m].ToString() + " is down, not failed over yet";
      }
    }
    if (ok) return Status::Ok();
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return Status(StatusCode::kDeadlineExceeded, "the Redis Cluster is not healthy (" + last + "):\n" + LogTails());
}

Status RedisClusterProcess::Cli(const std::string& args) const {
  const std::string log = dir_ + "/redis-cli.log";
  // The password through the environment, not the command line.
  const std::string auth = options_.password.empty() ? "" : "REDISCLI_AUTH='" + options_.password + "' ";
  const std::string command = auth + "/usr/bin/redis-cli " + args + " >>" + log + " 2>&1 </dev/null";
  const int rc = std::system(command.c_str());
  if (rc != 0) {
    return Status(StatusCode::kInternal, "redis-cli " + args + " exited " + std::to_string(rc) + ":\n" + Tail(log, 3000));
  }
  return Status::Ok();
}

std::string RedisClusterProcess::LogTails() const {
  std::string out;
  for (const uint16_t port : ports_) {
    out += "--- " + std::to_string(port) + "\n" + Tail(dir_ + "/" + std::to_string(port) + "/redis.log", 800);
  }
  return out;
}

}  // namespace kvtier::testing
