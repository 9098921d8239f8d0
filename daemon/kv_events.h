// KV events in vLLM's format (vllm/distributed/kv_events.py), for KV-aware
// routers: what blocks a tier of this node gained or lost, batched as
// `[ts, [events], data_parallel_rank]` and encoded with msgpack exactly as
// vLLM's msgspec structs are (the pinned vLLM release decodes them; golden
// bytes in tests/daemon/kv_events_test.cc).
//
// Pure functions and value types; thread-compatible. Only daemon/ uses them
// (the publisher sends what EncodeKvEventBatch makes).
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

namespace kvtier {

// Where a block is, by the names consumers know (Dynamo's from_kv_medium,
// llm-d's tiers, SGLang's mediums).
enum class KvEventMedium { kGpu, kCpu, kDisk, kExternal };
std::string_view KvEventMediumName(KvEventMedium medium);  // "GPU", "CPU", "DISK", "EXTERNAL"

// An engine's block hash, as the engine gave it (up to 32 bytes, e.g. a
// sha256 digest).
struct EngineBlockHash {
  static constexpr size_t kMaxBytes = 32;
  std::array<uint8_t, kMaxBytes> bytes{};
  uint8_t size = 0;

  std::span<const uint8_t> view() const { return {bytes.data(), size}; }
  // The low 64 bits, as vLLM sends a hash by default: the last 8 bytes, big
  // endian (`int.from_bytes(h, "big") & (2**64 - 1)`).
  uint64_t Low64() const;
  // Errors are the caller's: more than kMaxBytes is refused (nullopt).
  static std::optional<EngineBlockHash> From(std::span<const uint8_t> bytes);
  static EngineBlockHash FromU64(uint64_t value);  // 8 bytes, big endian
  friend bool operator==(const EngineBlockHash&, const EngineBlockHash&) = default;
};

struct BlockStoredEvent {
  std::vector<EngineBlockHash> block_hashes;
  std::optional<EngineBlockHash> parent_block_hash;  // the block before the first; none at a sequence start
  std::vector<uint32_t> token_ids;                   // all tokens of the listed blocks
  uint32_t block_size = 0;                           // tokens per block
  std::optional<std::string> lora_name;
  KvEventMedium medium = KvEventMedium::kCpu;
};

struct BlockRemovedEvent {
  std::vector<EngineBlockHash> block_hashes;
  KvEventMedium medium = KvEventMedium::kCpu;
};

struct AllBlocksClearedEvent {};

using KvEvent = std::variant<BlockStoredEvent, BlockRemovedEvent, AllBlocksClearedEvent>;

struct KvEventEncoding {
  // Each event a map with its tag under "type" (vLLM since #42892, the
  // default), or a positional array led by its tag (older vLLM; llm-d reads
  // positions).
  bool positional = false;
  // Hashes as vLLM sends them by default: the low 64 bits as an unsigned
  // integer; or the engine's bytes (msgpack bin).
  bool hashes_as_bytes = false;
};

// One batch's msgpack payload: [ts, [events...], dp_rank] (dp_rank nil when
// unset).
std::string EncodeKvEventBatch(double ts, std::span<const KvEvent> events, std::optional<int32_t> dp_rank,
                               const KvEventEncoding& encoding);

}  // namespace kvtier
