// KvCacheLayout: where the blocks of one engine's paged KV cache live in the
// memory the engine registered, described by strides so that vLLM's NHD and
// HND per-layer tensors, SGLang's layer-first and page-first pools and fully
// contiguous caches are all the same thing.
//
// kvtier stores a block in its own slots in canonical order (common/layout.h):
// for each layer, K then V (or the single latent), each
// [block_tokens][num_kv_heads][head_dim], then the layer's scale bytes. A
// Placement says where one such (layer, part) piece of engine block b lives:
//
//   row (token t, head h) of engine block b starts at
//     regions[region] + offset_bytes + b * block_stride_bytes
//                     + t * token_stride_bytes + h * head_stride_bytes
//   and is head_dim * dtype_size contiguous bytes.
//
// A scale piece (fp8 layouts with scale_bytes_per_layer > 0) is one row of
// scale_bytes_per_layer bytes at offset_bytes + b * block_stride_bytes; its
// token and head strides are ignored.
//
// Pieces are listed layer by layer: K, V (absent for latent), scale (only when
// scale_bytes_per_layer > 0). So there are num_layers * PiecesPerLayer().
//
// Value type, validated by Create; thread-compatible.
#pragma once

#include <cstdint>
#include <vector>

#include "common/layout.h"
#include "common/status.h"

namespace kvtier {

struct Placement {
  uint32_t region = 0;
  uint64_t offset_bytes = 0;
  uint64_t block_stride_bytes = 0;
  uint64_t token_stride_bytes = 0;
  uint64_t head_stride_bytes = 0;
};

class KvCacheLayout {
 public:
  // Validates the placements against the layout and the sizes of the
  // registered regions. Errors (kInvalidArgument, naming the piece index):
  // wrong number of placements, a region index out of range, zero num_blocks,
  // a byte range of any block that overflows or ends beyond its region, rows
  // of one piece that overlap each other (a token or head stride smaller than
  // the row, when there is more than one token or head).
  static Result<KvCacheLayout> Create(const Layout& layout, uint32_t num_blocks,
                                      std::vector<Placement> placements,
                                      std::vector<uint64_t> region_sizes_bytes);

  // vLLM's default per-layer tensors [2, num_blocks, block_tokens, heads,
  // head_dim] (NHD), layer i in region i; for kLatent [num_blocks,
  // block_tokens, head_dim]. Fp8 scale regions are not part of vLLM's
  // tensors, so REQUIRES: scale_bytes_per_layer == 0.
  static std::vector<Placement> VllmNhd(const Layout& layout, uint32_t num_blocks);
  // One contiguous region holding num_blocks blocks back to back, each in
  // canonical order (what the shared-memory helper for CPU engines allocates).
  static std::vector<Placement> Contiguous(const Layout& layout);

  static uint32_t PiecesPerLayer(const Layout& layout);

  const Layout& layout() const { return layout_; }
  uint32_t num_blocks() const { return num_blocks_; }
  const std::vector<Placement>& placements() const { return placements_; }
  const std::vector<uint64_t>& region_sizes_bytes() const { return region_sizes_bytes_; }

  // Byte size of one row of piece `piece` (head_dim * dtype size, or the
  // scale bytes), and the number of rows (block_tokens * heads, or 1).
  uint64_t RowBytes(uint32_t piece) const;
  uint64_t RowsPerPiece(uint32_t piece) const;
  // True when every row of the piece is back to back in canonical order, so
  // the piece of one block is a single contiguous range of PieceBytes().
  bool PieceIsContiguous(uint32_t piece) const;
  uint64_t PieceBytes(uint32_t piece) const { return RowBytes(piece) * RowsPerPiece(piece); }

 private:
  KvCacheLayout(Layout layout) : layout_(std::move(layout)) {}

  Layout layout_;
  uint32_t num_blocks_ = 0;
  std::vector<Placement> placements_;
  std::vector<uint64_t> region_sizes_bytes_;
};

}  // namespace kvtier
