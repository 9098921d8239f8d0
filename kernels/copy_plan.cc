#include "kernels/copy_plan.h"

#include <algorithm>
#include <bit>

#include "common/check.h"

namespace kvtier {
namespace {

// Largest power of two <= 16 dividing every value (0 divides by anything).
uint32_t CommonAlignment(std::initializer_list<uint64_t> values) {
  uint64_t bits = 16;
  for (uint64_t v : values) bits |= v;
  return uint32_t{1} << std::countr_zero(bits);  // at most 16: bit 4 is set
}

}  // namespace

CopyPlan CopyPlan::Build(const KvCacheLayout& layout, const MappedRegions& regions, bool by_layer) {
  KVTIER_CHECK(regions.region_bases.size() == layout.region_sizes_bytes().size());
  const LayoutSpec& spec = layout.layout().spec();
  CopyPlan plan;
  plan.num_blocks_ = layout.num_blocks();
  plan.block_bytes_ = layout.layout().block_bytes();
  const uint32_t per_layer = KvCacheLayout::PiecesPerLayer(layout.layout());
  plan.num_layers_ = by_layer ? spec.num_layers : 1;
  plan.layer_begin_.push_back(0);
  uint64_t slot_offset = 0;
  for (uint32_t i = 0; i < layout.placements().size(); ++i) {
    const Placement& p = layout.placements()[i];
    const bool layer_starts = by_layer && i > 0 && i % per_layer == 0;
    if (layer_starts) plan.layer_begin_.push_back(static_cast<uint32_t>(plan.pieces_.size()));
    CopyPiece piece;
    piece.engine = reinterpret_cast<uint64_t>(regions.region_bases[p.region]) + p.offset_bytes;
    piece.block_stride = p.block_stride_bytes;
    piece.slot_offset = slot_offset;
    piece.row_bytes = layout.RowBytes(i);
    if (layout.RowsPerPiece(i) > 1) {  // K, V or latent: tokens x heads
      piece.outer = spec.block_tokens;
      piece.outer_stride = p.token_stride_bytes;
      piece.inner = spec.num_kv_heads;
      piece.inner_stride = p.head_stride_bytes;
    }
    // Back-to-back heads make one row per token; back-to-back tokens one row.
    if (piece.inner == 1 || piece.inner_stride == piece.row_bytes) {
      piece.row_bytes *= piece.inner;
      piece.inner = 1;
      piece.inner_stride = 0;
    }
    // Tokens fold into the row only once it is a whole token (heads folded):
    // with head-major rows (HND), the next row in the engine is the next
    // token of the same head, which is not the next row of the slot.
    if (piece.inner == 1 && (piece.outer == 1 || piece.outer_stride == piece.row_bytes)) {
      piece.row_bytes *= piece.outer;
      piece.outer = 1;
      piece.outer_stride = 0;
    }
    slot_offset += piece.bytes();
    // A single-row piece right after the previous single-row piece, for every
    // block (same block stride), extends it.
    if (!plan.pieces_.empty() && !layer_starts) {
      CopyPiece& prev = plan.pieces_.back();
      if (prev.outer == 1 && prev.inner == 1 && piece.outer == 1 && piece.inner == 1 &&
          prev.block_stride == piece.block_stride && prev.engine + prev.row_bytes == piece.engine) {
        prev.row_bytes += piece.row_bytes;
        continue;
      }
    }
    plan.pieces_.push_back(piece);
  }
  KVTIER_CHECK(slot_offset == plan.block_bytes_);
  plan.layer_begin_.push_back(static_cast<uint32_t>(plan.pieces_.size()));
  KVTIER_CHECK(plan.layer_begin_.size() == plan.num_layers_ + 1);
  for (CopyPiece& piece : plan.pieces_) {
    piece.align = CommonAlignment({piece.engine, piece.row_bytes, piece.slot_offset,
                                   plan.num_blocks_ > 1 ? piece.block_stride : 0,
                                   piece.outer > 1 ? piece.outer_stride : 0,
                                   piece.inner > 1 ? piece.inner_stride : 0});
    plan.max_piece_bytes_ = std::max(plan.max_piece_bytes_, piece.bytes());
  }
  return plan;
}

}  // namespace kvtier
