#include "ipc/wire.h"

namespace kvtier::ipc {

Result<const wire::Message*> VerifyMessage(std::span<const uint8_t> bytes) {
  // Depth 16 and 100k tables bound the verifier's own work on hostile input.
  flatbuffers::Verifier::Options options;
  options.max_depth = 16;
  options.max_tables = 100000;
  flatbuffers::Verifier verifier(bytes.data(), bytes.size(), options);
  if (bytes.size() < sizeof(flatbuffers::uoffset_t) || !wire::VerifyMessageBuffer(verifier)) {
    return Err(InvalidArgument("malformed message (FlatBuffers verification failed)"));
  }
  const wire::Message* msg = wire::GetMessage(bytes.data());
  if (msg->body_type() == wire::Body::NONE || msg->body() == nullptr) {
    return Err(InvalidArgument("message without a body"));
  }
  return msg;
}

std::vector<uint8_t> ErrorMessage(uint64_t id, const Status& status) {
  flatbuffers::FlatBufferBuilder b(256);
  const auto body = wire::CreateErrorDirect(b, CodeToWire(status.code()), status.message().c_str());
  return FinishMessage(b, id, body);
}

std::vector<BlockKey> KeysFromWire(const flatbuffers::Vector<const wire::Key*>* keys) {
  std::vector<BlockKey> out;
  if (keys == nullptr) return out;
  out.reserve(keys->size());
  for (const wire::Key* k : *keys) out.push_back(FromWire<BlockKey>(*k));
  return out;
}

flatbuffers::Offset<wire::Layout> LayoutToWire(flatbuffers::FlatBufferBuilder& b, const Layout& layout) {
  const LayoutSpec& s = layout.spec();
  return wire::CreateLayoutDirect(b, s.model_id.c_str(), s.num_layers,
                                  static_cast<wire::KvKind>(s.kv_kind), s.num_kv_heads, s.head_dim,
                                  static_cast<wire::DType>(s.dtype), s.block_tokens, s.tp_rank,
                                  s.tp_size, s.scale_bytes_per_layer);
}

Result<Layout> LayoutFromWire(const wire::Layout* w) {
  if (w == nullptr) return Err(InvalidArgument("layout is missing"));
  LayoutSpec s;
  s.model_id = w->model_id() != nullptr ? w->model_id()->str() : "";
  s.num_layers = w->num_layers();
  s.kv_kind = static_cast<KvKind>(w->kv_kind());
  s.num_kv_heads = w->num_kv_heads();
  s.head_dim = w->head_dim();
  s.dtype = static_cast<DType>(w->dtype());
  s.block_tokens = w->block_tokens();
  s.tp_rank = w->tp_rank();
  s.tp_size = w->tp_size();
  s.scale_bytes_per_layer = w->scale_bytes_per_layer();
  return Layout::Create(std::move(s));  // validates every field, enums included
}

wire::Placement PlacementToWire(const Placement& p) {
  return wire::Placement(p.region, p.offset_bytes, p.block_stride_bytes, p.token_stride_bytes,
                         p.head_stride_bytes);
}

Placement PlacementFromWire(const wire::Placement& w) {
  return Placement{.region = w.region(),
                   .offset_bytes = w.offset(),
                   .block_stride_bytes = w.block_stride(),
                   .token_stride_bytes = w.token_stride(),
                   .head_stride_bytes = w.head_stride()};
}

wire::Code CodeToWire(StatusCode code) { return static_cast<wire::Code>(code); }

StatusCode CodeFromWire(wire::Code code) {
  if (code > wire::Code::MAX) return StatusCode::kInternal;
  return static_cast<StatusCode>(code);
}

Status StatusFromWire(wire::Code code, const flatbuffers::String* message) {
  const StatusCode c = CodeFromWire(code);
  if (c == StatusCode::kOk) return Status::Ok();
  return Status(c, message != nullptr ? message->str() : std::string());
}

Status CheckRetentionHint(int priority, uint32_t next_use_ms) {
  if (priority < -1 || priority > 1) {
    return InvalidArgument("retention priority " + std::to_string(priority) +
                           ": -1 (evict first), 0 (no hint) or 1 (keep)");
  }
  if (next_use_ms > kMaxNextUseMs) {
    return InvalidArgument("next_use_ms " + std::to_string(next_use_ms) + " is past the most, " +
                           std::to_string(kMaxNextUseMs) + " (an hour)");
  }
  return Status::Ok();
}

Status CheckBlockEventSizes(const BlockEventSizes& s) {
  auto bad = [](const std::string& what) { return InvalidArgument("store events: " + what); };
  if (s.hash_bytes == 0 || s.hash_bytes > BlockEventSizes::kMaxHashBytes) {
    return bad("hash_bytes must be 1-" + std::to_string(BlockEventSizes::kMaxHashBytes) + ", not " +
               std::to_string(s.hash_bytes));
  }
  if (s.hashes != s.keys * s.hash_bytes) {
    return bad(std::to_string(s.hashes) + " bytes of engine hashes for " + std::to_string(s.keys) + " keys of " +
               std::to_string(s.hash_bytes) + " bytes each");
  }
  if (s.parent != 0 && s.parent != s.hash_bytes) {
    return bad("the parent hash has " + std::to_string(s.parent) + " bytes, not " + std::to_string(s.hash_bytes));
  }
  if (s.block_size > BlockEventSizes::kMaxBlockSize) {
    return bad("block_size " + std::to_string(s.block_size) + " is over " +
               std::to_string(BlockEventSizes::kMaxBlockSize) + " tokens");
  }
  if (s.tokens != 0 && s.tokens != s.keys * s.block_size) {
    return bad(std::to_string(s.tokens) + " token ids for " + std::to_string(s.keys) + " blocks of " +
               std::to_string(s.block_size) + " tokens");
  }
  if (s.lora_name > BlockEventSizes::kMaxLoraNameBytes) {
    return bad("lora_name is over " + std::to_string(BlockEventSizes::kMaxLoraNameBytes) + " bytes");
  }
  return Status::Ok();
}

}  // namespace kvtier::ipc
