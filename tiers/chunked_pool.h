// ChunkedPool<T>: objects of one type at addresses that never change, in
// fixed-size chunks allocated as the pool grows, with a free list threaded
// through the free cells.
//
// BlockIndex keeps its entries here because entries point at each other (LRU
// neighbours, parent and children): a container that moves or rehashes its
// elements would break those links, and a node-based one pays an allocation
// per entry and an O(n) rehash. Growing the pool costs one chunk allocation;
// nothing already in it moves. Chunks are aligned to their size, so an
// object's chunk is its address rounded down (as CacheLib finds an item's
// slab), and each chunk keeps a bitmap of its live cells for ForEach.
//
// Memory: sizeof(T) per object plus a bit, and the chunks stay allocated at
// the pool's high-water mark (freed cells are reused first). Under
// AddressSanitizer a free cell is poisoned, so a use after Delete is caught
// even though the memory stays with the pool.
//
// Thread-compatible.
#pragma once

#include <sanitizer/asan_interface.h>

#include <bit>
#include <cstddef>
#include <cstdint>
#include <new>
#include <type_traits>
#include <vector>

#include "common/check.h"

namespace kvtier {

template <typename T, size_t kChunkBytes = size_t{512} << 10>
class ChunkedPool {
 public:
  ChunkedPool() = default;
  ~ChunkedPool() {
    if constexpr (!std::is_trivially_destructible_v<T>) {
      ForEach([](T* p) { p->~T(); });
    }
    for (Chunk* c : chunks_) {
      ASAN_UNPOISON_MEMORY_REGION(c, sizeof(Chunk));
      c->~Chunk();
      ::operator delete (c, std::align_val_t{kChunkBytes});
    }
  }
  ChunkedPool(const ChunkedPool&) = delete;
  ChunkedPool& operator=(const ChunkedPool&) = delete;

  // A value-initialized T, valid until Delete. Aborts when out of memory.
  T* New() {
    std::byte* cell;
    if (free_ != nullptr) {
      cell = static_cast<std::byte*>(static_cast<void*>(free_));
      ASAN_UNPOISON_MEMORY_REGION(cell, sizeof(T));
      free_ = free_->next;
    } else {
      if (chunks_.empty() || bump_ == kCellsPerChunk) AddChunk();
      cell = chunks_.back()->cells[bump_++];
    }
    Chunk* c = ChunkOf(cell);
    const size_t i = CellIndex(c, cell);
    c->live[i / 64] |= uint64_t{1} << (i % 64);
    ++size_;
    return new (cell) T();
  }

  // REQUIRES: `p` came from New and was not deleted since (checked).
  void Delete(T* p) {
    std::byte* cell = static_cast<std::byte*>(static_cast<void*>(p));
    Chunk* c = ChunkOf(cell);
    const size_t i = CellIndex(c, cell);
    const uint64_t bit = uint64_t{1} << (i % 64);
    KVTIER_CHECK((c->live[i / 64] & bit) != 0);
    c->live[i / 64] &= ~bit;
    p->~T();
    free_ = new (cell) FreeCell{free_};
    ASAN_POISON_MEMORY_REGION(cell, sizeof(T));
    --size_;
  }

  size_t size() const { return size_; }
  size_t capacity() const { return chunks_.size() * kCellsPerChunk; }

  // A 32-bit name of a live object (never 0), and the object it names: for
  // links between objects at half a pointer's size. O(1). REQUIRES: the
  // pool has fewer than 2^32 cells (checked as chunks are added).
  // An id is the chunk's number and the cell's index + 1 in bit fields, so
  // At is a shift and a mask.
  uint32_t IdOf(const T* p) const {
    std::byte* cell = static_cast<std::byte*>(static_cast<void*>(const_cast<T*>(p)));
    Chunk* c = ChunkOf(cell);
    return static_cast<uint32_t>((c->number << kIdCellBits) | (CellIndex(c, cell) + 1));
  }
  T* At(uint32_t id) const {
    if (id == 0) return nullptr;
    return std::launder(static_cast<T*>(
        static_cast<void*>(chunks_[id >> kIdCellBits]->cells[(id & ((uint32_t{1} << kIdCellBits) - 1)) - 1])));
  }

  // f(T*) once for every live object, in address order within each chunk.
  // f must not New or Delete.
  template <typename F>
  void ForEach(F&& f) {
    for (size_t i = 0; i < chunks_.size(); ++i) ForEachIn(i, f);
  }
  // Chunks never go away, so a walk a chunk at a time (ForEachIn(0), (1),
  // ... while i < chunks()) sees every object that lives throughout it.
  size_t chunks() const { return chunks_.size(); }
  // f(T*) for every live object of chunk `i` (< chunks()), in address order.
  // f must not New or Delete.
  template <typename F>
  void ForEachIn(size_t i, F&& f) {
    Chunk* c = chunks_[i];
    for (size_t w = 0; w < kWords; ++w) {
      for (uint64_t bits = c->live[w]; bits != 0; bits &= bits - 1) {
        f(std::launder(static_cast<T*>(static_cast<void*>(c->cells[w * 64 + std::countr_zero(bits)]))));
      }
    }
  }

 private:
  struct FreeCell {
    FreeCell* next;
  };
  static_assert(sizeof(T) >= sizeof(FreeCell) && alignof(T) >= alignof(FreeCell));
  static_assert(std::has_single_bit(kChunkBytes) && kChunkBytes >= 64 * sizeof(T));

  // As many cells as fit beside their bitmap.
  static constexpr size_t kCellsPerChunk =
      (kChunkBytes - (kChunkBytes / sizeof(T) / 64 + 2) * 8 - alignof(T)) / sizeof(T);
  static constexpr size_t kWords = (kCellsPerChunk + 63) / 64;
  static constexpr int kIdCellBits = std::bit_width(kCellsPerChunk);  // holds index + 1
  struct Chunk {
    uint64_t number;        // its index in chunks_
    uint64_t live[kWords];  // bit i: cell i holds an object
    alignas(T) std::byte cells[kCellsPerChunk][sizeof(T)];
  };
  static_assert(sizeof(Chunk) <= kChunkBytes);

  static Chunk* ChunkOf(std::byte* cell) {
    return reinterpret_cast<Chunk*>(reinterpret_cast<uintptr_t>(cell) & ~(kChunkBytes - 1));
  }
  static size_t CellIndex(Chunk* c, std::byte* cell) {
    return static_cast<size_t>(cell - c->cells[0]) / sizeof(T);
  }

  void AddChunk() {
    void* memory = ::operator new (kChunkBytes, std::align_val_t{kChunkBytes}, std::nothrow);
    KVTIER_CHECK_MSG(memory != nullptr, "out of memory for a block index chunk");
    // Default-initialized: the cells stay untouched until used.
    Chunk* c = new (memory) Chunk;
    KVTIER_CHECK_MSG((chunks_.size() + 1) << kIdCellBits <= (uint64_t{1} << 32), "pool past its 32-bit ids");
    c->number = chunks_.size();
    for (uint64_t& w : c->live) w = 0;
    chunks_.push_back(c);
    bump_ = 0;
  }

  std::vector<Chunk*> chunks_;  // owned
  FreeCell* free_ = nullptr;
  size_t bump_ = 0;  // cells of chunks_.back() handed out so far
  size_t size_ = 0;
};

}  // namespace kvtier
