#include "tools/bench_register.h"

#include <sys/mman.h>

#include <cstdio>
#include <cstring>
#include <random>

#include "kvtier/host_memory.h"
#include "tools/bench_report.h"

namespace kvtier::bench {
namespace {

constexpr uint64_t kGiB = 1ULL << 30;

// Anonymous private memory, as an engine's allocator hands out for a large
// tensor; unmapped when it goes.
class Anonymous {
 public:
  explicit Anonymous(uint64_t bytes) : bytes_(bytes) {
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    data_ = p == MAP_FAILED ? nullptr : static_cast<uint8_t*>(p);
  }
  ~Anonymous() {
    if (data_ != nullptr) ::munmap(data_, bytes_);
  }
  Anonymous(const Anonymous&) = delete;
  Anonymous& operator=(const Anonymous&) = delete;
  uint8_t* data() const { return data_; }

 private:
  uint64_t bytes_;
  uint8_t* data_;
};

// Every word of the cache: zeros, or words of a seeded generator.
void Fill(uint8_t* data, uint64_t bytes, bool with_data) {
  if (!with_data) {
    std::memset(data, 0, bytes);  // touched, as torch.zeros leaves it
    return;
  }
  std::mt19937_64 rng(bytes);
  auto* words = reinterpret_cast<uint64_t*>(data);
  for (uint64_t i = 0; i < bytes / sizeof(uint64_t); ++i) words[i] = rng() | 1;
}

// Seconds of a memcpy of `src` into fresh memory, in slices of at most 1 GiB.
double MemcpySeconds(const uint8_t* src, uint64_t bytes) {
  double seconds = 0;
  for (uint64_t at = 0; at < bytes; at += kGiB) {
    const uint64_t n = std::min(kGiB, bytes - at);
    Anonymous to(n);
    if (to.data() == nullptr) return 0;
    const auto t0 = Clock::now();
    std::memcpy(to.data(), src + at, n);
    seconds += Seconds(Clock::now() - t0);
  }
  return seconds;
}

bool Unchanged(const uint8_t* data, uint64_t bytes, bool with_data) {
  if (!with_data) {
    for (uint64_t i = 0; i < bytes; i += 4096) {
      if (data[i] != 0) return false;
    }
    return true;
  }
  std::mt19937_64 rng(bytes);
  const auto* words = reinterpret_cast<const uint64_t*>(data);
  for (uint64_t i = 0; i < bytes / sizeof(uint64_t); ++i) {
    if (words[i] != (rng() | 1)) return false;
  }
  return true;
}

}  // namespace

int RegisterCost(const RegisterOptions& o) {
  std::printf("config:   caches of");
  for (uint32_t g : o.gib) std::printf(" %u", g);
  std::printf(" GiB, %u reps; memcpy into fresh memory in slices of at most 1 GiB\n", o.reps);
  std::vector<Comparison> cs;
  int rc = 0;
  for (const uint32_t gib : o.gib) {
    const uint64_t bytes = uint64_t{gib} * kGiB;
    for (const bool with_data : {false, true}) {
      std::vector<double> adopt_s, copy_s;
      for (uint32_t rep = 0; rep < o.reps; ++rep) {
        Anonymous cache(bytes);
        if (cache.data() == nullptr) {
          std::fprintf(stderr, "kvtier-bench: cannot map %u GiB\n", gib);
          return 1;
        }
        Fill(cache.data(), bytes, with_data);
        copy_s.push_back(MemcpySeconds(cache.data(), bytes));
        const HostRange range{cache.data(), bytes};
        const auto t0 = Clock::now();
        Result<AdoptedHostMemory> adopted = AdoptedHostMemory::Adopt(std::span(&range, 1));
        adopt_s.push_back(Seconds(Clock::now() - t0));
        if (!adopted) {
          std::fprintf(stderr, "kvtier-bench: %s\n", adopted.error().ToString().c_str());
          return 1;
        }
        if (!Unchanged(cache.data(), bytes, with_data)) {
          std::fprintf(stderr, "kvtier-bench: adopting changed the cache's bytes\n");
          rc = 1;
        }
      }
      const std::string name = std::to_string(gib) + " GiB cache, " +
                               (with_data ? "full of data" : "fresh (zeros)") + ": register";
      cs.push_back({name, Median(adopt_s), Median(copy_s), "memcpy, same bytes", "s",
                    /*lower_is_better=*/true,
                    /*target=*/1.0});
    }
  }
  PrintComparisons(cs);
  if (!o.json.empty() &&
      !WriteJson(o.json, {{"workload", "register"}, {"reps", std::to_string(o.reps)}}, cs)) {
    std::fprintf(stderr, "kvtier-bench: cannot write %s\n", o.json.c_str());
    return 1;
  }
  return rc;
}

}  // namespace kvtier::bench
