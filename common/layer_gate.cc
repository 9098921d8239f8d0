#include "common/layer_gate.h"

#include <algorithm>

#include "common/check.h"

namespace kvtier {

LayerGate::LayerGate(uint32_t layers) : layers_(layers) { KVTIER_CHECK(layers >= 1); }

LayerGate::~LayerGate() { Abort(); }

uint32_t LayerGate::open() const {
  MutexLock lock(&mu_);
  return open_;
}

bool LayerGate::aborted() const {
  MutexLock lock(&mu_);
  return aborted_;
}

void LayerGate::Open(uint32_t layers) {
  MutexLock lock(&mu_);
  layers = std::min(layers, layers_);
  if (aborted_ || layers <= open_) return;
  open_ = layers;
  Tell();
}

void LayerGate::Abort() {
  MutexLock lock(&mu_);
  if (aborted_ || open_ == layers_) return;
  aborted_ = true;
  Tell();
}

void LayerGate::Attach(Opener opener) {
  MutexLock lock(&mu_);
  if (open_ > 0 || aborted_) opener(open_, aborted_);
  if (open_ < layers_ && !aborted_) openers_.push_back(std::move(opener));
}

void LayerGate::Tell() {
  for (const Opener& opener : openers_) opener(open_, aborted_);
  // Every layer open, or none to follow: nothing more to tell.
  if (open_ == layers_ || aborted_) openers_.clear();
}

}  // namespace kvtier
