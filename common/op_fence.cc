#include "common/op_fence.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <climits>
#include <ctime>

namespace kvtier {
namespace {

// The futex word of a progress word: its low half (x86-64 and arm64 are
// little-endian), shared between processes (no FUTEX_PRIVATE_FLAG).
uint32_t* FutexWord(uint64_t* word) { return reinterpret_cast<uint32_t*>(word); }

}  // namespace

void FencePage::Progress(uint32_t slot, uint64_t generation, uint32_t layers, bool over) {
  std::atomic_ref<uint64_t> w = progress(slot);
  const uint64_t tag = ProgressTag(generation);
  const uint64_t wanted_layers = std::min<uint64_t>(layers, kLayersMask);
  uint64_t v = w.load(std::memory_order_acquire);
  while (true) {
    if ((v & ~(kOver | kLayersMask)) != tag) return;  // the slot serves another op now
    const uint64_t next = tag | ((v & kOver) != 0 || over ? kOver : 0) | std::max(v & kLayersMask, wanted_layers);
    if (next == v) return;
    if (w.compare_exchange_weak(v, next, std::memory_order_acq_rel, std::memory_order_acquire)) break;
  }
  ::syscall(SYS_futex, FutexWord(progress_word(slot)), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

void FencePage::SleepOnProgress(uint32_t slot, uint64_t seen, std::chrono::nanoseconds timeout) {
  if (timeout.count() <= 0) return;
  const auto seconds = std::chrono::duration_cast<std::chrono::seconds>(timeout);
  const timespec ts{.tv_sec = static_cast<time_t>(seconds.count()),
                    .tv_nsec = static_cast<long>((timeout - seconds).count())};
  // Returns at once (EAGAIN) if the word changed since `seen` was read.
  ::syscall(SYS_futex, FutexWord(progress_word(slot)), FUTEX_WAIT, static_cast<uint32_t>(seen), &ts, nullptr, 0);
}

}  // namespace kvtier
