// Helpers around the FlatBuffers wire schema (ipc/kvtier.fbs), shared by the
// daemon and the client: building and verifying messages, and converting keys,
// layouts and status codes. docs/protocol.md describes the messages.
//
// Pure functions; thread-safe.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include <flatbuffers/flatbuffers.h>

#include "common/key128.h"
#include "common/kv_cache_layout.h"
#include "common/layout.h"
#include "common/status.h"
#include "ipc/kvtier_generated.h"

namespace kvtier::ipc {

inline constexpr uint32_t kProtocolVersion = 1;
// Messages the daemon sends are small except StatsReply and TenantList; the
// client accepts replies up to this size.
inline constexpr size_t kMaxReplyBytes = 1 << 20;

// Checks `bytes` with the FlatBuffers verifier (bounded depth and table
// count) and returns the root. Errors: kInvalidArgument ("malformed message").
Result<const wire::Message*> VerifyMessage(std::span<const uint8_t> bytes);

// Finishes `b` as a Message with `id` and the given body, and returns the bytes.
template <typename T>
std::vector<uint8_t> FinishMessage(flatbuffers::FlatBufferBuilder& b, uint64_t id,
                                   flatbuffers::Offset<T> body) {
  const auto msg = wire::CreateMessage(b, id, wire::BodyTraits<T>::enum_value, body.Union());
  b.Finish(msg);
  return {b.GetBufferPointer(), b.GetBufferPointer() + b.GetSize()};
}

// An Error reply.
std::vector<uint8_t> ErrorMessage(uint64_t id, const Status& status);

template <typename Tag>
wire::Key ToWire(const Key128<Tag>& key) {
  return wire::Key(flatbuffers::span<const uint8_t, 16>(key.bytes.data(), 16));
}

template <typename Key>
Key FromWire(const wire::Key& w) {
  Key key;
  std::copy(w.bytes()->begin(), w.bytes()->end(), key.bytes.begin());
  return key;
}

// Copies a (verified) key vector; an absent vector is empty.
std::vector<BlockKey> KeysFromWire(const flatbuffers::Vector<const wire::Key*>* keys);

flatbuffers::Offset<wire::Layout> LayoutToWire(flatbuffers::FlatBufferBuilder& b, const Layout& layout);
// Errors: kInvalidArgument when the layout is absent or invalid (Layout::Create).
Result<Layout> LayoutFromWire(const wire::Layout* w);

wire::Placement PlacementToWire(const Placement& p);
Placement PlacementFromWire(const wire::Placement& w);

// A Store's KV-event fields (wire::Store, client BlockEventInfo): the sizes
// that must agree with `keys` and the limits. Errors: kInvalidArgument
// naming the field.
struct BlockEventSizes {
  static constexpr uint32_t kMaxHashBytes = 32;
  static constexpr uint32_t kMaxBlockSize = 4096;  // tokens per block
  static constexpr size_t kMaxLoraNameBytes = 255;
  size_t keys = 0;
  uint32_t hash_bytes = 0;
  size_t hashes = 0;  // bytes of engine_hashes
  size_t parent = 0;  // bytes of the parent hash
  size_t tokens = 0;  // token ids
  uint32_t block_size = 0;
  size_t lora_name = 0;  // bytes
};
Status CheckBlockEventSizes(const BlockEventSizes& s);

// An engine's retention hint (Store, Hint; docs/policy.md). Errors:
// kInvalidArgument for a priority other than -1, 0, 1, or a next_use_ms
// past kMaxNextUseMs.
inline constexpr uint32_t kMaxNextUseMs = 3'600'000;  // an hour
Status CheckRetentionHint(int priority, uint32_t next_use_ms);

wire::Code CodeToWire(StatusCode code);
// Unknown codes from a newer peer become kInternal.
StatusCode CodeFromWire(wire::Code code);
Status StatusFromWire(wire::Code code, const flatbuffers::String* message);

}  // namespace kvtier::ipc
