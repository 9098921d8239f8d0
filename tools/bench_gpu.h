// kvtier-bench gpu: the batched CUDA gather/scatter kernels
// (kernels/cuda/copy_kernels.h) between a paged engine KV cache in device
// memory and kvtier's contiguous slots, next to one contiguous cudaMemcpyAsync
// of the same bytes, measured in the same run on the same stream:
//
//   gather D2H   engine (HBM) -> slots in mapped pinned host memory
//   scatter H2D  slots in mapped pinned host memory -> engine
//   gather D2D   engine -> slots in a cudaMalloc arena
//   scatter D2D  slots in the arena -> engine
//   fp8 encode   engine -> fp8-coded slots in pinned host memory (a coded
//                store; kernels/cuda/codec_kernels.h), against a D2H copy of
//                the raw bytes
//   fp8 decode   coded slots in pinned host memory -> engine (a coded load),
//                against an H2D copy of the raw bytes
//
// The model is Llama-3-8B-like (32 layers, separate K and V, 8 KV heads x 128,
// bf16), so a 16-token block is 2 MiB; --block-bytes changes the tokens per
// block. The copied blocks are scattered over the engine cache (a fixed-seed
// permutation). Each direction is first checked byte for byte against the
// CPU reference (kernels/copy_reference.h) on host copies of the engine, and
// the codec against the CPU codec (kernels/codec.h), on finite bf16 data.
//
// Built with the CUDA toolkit (bench_gpu.cc); without it, Gpu() says so
// (bench_gpu_stub.cc), so the command line is the same in both builds.
// Thread-compatible: one call at a time per process.
#pragma once

#include <cstdint>
#include <string>

namespace kvtier::bench {

struct GpuOptions {
  int device = 0;                     // CUDA device index
  uint64_t block_bytes = 2ull << 20;  // a multiple of 128 KiB (one token of all 32 layers)
  uint32_t blocks = 256;              // blocks copied per measurement
  uint32_t cache_blocks = 0;          // engine cache blocks; 0 = 2 * blocks; >= blocks
  uint32_t reps = 7;                  // timed repetitions, median reported, after one warm-up
  // vllm-nhd, vllm-hnd, sglang-layer-first, sglang-page-first or contiguous
  // (common/kv_cache_layout.h).
  std::string layout = "vllm-nhd";
  std::string json;  // also write the comparisons here (empty: no)
};

// Runs the workload and prints the machine, configuration, verification and
// a table of kvtier vs baseline GB/s with each row's target ratio (0.9 for
// H2D/D2H, 0.8 for D2D; informational, not part of the exit code).
// Returns the process exit code: 0 done (whatever the ratios), 1 a CUDA error
// or a verification mismatch, 2 bad options or built without CUDA, 3 no
// usable CUDA device.
int Gpu(const GpuOptions& options);

}  // namespace kvtier::bench
