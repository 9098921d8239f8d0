#include "tiers/remote/cluster_slots.h"

#include <charconv>

namespace kvtier {

uint16_t Crc16Xmodem(std::string_view bytes) {
  uint16_t crc = 0;
  for (const char c : bytes) {
    crc ^= static_cast<uint16_t>(static_cast<uint8_t>(c)) << 8;
    for (int bit = 0; bit < 8; ++bit) {
      crc = (crc & 0x8000) != 0 ? static_cast<uint16_t>((crc << 1) ^ 0x1021)
                                : static_cast<uint16_t>(crc << 1);
    }
  }
  return crc;
}

uint16_t KeySlot(std::string_view key) {
  const size_t open = key.find('{');
  if (open != std::string_view::npos) {
    const size_t close = key.find('}', open + 1);
    if (close != std::string_view::npos && close > open + 1)
      key = key.substr(open + 1, close - open - 1);
  }
  return Crc16Xmodem(key) % kClusterSlots;
}

namespace {

template <typename T>
bool ParseNumber(std::string_view text, T* out) {
  const char* end = text.data() + text.size();
  auto [ptr, ec] = std::from_chars(text.data(), end, *out);
  return ec == std::errc() && ptr == end && !text.empty();
}

}  // namespace

Result<NodeAddress> ParseNodeAddress(std::string_view text) {
  const size_t colon = text.rfind(':');
  uint16_t port = 0;
  if (colon == std::string_view::npos || !ParseNumber(text.substr(colon + 1), &port) || port == 0) {
    return Err(InvalidArgument("not a node address (host:port): '" + std::string(text) + "'"));
  }
  std::string_view host = text.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']')
    host = host.substr(1, host.size() - 2);
  return NodeAddress{std::string(host), port};
}

std::optional<Redirect> ParseRedirect(std::string_view error) {
  Redirect r;
  if (error.starts_with("MOVED ")) {
    r.kind = Redirect::Kind::kMoved;
    error.remove_prefix(6);
  } else if (error.starts_with("ASK ")) {
    r.kind = Redirect::Kind::kAsk;
    error.remove_prefix(4);
  } else {
    return std::nullopt;
  }
  const size_t space = error.find(' ');
  if (space == std::string_view::npos || !ParseNumber(error.substr(0, space), &r.slot) ||
      r.slot >= kClusterSlots) {
    return std::nullopt;
  }
  Result<NodeAddress> to = ParseNodeAddress(error.substr(space + 1));
  if (!to) return std::nullopt;
  r.to = std::move(*to);
  return r;
}

uint32_t SlotMap::covered() const {
  uint32_t n = 0;
  for (const uint16_t node : slots_) n += node != kNoNode;
  return n;
}

Status SlotMap::Assign(uint16_t first, uint16_t last, const NodeAddress& node) {
  if (first > last || last >= kClusterSlots) {
    return InvalidArgument("slot range " + std::to_string(first) + "-" + std::to_string(last) +
                           " is not within 0-16383");
  }
  const uint16_t index = IndexOf(node);
  for (uint32_t s = first; s <= last; ++s) slots_[s] = index;
  return Status::Ok();
}

void SlotMap::Move(uint16_t slot, const NodeAddress& node) {
  if (slot < kClusterSlots) slots_[slot] = IndexOf(node);
}

uint16_t SlotMap::IndexOf(const NodeAddress& node) {
  for (size_t i = 0; i < nodes_.size(); ++i) {
    if (nodes_[i] == node) return static_cast<uint16_t>(i);
  }
  nodes_.push_back(node);
  return static_cast<uint16_t>(nodes_.size() - 1);
}

}  // namespace kvtier
