#include "common/layout.h"

#include <vector>

#include "common/byte_writer.h"
#include "common/xxh128.h"

namespace kvtier {
namespace {

// Multiplies into *acc; false on overflow.
bool MulInto(uint64_t* acc, uint64_t factor) { return !__builtin_mul_overflow(*acc, factor, acc); }

Status FieldError(std::string_view field, std::string_view what) {
  std::string message = "layout.";
  message += field;
  message += ": ";
  message += what;
  return InvalidArgument(std::move(message));
}

bool IsFp8(DType dtype) { return dtype == DType::kFp8E4M3 || dtype == DType::kFp8E5M2; }

// The canonical encoding hashed into the fingerprint; docs/hashing.md
// specifies it byte for byte.
std::vector<uint8_t> CanonicalEncoding(const LayoutSpec& s) {
  ByteWriter w;
  w.Bytes("KVTLAYT1");
  w.LengthPrefixed(s.model_id);
  w.U32(s.num_layers);
  w.U8(static_cast<uint8_t>(s.kv_kind));
  w.U32(s.num_kv_heads);
  w.U32(s.head_dim);
  w.U8(static_cast<uint8_t>(s.dtype));
  w.U32(s.block_tokens);
  w.U32(s.tp_rank);
  w.U32(s.tp_size);
  w.U32(s.scale_bytes_per_layer);
  return std::move(w).Take();
}

}  // namespace

size_t DTypeSizeBytes(DType dtype) {
  switch (dtype) {
    case DType::kFp16:
    case DType::kBf16:
      return 2;
    case DType::kFp32:
      return 4;
    case DType::kFp8E4M3:
    case DType::kFp8E5M2:
      return 1;
  }
  return 0;
}

std::string_view DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kFp16: return "fp16";
    case DType::kBf16: return "bf16";
    case DType::kFp32: return "fp32";
    case DType::kFp8E4M3: return "fp8_e4m3";
    case DType::kFp8E5M2: return "fp8_e5m2";
  }
  return "invalid";
}

std::string_view KvKindName(KvKind kind) {
  switch (kind) {
    case KvKind::kSeparateKv: return "kv";
    case KvKind::kLatent: return "latent";
  }
  return "invalid";
}

std::string_view CodecName(CodecKind kind) {
  switch (kind) {
    case CodecKind::kNone: return "none";
    case CodecKind::kLossless: return "lossless";
    case CodecKind::kFp8: return "fp8";
  }
  return "?";
}

Result<CodecKind> ParseCodec(std::string_view name) {
  for (CodecKind k : {CodecKind::kNone, CodecKind::kLossless, CodecKind::kFp8}) {
    if (name == CodecName(k)) return k;
  }
  return Err(InvalidArgument("unknown codec '" + std::string(name) + "' (none, lossless or fp8)"));
}

Result<DType> ParseDType(std::string_view name) {
  for (DType d : {DType::kFp16, DType::kBf16, DType::kFp32, DType::kFp8E4M3, DType::kFp8E5M2}) {
    if (name == DTypeName(d)) return d;
  }
  return Err(InvalidArgument("unknown dtype '" + std::string(name) +
                             "' (expected fp16, bf16, fp32, fp8_e4m3 or fp8_e5m2)"));
}

Result<KvKind> ParseKvKind(std::string_view name) {
  for (KvKind k : {KvKind::kSeparateKv, KvKind::kLatent}) {
    if (name == KvKindName(k)) return k;
  }
  return Err(InvalidArgument("unknown kv kind '" + std::string(name) + "' (expected kv or latent)"));
}

Result<Layout> Layout::Create(LayoutSpec spec) {
  if (spec.model_id.empty()) return Err(FieldError("model_id", "must not be empty"));
  if (spec.model_id.size() > kMaxModelIdBytes) {
    return Err(FieldError("model_id", "longer than " + std::to_string(kMaxModelIdBytes) + " bytes"));
  }
  if (spec.num_layers == 0) return Err(FieldError("num_layers", "must be > 0"));
  if (spec.num_kv_heads == 0) return Err(FieldError("num_kv_heads", "must be > 0"));
  if (spec.head_dim == 0) return Err(FieldError("head_dim", "must be > 0"));
  if (spec.block_tokens == 0) return Err(FieldError("block_tokens", "must be > 0"));
  if (spec.tp_size == 0) return Err(FieldError("tp_size", "must be > 0"));
  if (spec.tp_rank >= spec.tp_size) {
    return Err(FieldError("tp_rank", std::to_string(spec.tp_rank) + " must be < tp_size " +
                                         std::to_string(spec.tp_size)));
  }
  if (spec.kv_kind != KvKind::kSeparateKv && spec.kv_kind != KvKind::kLatent) {
    return Err(FieldError("kv_kind", "unknown value " + std::to_string(static_cast<int>(spec.kv_kind))));
  }
  if (spec.kv_kind == KvKind::kLatent && spec.num_kv_heads != 1) {
    return Err(FieldError("num_kv_heads", "must be 1 for a latent (MLA) layout"));
  }
  const size_t elem = DTypeSizeBytes(spec.dtype);
  if (elem == 0) {
    return Err(FieldError("dtype", "unknown value " + std::to_string(static_cast<int>(spec.dtype))));
  }
  if (spec.scale_bytes_per_layer != 0 && !IsFp8(spec.dtype)) {
    return Err(FieldError("scale_bytes_per_layer", "a scale region needs an fp8 dtype"));
  }

  uint64_t tensor = spec.block_tokens;
  bool ok = MulInto(&tensor, spec.num_kv_heads) && MulInto(&tensor, spec.head_dim) &&
            MulInto(&tensor, elem);
  uint64_t layer = tensor;
  ok = ok && MulInto(&layer, spec.kv_kind == KvKind::kSeparateKv ? 2 : 1) &&
       !__builtin_add_overflow(layer, uint64_t{spec.scale_bytes_per_layer}, &layer);
  uint64_t block = layer;
  ok = ok && MulInto(&block, spec.num_layers);
  if (!ok || block > kMaxBlockBytes) {
    return Err(FieldError("block_tokens", "block size overflows or exceeds " +
                                              std::to_string(kMaxBlockBytes) + " bytes"));
  }

  Layout layout;
  const std::vector<uint8_t> encoding = CanonicalEncoding(spec);
  layout.fingerprint_ = Xxh3_128<LayoutFingerprint>(encoding);
  layout.spec_ = std::move(spec);
  layout.tensor_bytes_ = tensor;
  layout.layer_bytes_ = layer;
  layout.block_bytes_ = block;
  return layout;
}

std::string Layout::ToString() const {
  const LayoutSpec& s = spec_;
  std::string out = "model=" + s.model_id;
  out += " layers=" + std::to_string(s.num_layers);
  out += " kv=" + std::string(KvKindName(s.kv_kind));
  out += " heads=" + std::to_string(s.num_kv_heads);
  out += " head_dim=" + std::to_string(s.head_dim);
  out += " dtype=" + std::string(DTypeName(s.dtype));
  out += " block_tokens=" + std::to_string(s.block_tokens);
  out += " tp=" + std::to_string(s.tp_rank) + "/" + std::to_string(s.tp_size);
  if (s.scale_bytes_per_layer != 0) out += " scale_bytes=" + std::to_string(s.scale_bytes_per_layer);
  out += " block_bytes=" + std::to_string(block_bytes_);
  out += " fingerprint=" + fingerprint_.ToHex();
  return out;
}

}  // namespace kvtier
