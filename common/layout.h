// Layout: the shape of one engine's KV cache block, shared by the daemon and
// the client library.
//
// A block is the KV state of `block_tokens` consecutive tokens across all
// layers of one tensor-parallel rank. In kvtier's own slots a block is stored
// contiguously, layer by layer:
//
//   for each layer:  K[block_tokens][num_kv_heads][head_dim]
//                    V[block_tokens][num_kv_heads][head_dim]   (absent for kLatent)
//                    scale[scale_bytes_per_layer]              (quantized dtypes only)
//
// How the engine's own cache is strided (vLLM, SGLang, ...) is described when
// the cache is registered, not here: it does not change a block's content, so
// it is not part of the fingerprint.
//
// The fingerprint is XXH3-128 of the canonical encoding in docs/hashing.md; it
// names the namespace a block belongs to and changes when any field changes.
//
// Layout is an immutable, validated value: build it with Layout::Create.
// Thread-compatible.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "common/key128.h"
#include "common/status.h"

namespace kvtier {

enum class KvKind : uint8_t {
  kSeparateKv = 1,  // a K tensor and a V tensor per layer
  kLatent = 2,      // one latent tensor per layer (MLA); num_kv_heads must be 1
};

enum class DType : uint8_t {
  kFp16 = 1,
  kBf16 = 2,
  kFp32 = 3,
  kFp8E4M3 = 4,
  kFp8E5M2 = 5,
};

// How blocks are stored below host memory (kernels/codec.h,
// docs/compression.md): as they are; lossless (bit-exact); fp8 (LOSSY).
enum class CodecKind : uint8_t { kNone = 0, kLossless = 1, kFp8 = 2 };

// A codec with what it needs to know of the blocks (kernels/codec.h).
struct CodecParams {
  CodecKind kind = CodecKind::kNone;
  DType dtype = DType::kBf16;
  uint32_t group_elems = 128;  // fp8: elements per scale

  friend bool operator==(const CodecParams&, const CodecParams&) = default;
};

// Bytes per element; 0 for a value outside the enum.
size_t DTypeSizeBytes(DType dtype);
std::string_view DTypeName(DType dtype);
std::string_view KvKindName(KvKind kind);
std::string_view CodecName(CodecKind kind);  // "none", "lossless", "fp8"
// Errors: kInvalidArgument naming the text.
Result<CodecKind> ParseCodec(std::string_view name);
// Parses "fp16", "bf16", "fp32", "fp8_e4m3", "fp8_e5m2".
Result<DType> ParseDType(std::string_view name);
// Parses "kv" (separate K and V) or "latent".
Result<KvKind> ParseKvKind(std::string_view name);

// The plain fields, as an engine describes its cache.
struct LayoutSpec {
  std::string model_id;                 // e.g. "meta-llama/Llama-3.1-8B"; 1..256 bytes
  uint32_t num_layers = 0;              // > 0
  KvKind kv_kind = KvKind::kSeparateKv;
  uint32_t num_kv_heads = 0;            // > 0; heads on this rank
  uint32_t head_dim = 0;                // > 0
  DType dtype = DType::kBf16;
  uint32_t block_tokens = 0;            // > 0; tokens per block
  uint32_t tp_rank = 0;                 // < tp_size
  uint32_t tp_size = 1;                 // > 0
  // Per-layer, per-block scale region for fp8 dtypes (0 = none). Must be 0 for
  // the other dtypes.
  uint32_t scale_bytes_per_layer = 0;
};

class Layout {
 public:
  static constexpr size_t kMaxModelIdBytes = 256;
  // A block larger than this is certainly a misconfiguration.
  static constexpr uint64_t kMaxBlockBytes = uint64_t{1} << 30;

  // Validates the spec. Errors: kInvalidArgument naming the field for zero
  // sizes, tp_rank >= tp_size, a latent layout with more than one head, a
  // scale region on a non-fp8 dtype, unknown enum values, an empty or overlong
  // model id, or a block size that overflows or exceeds kMaxBlockBytes.
  static Result<Layout> Create(LayoutSpec spec);

  const LayoutSpec& spec() const { return spec_; }
  // Bytes of one K (or V, or latent) tensor of one layer of one block.
  uint64_t tensor_bytes() const { return tensor_bytes_; }
  // Bytes of one layer of one block (K, V and scale).
  uint64_t layer_bytes() const { return layer_bytes_; }
  // Bytes of one whole block: num_layers * layer_bytes().
  uint64_t block_bytes() const { return block_bytes_; }
  const LayoutFingerprint& fingerprint() const { return fingerprint_; }

  // One line for logs: "model=... layers=32 kv=kv heads=8 dim=128 dtype=bf16 ...".
  std::string ToString() const;

 private:
  Layout() = default;

  LayoutSpec spec_;
  uint64_t tensor_bytes_ = 0;
  uint64_t layer_bytes_ = 0;
  uint64_t block_bytes_ = 0;
  LayoutFingerprint fingerprint_;
};

}  // namespace kvtier
