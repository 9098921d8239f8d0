// Redis Cluster routing, what hiredis 0.14 lacks: the hash slot of a key,
// the slot map a client keeps from CLUSTER SLOTS, and the MOVED / ASK
// redirections that correct it (the Redis Cluster specification,
// https://redis.io/docs/latest/operate/oss_and_stack/reference/cluster-spec).
//
// Pure value types and functions, no I/O; the remote tier's connections
// (tiers/remote/) use them. Thread-compatible.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace kvtier {

inline constexpr uint16_t kClusterSlots = 16384;

// CRC16-CCITT (XMODEM: polynomial 0x1021, initial 0, no reflection), the
// checksum Redis Cluster hashes keys with. CRC16("123456789") == 0x31C3.
uint16_t Crc16Xmodem(std::string_view bytes);

// The slot of a key: CRC16 of the key mod 16384, or of its hash tag: the
// bytes between the first '{' and the first '}' after it, when there is at
// least one.
uint16_t KeySlot(std::string_view key);

// A node's address as Redis writes it in redirections and CLUSTER SLOTS.
struct NodeAddress {
  std::string host;  // empty: the host of the node that answered
  uint16_t port = 0;

  std::string ToString() const { return host + ":" + std::to_string(port); }
  friend bool operator==(const NodeAddress&, const NodeAddress&) = default;
};

// "host:port", "[v6]:port" or "v6:port" (the last colon splits, as Redis
// writes IPv6 addresses). Errors: kInvalidArgument naming the text.
Result<NodeAddress> ParseNodeAddress(std::string_view text);

// A "-MOVED <slot> <host>:<port>" or "-ASK <slot> <host>:<port>" error reply
// (without the '-'). MOVED: the slot lives elsewhere now, update the map and
// retry there. ASK: the slot is migrating; send ASKING and then the command
// to that node, once, without changing the map.
struct Redirect {
  enum class Kind : uint8_t { kMoved, kAsk };
  Kind kind = Kind::kMoved;
  uint16_t slot = 0;
  NodeAddress to;
};
// nullopt for any other error text; a MOVED or ASK that does not parse is
// nullopt too (the caller treats it as an error, never guesses).
std::optional<Redirect> ParseRedirect(std::string_view error);

// Which node serves each slot. Nodes are kept by address; a slot no node
// serves maps to none (a cluster missing coverage, or before the first
// refresh).
class SlotMap {
 public:
  static constexpr uint16_t kNoNode = UINT16_MAX;

  // The node index serving `slot`, or kNoNode.
  uint16_t NodeOf(uint16_t slot) const { return slots_[slot]; }
  const NodeAddress& node(uint16_t index) const { return nodes_[index]; }
  size_t num_nodes() const { return nodes_.size(); }
  // Slots some node serves.
  uint32_t covered() const;

  // Serves [first, last] from `node`. Errors: kInvalidArgument for a range
  // outside 0..16383 or reversed.
  Status Assign(uint16_t first, uint16_t last, const NodeAddress& node);
  // A MOVED redirection: `slot` is `node`'s now.
  void Move(uint16_t slot, const NodeAddress& node);

 private:
  uint16_t IndexOf(const NodeAddress& node);

  std::vector<NodeAddress> nodes_;
  std::array<uint16_t, kClusterSlots> slots_ = MakeEmpty();

  static std::array<uint16_t, kClusterSlots> MakeEmpty() {
    std::array<uint16_t, kClusterSlots> s;
    s.fill(kNoNode);
    return s;
  }
};

}  // namespace kvtier
