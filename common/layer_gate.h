// LayerGate: the layers of a store by layer (Store.by_layer, docs/protocol.md
// "Layer-by-layer stores") that the engine has written so far, and so that
// the daemon may copy. The engine computes its forward pass layer after
// layer; each layer's blocks are handed over as soon as they are written,
// and the store's copies of that layer run while later layers compute.
//
// Who calls what:
//   - the daemon's event loop makes the gate (one per op), opens it as the
//     client reports its layers (StoreLayers), and lets go of it when the op
//     is over or its session ends;
//   - a DeviceBackend that copies stores by layer (GatesStoreLayers) attaches
//     its held copies (Attach) and is told of every layer opened since.
//
// A gate whose last owner lets go of it before every layer was opened
// aborts: its openers are told so, and copy nothing more (the store commits
// nothing). So a store by layer never outlives its session, however its
// client stops. Thread-safe. Openers run under the gate's lock, each call
// with more layers than the last: they must not call the gate.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "common/mutex.h"

namespace kvtier {

class LayerGate {
 public:
  // `open`: layers written (only ever more); `aborted`: none will follow,
  // and those not copied yet are not to be.
  using Opener = std::function<void(uint32_t open, bool aborted)>;

  // REQUIRES: layers >= 1.
  explicit LayerGate(uint32_t layers);
  ~LayerGate();
  LayerGate(const LayerGate&) = delete;
  LayerGate& operator=(const LayerGate&) = delete;

  uint32_t layers() const { return layers_; }
  // Layers opened so far.
  uint32_t open() const;
  bool aborted() const;

  // The first `layers` layers are written (capped at layers()): openers are
  // told if that is more than before. Ignored once aborted.
  void Open(uint32_t layers);
  // No layer follows: openers are told, and forgotten.
  void Abort();
  // Calls `opener` now if some layers are open (or the gate aborted), and at
  // every change until every layer is open or the gate aborts.
  void Attach(Opener opener);

 private:
  void Tell() KVTIER_REQUIRES(mu_);

  const uint32_t layers_;
  mutable Mutex mu_;
  uint32_t open_ KVTIER_GUARDED_BY(mu_) = 0;
  bool aborted_ KVTIER_GUARDED_BY(mu_) = false;
  std::vector<Opener> openers_ KVTIER_GUARDED_BY(mu_);
};

}  // namespace kvtier
