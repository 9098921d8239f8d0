#include "tiers/remote/redis_cluster.h"

#include <hiredis/hiredis.h>

#include <map>
#include <optional>
#include <thread>
#include <utility>

namespace kvtier {
namespace {

// A command of a batch on its way: which, to what node, after ASK or not.
struct Pending {
  size_t index = 0;
  NodeAddress node;
  bool asking = false;
};

}  // namespace

Result<std::unique_ptr<RedisCluster>> RedisCluster::Connect(RedisClusterOptions options) {
  if (options.seeds.empty()) return Err(InvalidArgument("redis cluster: no seed node"));
  std::unique_ptr<RedisCluster> cluster(new RedisCluster(std::move(options)));
  KVTIER_RETURN_IF_ERROR(cluster->RefreshTopology());
  return cluster;
}

RedisConnection* RedisCluster::ConnectionTo(const NodeAddress& node, Status* error) {
  const std::string name = node.ToString();
  auto it = connections_.find(name);
  if (it != connections_.end() && !it->second->broken()) return it->second.get();
  if (it != connections_.end()) connections_.erase(it);
  Result<std::unique_ptr<RedisConnection>> conn = RedisConnection::Connect(RedisConnectionOptions{
      .address = node,
      .user = options_.user,
      .password = options_.password,
      .connect_timeout = options_.connect_timeout,
      .io_timeout = options_.io_timeout,
  });
  if (!conn) {
    ++counters_.connect_failures;
    *error = conn.error();
    return nullptr;
  }
  return connections_.emplace(name, std::move(*conn)).first->second.get();
}

Status RedisCluster::ReadTopology(RedisConnection& conn, const NodeAddress& asked) {
  const std::string_view argv[] = {"CLUSTER", "SLOTS"};
  KVTIER_ASSIGN_OR_RETURN(RedisReply reply, conn.Command(argv));
  if (reply->type == REDIS_REPLY_ERROR) {
    const std::string_view text = RedisErrorText(*reply);
    if (text.find("cluster support disabled") == std::string_view::npos) {
      return Unavailable("redis " + asked.ToString() + ": CLUSTER SLOTS: " + std::string(text));
    }
    SlotMap one;
    KVTIER_RETURN_IF_ERROR(one.Assign(0, kClusterSlots - 1, asked));
    standalone_ = true;
    standalone_node_ = asked;
    slots_ = std::move(one);
    return Status::Ok();
  }
  if (reply->type != REDIS_REPLY_ARRAY) return Unavailable("redis " + asked.ToString() + ": CLUSTER SLOTS: not an array");
  SlotMap fresh;
  for (size_t i = 0; i < reply->elements; ++i) {
    const redisReply* range = reply->element[i];
    if (range->type != REDIS_REPLY_ARRAY || range->elements < 3 || range->element[0]->type != REDIS_REPLY_INTEGER ||
        range->element[1]->type != REDIS_REPLY_INTEGER || range->element[2]->type != REDIS_REPLY_ARRAY ||
        range->element[2]->elements < 2 || range->element[2]->element[0]->type != REDIS_REPLY_STRING ||
        range->element[2]->element[1]->type != REDIS_REPLY_INTEGER) {
      return Unavailable("redis " + asked.ToString() + ": CLUSTER SLOTS: malformed range " + std::to_string(i));
    }
    const redisReply* master = range->element[2];
    NodeAddress node{std::string(master->element[0]->str, master->element[0]->len),
                     static_cast<uint16_t>(master->element[1]->integer)};
    // An unknown endpoint ("" or "?") is the node that answered's host.
    if (node.host.empty() || node.host == "?") node.host = asked.host;
    const long long first = range->element[0]->integer;
    const long long last = range->element[1]->integer;
    if (first < 0 || last < first || last >= kClusterSlots) {
      return Unavailable("redis " + asked.ToString() + ": CLUSTER SLOTS: bad range " + std::to_string(first) + "-" +
                         std::to_string(last));
    }
    KVTIER_RETURN_IF_ERROR(fresh.Assign(static_cast<uint16_t>(first), static_cast<uint16_t>(last), node));
  }
  standalone_ = false;
  slots_ = std::move(fresh);
  return Status::Ok();
}

Status RedisCluster::RefreshTopology() {
  std::vector<NodeAddress> candidates;
  auto add = [&](const NodeAddress& node) {
    for (const NodeAddress& known : candidates) {
      if (known == node) return;
    }
    candidates.push_back(node);
  };
  for (uint16_t i = 0; i < slots_.num_nodes(); ++i) add(slots_.node(i));
  for (const NodeAddress& seed : options_.seeds) add(seed);
  std::string errors;
  for (const NodeAddress& node : candidates) {
    Status error;
    RedisConnection* conn = ConnectionTo(node, &error);
    if (conn != nullptr) {
      error = ReadTopology(*conn, node);
      if (error.ok()) {
        ++counters_.refreshes;
        return Status::Ok();
      }
    }
    if (error.code() == StatusCode::kUnauthenticated) return error;
    errors += (errors.empty() ? "" : "; ") + error.message();
  }
  return Unavailable("redis cluster: no node answered CLUSTER SLOTS (" + errors + ")");
}

std::vector<Result<RedisReply>> RedisCluster::Run(std::span<const RedisCommand> batch) {
  // The batch's bound, all nodes and rounds together: io_timeout, plus the
  // time its values take at kMinBytesPerSecond (a large batch on a busy
  // link is not a slow node). A node that answers slower fails its commands
  // (kUnavailable), however its bytes trickle in.
  uint64_t value_bytes = 0;
  for (const RedisCommand& command : batch) {
    for (const std::string_view part : command.value_parts) value_bytes += part.size();
    if (command.sink != nullptr) value_bytes += command.sink->max_bytes();
  }
  const auto transfer = std::chrono::duration_cast<std::chrono::steady_clock::duration>(
      std::chrono::duration<double>(static_cast<double>(value_bytes) / kMinBytesPerSecond));
  const RedisConnection::Deadline deadline = std::chrono::steady_clock::now() + options_.io_timeout + transfer;
  std::vector<std::optional<Result<RedisReply>>> done(batch.size());
  std::vector<Pending> pending;
  pending.reserve(batch.size());
  bool refresh = false;
  for (size_t i = 0; i < batch.size(); ++i) {
    const uint16_t slot = KeySlot(batch[i].argv.at(batch[i].key_index));
    const uint16_t node = standalone_ ? 0 : slots_.NodeOf(slot);
    if (node == SlotMap::kNoNode) {
      done[i] = Err(Unavailable("redis cluster: no node serves slot " + std::to_string(slot)));
      refresh = true;
      continue;
    }
    pending.push_back(Pending{i, slots_.node(node), false});
  }

  for (uint32_t round = 0; round <= options_.max_redirects && !pending.empty(); ++round) {
    // One pipeline per node: everything written before any reply is read.
    std::map<std::string, std::vector<Pending>> groups;
    for (Pending& p : pending) groups[p.node.ToString()].push_back(std::move(p));
    pending.clear();
    std::vector<std::pair<RedisConnection*, std::vector<Pending>*>> written;
    for (auto& [name, group] : groups) {
      Status error;
      RedisConnection* conn = ConnectionTo(group.front().node, &error);
      for (const Pending& p : group) {
        if (conn == nullptr) break;
        static constexpr std::string_view kAsking[] = {"ASKING"};
        if (p.asking) error = conn->Append(kAsking);
        if (error.ok()) {
          const RedisCommand& command = batch[p.index];
          error = command.value_parts.empty() ? conn->Append(command.argv)
                                              : conn->AppendWithParts(command.argv, command.value_parts, deadline);
        }
        if (!error.ok()) conn = nullptr;
      }
      if (conn == nullptr) {
        for (const Pending& p : group) done[p.index] = Err(error);
        continue;
      }
      written.emplace_back(conn, &group);
    }
    // Every node's pipeline on the wire before any reply is read, so that
    // the nodes work at once (hiredis would write each on its first read).
    std::erase_if(written, [&](const std::pair<RedisConnection*, std::vector<Pending>*>& w) {
      const Status flushed = w.first->Flush(deadline);
      if (flushed.ok()) return false;
      for (const Pending& p : *w.second) done[p.index] = Err(flushed);
      return true;
    });
    bool tryagain = false;
    for (auto& [conn, group] : written) {
      ++counters_.round_trips;
      for (size_t k = 0; k < group->size(); ++k) {
        Pending& p = (*group)[k];
        Result<RedisReply> reply =
            p.asking ? conn->Next(nullptr, deadline) : Result<RedisReply>(RedisReply());
        if (reply) reply = conn->Next(batch[p.index].sink, deadline);
        if (!reply) {  // the connection is gone: this and the rest of its group fail
          for (size_t rest = k; rest < group->size(); ++rest) done[(*group)[rest].index] = Err(reply.error());
          break;
        }
        const std::string_view text = RedisErrorText(**reply);
        if (std::optional<Redirect> redirect = ParseRedirect(text)) {
          NodeAddress to = redirect->to;
          if (to.host.empty()) to.host = p.node.host;
          if (redirect->kind == Redirect::Kind::kMoved) {
            ++counters_.moved;
            slots_.Move(redirect->slot, to);
            refresh = true;
          } else {
            ++counters_.ask;
          }
          pending.push_back(Pending{p.index, std::move(to), redirect->kind == Redirect::Kind::kAsk});
        } else if (text.starts_with("TRYAGAIN")) {  // keys of a slot being migrated: soon
          ++counters_.tryagain;
          tryagain = true;
          pending.push_back(std::move(p));
        } else {
          if (text.starts_with("CLUSTERDOWN")) refresh = true;
          done[p.index] = std::move(reply);
        }
      }
    }
    if (tryagain) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  for (const Pending& p : pending) {
    done[p.index] = Err(Unavailable("redis cluster: still redirected after " +
                                    std::to_string(options_.max_redirects) + " redirections"));
  }
  if (refresh) (void)RefreshTopology();  // a failure leaves the map as MOVED corrected it

  std::vector<Result<RedisReply>> out;
  out.reserve(batch.size());
  for (std::optional<Result<RedisReply>>& r : done) out.push_back(std::move(*r));
  return out;
}

}  // namespace kvtier
