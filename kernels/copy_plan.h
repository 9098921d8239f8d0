// CopyPlan: one engine KV cache layout resolved to addresses and normalised
// into the descriptors that both copy implementations walk: the CPU reference
// (kernels/copy_reference.h, used by the host backend) and the CUDA kernels
// (kernels/copy_kernels.h). Both read exactly these descriptors, so they
// cannot disagree about where a byte goes.
//
// A block's slot (canonical order, common/layout.h) is the concatenation of
// its pieces. Piece p of engine block b is `outer` x `inner` rows of
// `row_bytes` contiguous bytes each; row (o, i) starts at
//
//   engine + b * block_stride + o * outer_stride + i * inner_stride
//
// and lands at slot_offset + (o * inner + i) * row_bytes in the slot.
//
// Normalisation makes rows as long as the engine allows: heads that are
// back to back become one row per token, tokens that are back to back one row
// per piece, and whole pieces that are back to back in the engine (a
// contiguous or page-first cache) are merged, so a contiguous cache copies
// one range per block. A plan built by layer merges pieces only within a
// layer, so that each layer's pieces can be copied on their own (layer-by-
// layer loads: layer_pieces).
//
// Value type; thread-compatible.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "common/kv_cache_layout.h"

namespace kvtier {

struct CopyPiece {
  uint64_t engine = 0;        // address of block 0's piece
  uint64_t block_stride = 0;
  uint64_t outer_stride = 0;
  uint64_t inner_stride = 0;
  uint64_t slot_offset = 0;
  uint64_t row_bytes = 0;
  uint32_t outer = 1;
  uint32_t inner = 1;
  // The largest power of two (<= 16) that divides every engine address and
  // slot offset of the piece and row_bytes: the widest access the kernels
  // may use (the slot base's own alignment is checked at launch).
  uint32_t align = 1;
  uint32_t pad_ = 0;

  uint64_t bytes() const { return row_bytes * outer * inner; }
};

// Where the registered regions of one engine are mapped in this process (or,
// for the CUDA backend, in the device's address space). region_bases[i] must
// be the start of region i, valid for layout.region_sizes_bytes()[i] bytes.
struct MappedRegions {
  std::span<uint8_t* const> region_bases;
};

class CopyPlan {
 public:
  // REQUIRES: one base per region of `layout` (KVTIER_CHECK: a violation is
  // a bug, not input). The placements were validated by KvCacheLayout.
  static CopyPlan Build(const KvCacheLayout& layout, const MappedRegions& regions, bool by_layer = false);

  const std::vector<CopyPiece>& pieces() const { return pieces_; }
  uint32_t num_layers() const { return num_layers_; }
  // The pieces of layer `layer` (a plan built by layer; otherwise layer 0
  // has them all). REQUIRES: layer < num_layers().
  std::span<const CopyPiece> layer_pieces(uint32_t layer) const {
    return std::span<const CopyPiece>(pieces_).subspan(layer_begin_[layer], layer_begin_[layer + 1] - layer_begin_[layer]);
  }
  uint32_t num_blocks() const { return num_blocks_; }
  uint64_t block_bytes() const { return block_bytes_; }
  // The largest piece, for sizing kernel grids.
  uint64_t max_piece_bytes() const { return max_piece_bytes_; }

 private:
  std::vector<CopyPiece> pieces_;
  // Index of each layer's first piece, and pieces_.size() last: by layer,
  // num_layers_ + 1 entries; otherwise {0, pieces_.size()} (one "layer").
  std::vector<uint32_t> layer_begin_;
  uint32_t num_layers_ = 1;
  uint32_t num_blocks_ = 0;
  uint64_t block_bytes_ = 0;
  uint64_t max_piece_bytes_ = 0;
};

}  // namespace kvtier
