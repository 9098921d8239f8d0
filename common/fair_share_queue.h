// FairShareQueue: items of several flows (kvtierd: tenants), each flow's in
// order, flows served by the service they have had (issue 46): start-time
// fair queuing.
// - Every flow has a virtual time: the cost of what it has been served
//   (bytes copied, requests read). Pop serves the flow with the least.
// - Flows that are always backlogged are served alike by cost, whatever
//   their number of sessions or items: one tenant's 64 sessions get what
//   another tenant's one session gets, and a tenant of large blocks no more
//   bytes than one of small blocks.
// - A flow that was idle comes back at the virtual time of the item served
//   last (unless it had more than its share: then at its own, later): it is
//   served next, and then in turn with the backlogged flows. Idling earns no
//   credit.
//
// Work per Push and Pop is O(log active flows); a flow's state is kept
// while idle (flows are tenants: bounded).
//
// Thread-compatible: its owner serializes calls (the event loop; the host
// backend's mutex).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <optional>
#include <set>
#include <unordered_map>
#include <utility>

namespace kvtier {

template <typename T>
class FairShareQueue {
 public:
  // Queues `item` of `flow`, behind the flow's others. `cost` is charged to
  // the flow when the item is served.
  void Push(uint32_t flow, uint64_t cost, T item) {
    Flow& f = flows_[flow];
    if (f.items.empty()) {
      f.vtime = std::max(f.vtime, clock_);
      active_.emplace(f.vtime, flow);
    }
    f.items.push_back(Item{cost, std::move(item)});
  }

  // The first item of the flow with the least virtual time (ties: the
  // lower flow), or nullopt when none is queued.
  std::optional<T> Pop() {
    if (active_.empty()) return std::nullopt;
    const uint32_t flow = active_.begin()->second;
    active_.erase(active_.begin());
    Flow& f = flows_.find(flow)->second;
    clock_ = std::max(clock_, f.vtime);
    Item item = std::move(f.items.front());
    f.items.pop_front();
    f.vtime += item.cost;
    if (!f.items.empty()) active_.emplace(f.vtime, flow);
    return std::move(item.value);
  }

  bool empty() const { return active_.empty(); }
  // Flows with an item queued.
  size_t active_flows() const { return active_.size(); }

 private:
  struct Item {
    uint64_t cost;
    T value;
  };
  struct Flow {
    uint64_t vtime = 0;
    std::deque<Item> items;
  };
  uint64_t clock_ = 0;  // the virtual time of the item served last
  std::unordered_map<uint32_t, Flow> flows_;
  std::set<std::pair<uint64_t, uint32_t>> active_;  // (vtime, flow) of flows with items
};

}  // namespace kvtier
