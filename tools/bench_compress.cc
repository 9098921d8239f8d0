#include "tools/bench_compress.h"

#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/codec.h"
#include "kernels/fp8_e4m3.h"
#include "tiers/disk/record.h"
#include "tools/bench_report.h"

namespace kvtier::bench {
namespace {

// `blocks` blocks of bf16 values, laid out as [tokens, 128 channels].
std::vector<uint8_t> Data(bool outliers, size_t bytes, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::student_t_distribution<float> t3(3.0f);
  std::vector<uint8_t> out(bytes);
  for (size_t i = 0; i < bytes / 2; ++i) {
    const size_t ch = i % 128;
    const bool big = ch == 3 || ch == 40 || ch == 77 || ch == 120;
    const float x = outliers ? t3(rng) * (big ? 50.0f : 1.0f) : normal(rng);
    const uint16_t v = fp8::FloatToBf16(x);
    out[2 * i] = static_cast<uint8_t>(v);
    out[2 * i + 1] = static_cast<uint8_t>(v >> 8);
  }
  return out;
}

}  // namespace

int Compress(const CompressOptions& o) {
  const size_t block = size_t{o.block_kib} << 10;
  auto codec = BlockCodec::Create();
  if (!codec) {
    std::fprintf(stderr, "kvtier-bench: %s\n", codec.error().ToString().c_str());
    return 1;
  }
  std::printf("config:   %u blocks of %u KiB per rep, %u reps (+1 warm-up), one thread\n", o.blocks, o.block_kib,
              o.reps);
  std::vector<Comparison> cs;
  // A raw block's disk record (record.h), against the header-page record of
  // releases before version 4.
  const auto per_byte = [&](uint64_t record) { return static_cast<double>(record) / static_cast<double>(block); };
  cs.push_back({"raw: disk bytes per block byte", per_byte(RecordBytes(block)),
                per_byte(RecordBytes(block, RecordFormat::kHeaderPage)), "a header-page record (before v4)", "x"});
  int rc = 0;
  for (const bool outliers : {false, true}) {
    const char* data_name = outliers ? "outlier K" : "N(0,1)";
    const std::vector<uint8_t> raw = Data(outliers, block * o.blocks, outliers ? 2 : 1);
    std::vector<uint8_t> copy(raw.size());
    for (const CodecKind kind : {CodecKind::kLossless, CodecKind::kFp8}) {
      const CodecParams p{.kind = kind, .dtype = DType::kBf16, .group_elems = 128};
      const size_t cap = BlockCodec::MaxEncodedBytes(p, block);
      std::vector<uint8_t> stored(cap * o.blocks);
      std::vector<size_t> sizes(o.blocks);
      std::vector<uint8_t> back(raw.size());
      std::vector<double> enc, dec, mem;
      size_t stored_total = 0;
      uint64_t disk_total = 0;
      for (uint32_t rep = 0; rep <= o.reps; ++rep) {
        const auto t0 = Clock::now();
        for (uint32_t b = 0; b < o.blocks; ++b) {
          const std::optional<size_t> n = (*codec)->Encode(p, std::span(raw).subspan(b * block, block),
                                                           std::span(stored).subspan(b * cap, cap));
          sizes[b] = n.value_or(0);  // 0: stored raw
        }
        const auto t1 = Clock::now();
        for (uint32_t b = 0; b < o.blocks; ++b) {
          std::span<uint8_t> dst = std::span(back).subspan(b * block, block);
          if (sizes[b] == 0) {
            std::memcpy(dst.data(), raw.data() + b * block, block);
          } else if (!(*codec)->Decode(p, std::span(stored).subspan(b * cap, sizes[b]), dst).ok()) {
            rc = 1;
          }
        }
        const auto t2 = Clock::now();
        std::memcpy(copy.data(), raw.data(), raw.size());
        const auto t3 = Clock::now();
        if (rep == 0) continue;
        const double bytes = static_cast<double>(raw.size());
        enc.push_back(bytes / Seconds(t1 - t0) / 1e9);
        dec.push_back(bytes / Seconds(t2 - t1) / 1e9);
        mem.push_back(bytes / Seconds(t3 - t2) / 1e9);
        stored_total = 0;
        disk_total = 0;
        for (size_t s : sizes) {
          stored_total += s == 0 ? block : s;
          // The disk writes a lossless payload that saves no page raw (BlockCache).
          const bool stays_raw = s == 0 || (kind == CodecKind::kLossless && AlignUpToPage(s) >= AlignUpToPage(block));
          disk_total += stays_raw ? RecordBytes(block) : RecordBytes(s);
        }
      }
      if (kind == CodecKind::kLossless && back != raw) {
        std::fprintf(stderr, "kvtier-bench: lossless round trip is not bit-exact\n");
        rc = 1;
      }
      const std::string name = std::string(CodecName(kind)) + " " + data_name + " bf16";
      const double ratio = static_cast<double>(raw.size()) / static_cast<double>(stored_total);
      cs.push_back({name + ": raw / stored", ratio, 1.0, "none", "x"});
      cs.push_back({name + ": disk bytes per block byte",
                    static_cast<double>(disk_total) / static_cast<double>(raw.size()), per_byte(RecordBytes(block)),
                    "a raw record", "x"});
      cs.push_back({name + ": encode, one core", Median(enc), Median(mem), "memcpy, one core", "GB/s"});
      cs.push_back({name + ": decode, one core", Median(dec), Median(mem), "memcpy, one core", "GB/s"});
    }
  }
  PrintComparisons(cs);
  if (!o.json.empty() && !WriteJson(o.json,
                                    {{"workload", "compress"}, {"block_kib", std::to_string(o.block_kib)},
                                     {"blocks", std::to_string(o.blocks)}, {"reps", std::to_string(o.reps)}},
                                    cs)) {
    std::fprintf(stderr, "kvtier-bench: cannot write %s\n", o.json.c_str());
    return 1;
  }
  return rc;
}

}  // namespace kvtier::bench
