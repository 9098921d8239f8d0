#include "daemon/kv_events.h"

#include <msgpack.hpp>

#include <algorithm>
#include <cstring>

namespace kvtier {
namespace {

using Packer = msgpack::packer<msgpack::sbuffer>;

void PackHash(Packer& p, const EngineBlockHash& h, const KvEventEncoding& encoding) {
  if (encoding.hashes_as_bytes) {
    p.pack_bin(h.size);
    p.pack_bin_body(reinterpret_cast<const char*>(h.bytes.data()), h.size);
  } else {
    p.pack_uint64(h.Low64());
  }
}

void PackHashes(Packer& p, const std::vector<EngineBlockHash>& hashes, const KvEventEncoding& encoding) {
  p.pack_array(static_cast<uint32_t>(hashes.size()));
  for (const EngineBlockHash& h : hashes) PackHash(p, h, encoding);
}

void PackString(Packer& p, std::string_view s) {
  p.pack_str(static_cast<uint32_t>(s.size()));
  p.pack_str_body(s.data(), s.size());
}

void PackOptionalString(Packer& p, const std::optional<std::string>& s) {
  if (s) {
    PackString(p, *s);
  } else {
    p.pack_nil();
  }
}

// A map header as msgspec writes it for a struct: a fixmap when the struct
// has at most 15 fields (its tag included), else a map16 whatever the count
// (it reserves the header before knowing which defaults it omits).
void PackStructMap(msgpack::sbuffer& buffer, Packer& p, uint32_t entries, uint32_t struct_fields) {
  if (struct_fields <= 15) {
    p.pack_map(entries);
  } else {
    const char header[3] = {static_cast<char>(0xde), static_cast<char>(entries >> 8), static_cast<char>(entries)};
    buffer.write(header, sizeof(header));
  }
}

// vLLM 0.33.0's BlockStored has 15 fields and its tag; BlockRemoved 5.
constexpr uint32_t kBlockStoredFields = 16;
constexpr uint32_t kBlockRemovedFields = 6;

void Pack(msgpack::sbuffer& buffer, Packer& p, const BlockStoredEvent& e, const KvEventEncoding& encoding) {
  if (encoding.positional) {
    p.pack_array(8);
  } else {
    PackStructMap(buffer, p, 8, kBlockStoredFields);
    PackString(p, "type");
  }
  PackString(p, "BlockStored");
  auto field = [&](std::string_view name) {
    if (!encoding.positional) PackString(p, name);
  };
  field("block_hashes");
  PackHashes(p, e.block_hashes, encoding);
  field("parent_block_hash");
  if (e.parent_block_hash) {
    PackHash(p, *e.parent_block_hash, encoding);
  } else {
    p.pack_nil();
  }
  field("token_ids");
  p.pack_array(static_cast<uint32_t>(e.token_ids.size()));
  for (uint32_t t : e.token_ids) p.pack_uint32(t);
  field("block_size");
  p.pack_uint32(e.block_size);
  field("lora_id");  // deprecated; always nil
  p.pack_nil();
  field("medium");
  PackString(p, KvEventMediumName(e.medium));
  field("lora_name");
  PackOptionalString(p, e.lora_name);
}

void Pack(msgpack::sbuffer& buffer, Packer& p, const BlockRemovedEvent& e, const KvEventEncoding& encoding) {
  if (encoding.positional) {
    p.pack_array(3);
  } else {
    PackStructMap(buffer, p, 3, kBlockRemovedFields);
    PackString(p, "type");
  }
  PackString(p, "BlockRemoved");
  if (!encoding.positional) PackString(p, "block_hashes");
  PackHashes(p, e.block_hashes, encoding);
  if (!encoding.positional) PackString(p, "medium");
  PackString(p, KvEventMediumName(e.medium));
}

void Pack(msgpack::sbuffer&, Packer& p, const AllBlocksClearedEvent&, const KvEventEncoding& encoding) {
  if (encoding.positional) {
    p.pack_array(1);
  } else {
    p.pack_map(1);
    PackString(p, "type");
  }
  PackString(p, "AllBlocksCleared");
}

}  // namespace

std::string_view KvEventMediumName(KvEventMedium medium) {
  switch (medium) {
    case KvEventMedium::kGpu:
      return "GPU";
    case KvEventMedium::kCpu:
      return "CPU";
    case KvEventMedium::kDisk:
      return "DISK";
    case KvEventMedium::kExternal:
      return "EXTERNAL";
  }
  return "CPU";
}

uint64_t EngineBlockHash::Low64() const {
  uint64_t v = 0;
  const size_t from = size > 8 ? size - 8 : 0;
  for (size_t i = from; i < size; ++i) v = (v << 8) | bytes[i];
  return v;
}

std::optional<EngineBlockHash> EngineBlockHash::From(std::span<const uint8_t> in) {
  if (in.size() > kMaxBytes) return std::nullopt;
  EngineBlockHash h;
  std::copy(in.begin(), in.end(), h.bytes.begin());
  h.size = static_cast<uint8_t>(in.size());
  return h;
}

EngineBlockHash EngineBlockHash::FromU64(uint64_t value) {
  EngineBlockHash h;
  for (int i = 0; i < 8; ++i) h.bytes[static_cast<size_t>(i)] = static_cast<uint8_t>(value >> (56 - 8 * i));
  h.size = 8;
  return h;
}

std::string EncodeKvEventBatch(double ts, std::span<const KvEvent> events, std::optional<int32_t> dp_rank,
                               const KvEventEncoding& encoding) {
  msgpack::sbuffer buffer;
  Packer p(&buffer);
  p.pack_array(3);
  // A float64 always, as msgspec writes a float (msgpack-cxx would write a
  // whole-numbered double as an integer).
  uint64_t bits = 0;
  std::memcpy(&bits, &ts, sizeof(bits));
  char f64[9] = {static_cast<char>(0xcb)};
  for (size_t i = 0; i < 8; ++i) f64[1 + i] = static_cast<char>(bits >> (56 - 8 * i));
  buffer.write(f64, sizeof(f64));
  p.pack_array(static_cast<uint32_t>(events.size()));
  for (const KvEvent& e : events) {
    std::visit([&](const auto& event) { Pack(buffer, p, event, encoding); }, e);
  }
  if (dp_rank) {
    p.pack_int32(*dp_rank);
  } else {
    p.pack_nil();
  }
  return std::string(buffer.data(), buffer.size());
}

}  // namespace kvtier
