#include "client/op_fences.h"

#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <thread>

#include "client/sealed_memfd.h"

namespace kvtier {

Result<std::unique_ptr<OpFences>> OpFences::Create() {
  KVTIER_ASSIGN_OR_RETURN(UniqueFd fd, NewSealedMemfd("kvtier-fences", FencePage::kBytes, F_SEAL_GROW));
  KVTIER_ASSIGN_OR_RETURN(MemoryMapping mapping,
                          MemoryMapping::Map(MemoryMapping::Options{.size_bytes = FencePage::kBytes,
                                                                    .prot = PROT_READ | PROT_WRITE,
                                                                    .flags = MAP_SHARED,
                                                                    .fd = fd.get()}));
  return std::unique_ptr<OpFences>(new OpFences(std::move(fd), std::move(mapping)));
}

OpFences::OpFences(UniqueFd fd, MemoryMapping mapping)
    : fd_(std::move(fd)), page_(std::move(mapping)), open_(FencePage::kSlots, 0) {}

namespace {

// Whether the process of `pidfd` has exited (its pidfd is readable then).
bool Exited(const std::shared_ptr<const UniqueFd>& pidfd) {
  if (pidfd == nullptr) return false;
  pollfd p{pidfd->get(), POLLIN, 0};
  return ::poll(&p, 1, 0) == 1 && (p.revents & POLLIN) != 0;
}

}  // namespace

std::shared_ptr<const UniqueFd> OpFences::PeerProcess(int fd) {
  ucred cred{};
  socklen_t len = sizeof(cred);
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 || cred.pid <= 0) return nullptr;
  const auto pidfd = static_cast<int>(::syscall(SYS_pidfd_open, cred.pid, 0));
  if (pidfd < 0) return nullptr;
  return std::make_shared<const UniqueFd>(pidfd);
}

OpFences::Fence OpFences::Open(std::shared_ptr<const UniqueFd> daemon, bool by_layer) {
  MutexLock lock(&mu_);
  // The next free slot from the cursor; with none free, the one opened
  // longest ago (the smallest generation).
  uint32_t slot = next_slot_;
  for (uint32_t i = 0; i < FencePage::kSlots; ++i) {
    const uint32_t s = (next_slot_ + i) % FencePage::kSlots;
    if (open_[s] == 0) {
      slot = s;
      break;
    }
    if (open_[s] < open_[slot]) slot = s;
  }
  if (open_[slot] != 0) {
    std::erase_if(ops_, [&](const auto& entry) { return entry.second.slot == slot; });
  }
  const uint64_t generation = next_generation_;
  next_generation_ = next_generation_ == FencePage::kGenerationMask ? 1 : next_generation_ + 1;
  next_slot_ = (slot + 1) % FencePage::kSlots;
  open_[slot] = generation;
  page_.Open(slot, generation);
  return Fence{slot, generation, std::move(daemon), by_layer};
}

void OpFences::Close(const Fence& fence) {
  MutexLock lock(&mu_);
  if (open_[fence.slot] == fence.generation) open_[fence.slot] = 0;
}

void OpFences::Track(const OpKey& op, const Fence& fence) {
  MutexLock lock(&mu_);
  ops_[op] = fence;
}

std::optional<OpFences::Fence> OpFences::Find(const OpKey& op) const {
  MutexLock lock(&mu_);
  auto it = ops_.find(op);
  if (it == ops_.end()) return std::nullopt;
  return it->second;
}

void OpFences::Untrack(const OpKey& op) {
  MutexLock lock(&mu_);
  auto it = ops_.find(op);
  if (it == ops_.end()) return;
  if (open_[it->second.slot] == it->second.generation) open_[it->second.slot] = 0;
  ops_.erase(it);
}

void OpFences::CancelAll(uint64_t connection) {
  MutexLock lock(&mu_);
  for (auto& [op, fence] : ops_) {
    if (op.first == connection) (void)page_.Cancel(fence.slot, fence.generation);
  }
}

bool OpFences::Cancel(const Fence& fence, std::chrono::steady_clock::time_point deadline) {
  // A copy in progress ends within microseconds unless kvtierd stopped (or
  // died) in the middle of it: poll, backing off to a millisecond.
  auto pause = std::chrono::microseconds(20);
  for (bool quiet = page_.Cancel(fence.slot, fence.generation); !quiet;
       quiet = page_.Quiet(fence.slot, fence.generation) || Exited(fence.daemon)) {
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(pause);
    pause = std::min<std::chrono::microseconds>(pause * 2, std::chrono::milliseconds(1));
  }
  // Only once quiet: a stream released earlier would read blocks a copy
  // still writes.
  if (fence.by_layer && page_.has_progress()) page_.Progress(fence.slot, fence.generation, 0, /*over=*/true);
  return true;
}

void OpFences::EndLayerWaits() {
  MutexLock lock(&mu_);
  if (!page_.has_progress()) return;
  for (uint32_t slot = 0; slot < FencePage::kSlots; ++slot) {
    if (open_[slot] != 0) page_.Progress(slot, open_[slot], 0, /*over=*/true);
  }
}

OpFences::LayerWait OpFences::AwaitLayers(const Fence& fence, uint32_t layers,
                                          std::chrono::steady_clock::time_point deadline) {
  // The daemon wakes the futex at each layer; a short sleep at most, so that
  // a daemon that died is noticed without its wakeup.
  constexpr auto kLongestSleep = std::chrono::milliseconds(20);
  while (true) {
    const std::optional<uint64_t> v = page_.ProgressOf(fence.slot, fence.generation);
    if (!v) return LayerWait::kOver;
    if ((*v & FencePage::kLayersMask) >= layers) return LayerWait::kReached;
    if ((*v & FencePage::kOver) != 0 || Exited(fence.daemon)) return LayerWait::kOver;
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline) return LayerWait::kTimedOut;
    page_.SleepOnProgress(fence.slot, *v, std::min<std::chrono::nanoseconds>(deadline - now, kLongestSleep));
  }
}

}  // namespace kvtier
