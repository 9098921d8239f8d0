// OpFences: a client's fence page (common/op_fence.h) and which of its
// slots serve which ops, so that an op can be cancelled without kvtierd: a
// client that gives up on a hung daemon makes sure that no copy of the op
// touches the engine's blocks before it lets the engine reuse them.
//
// Slots are taken by Open and given back by Close. An op whose handle was
// dropped never gives its slot back: when every slot is taken, Open reopens
// the one opened longest ago, whose op (if it still runs) then fails with
// kCancelled at its next copy, never touching the memory after.
//
// Internal to libkvtier. Thread-safe; Cancel and Await take no lock the
// client's calls hold, so they work while another thread waits on kvtierd.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "common/mutex.h"
#include "common/op_fence.h"
#include "common/status.h"
#include "common/unique_fd.h"

namespace kvtier {

class OpFences {
 public:
  struct Fence {
    uint32_t slot = 0;
    uint64_t generation = 0;
    // A pidfd of the daemon process the op was sent to, or null when it
    // could not be had (another PID namespace, an old kernel): once that
    // process has exited, no copy of the op runs (its threads are gone, and
    // its CUDA context with them), whatever its fence word says.
    std::shared_ptr<const UniqueFd> daemon;
    // A load by layer: its progress word tells its layers (AwaitLayers).
    bool by_layer = false;
    // A store by layer (Client::LayersWritten): set by the caller of Open.
    bool store_by_layer = false;
  };
  // An op, as the client names it: (connection, op id).
  using OpKey = std::pair<uint64_t, uint64_t>;

  static Result<std::unique_ptr<OpFences>> Create();

  // The page's memfd, to send with RegisterKvCache (borrowed).
  int fd() const { return fd_.get(); }

  // A slot for a new op to be sent to `daemon` (see Fence), opened (no
  // copies, not cancelled).
  Fence Open(std::shared_ptr<const UniqueFd> daemon, bool by_layer = false);
  // Gives a slot back; no-op if it was reopened since.
  void Close(const Fence& fence);

  // Remembers which op a fence serves, until Untrack.
  void Track(const OpKey& op, const Fence& fence);
  std::optional<Fence> Find(const OpKey& op) const;
  // Forgets the op and closes its fence (its result was delivered).
  void Untrack(const OpKey& op);
  // Cancels every tracked op of `connection`, without waiting (the client
  // lost the connection: its ops' results never come).
  void CancelAll(uint64_t connection);

  // Cancels `fence`'s op and waits until no copy of it is in progress (or
  // its daemon process has exited, leaving the count of copies it was in),
  // at most until `deadline`. True: none touches the op's memory from now on,
  // and a by_layer load is marked over (a GPU stream waiting for its layers
  // goes on; what it computes from the blocks is to be thrown away).
  bool Cancel(const Fence& fence, std::chrono::steady_clock::time_point deadline);

  // Waits until the first `layers` layers of `fence`'s op (a by_layer load)
  // are in place in every block it loads (kReached), or the op is over
  // without them (kOver: its Wait says why), or its daemon has exited
  // (kOver), at most until `deadline` (kTimedOut). A fence whose slot was
  // reopened for another op since is over.
  enum class LayerWait : uint8_t { kReached, kOver, kTimedOut };
  LayerWait AwaitLayers(const Fence& fence, uint32_t layers, std::chrono::steady_clock::time_point deadline);

  // For a GPU stream that waits for a by_layer load's layers
  // (Client::StreamWaitLayers): the page's progress words (one per slot,
  // FencePage::kFenceBytes bytes, page-aligned), and the value a fence's
  // word reaches once `layers` layers are in place, the op is over or its
  // slot serves a later op (FencePage::ProgressTarget).
  const uint64_t* progress_words() { return page_.progress_words(); }
  static uint64_t ProgressTarget(const Fence& fence, uint32_t layers) {
    return FencePage::ProgressTarget(fence.generation, layers);
  }
  // Marks every open slot's op over, as the daemon does when it ends one:
  // whatever waits for their layers ends (the client is going away).
  void EndLayerWaits();

  // A pidfd of the process at the other end of connected socket `fd`, for
  // Open; null when there is none to be had.
  static std::shared_ptr<const UniqueFd> PeerProcess(int fd);

 private:
  OpFences(UniqueFd fd, MemoryMapping mapping);

  const UniqueFd fd_;
  FencePage page_;
  mutable Mutex mu_;
  // Per slot: the generation of the op it serves, or 0 when free.
  std::vector<uint64_t> open_ KVTIER_GUARDED_BY(mu_);
  uint64_t next_generation_ KVTIER_GUARDED_BY(mu_) = 1;
  uint32_t next_slot_ KVTIER_GUARDED_BY(mu_) = 0;
  std::map<OpKey, Fence> ops_ KVTIER_GUARDED_BY(mu_);
};

}  // namespace kvtier
