// ForwardingBackend: a DeviceBackend that passes every call to another (a
// real one, usually the host backend). Fakes at the backend seam (STYLE.md)
// derive from it and override only what they change.
//
// Test-only. Thread-safe as the inner backend is.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/device_backend.h"

namespace kvtier::tiers_test {

class ForwardingBackend : public DeviceBackend {
 public:
  // `inner` is borrowed: it must outlive this backend.
  explicit ForwardingBackend(DeviceBackend* inner) : inner_(inner) {}
  explicit ForwardingBackend(std::unique_ptr<DeviceBackend> inner) : owned_(std::move(inner)), inner_(owned_.get()) {}

  std::string_view name() const override { return inner_->name(); }
  std::string Describe() const override { return inner_->Describe(); }
  Result<std::unique_ptr<Arena>> AllocateDeviceArena(int device, uint64_t size_bytes) override {
    return inner_->AllocateDeviceArena(device, size_bytes);
  }
  Result<std::unique_ptr<Arena>> AllocateHostArena(uint64_t size_bytes) override {
    return inner_->AllocateHostArena(size_bytes);
  }
  Result<std::shared_ptr<ClientMapping>> MapClientMemory(std::vector<ClientRegionHandle> regions,
                                                         std::vector<IpcEventHandle> events) override {
    return inner_->MapClientMemory(std::move(regions), std::move(events));
  }
  bool Submit(CopyBatch batch, CopyDone done) override { return inner_->Submit(std::move(batch), std::move(done)); }
  bool DecodesOnLoad(CodecKind kind) const override { return inner_->DecodesOnLoad(kind); }
  bool EncodesOnStore(CodecKind kind) const override { return inner_->EncodesOnStore(kind); }
  uint64_t live_mappings() const override { return inner_->live_mappings(); }
  Status health() const override { return inner_->health(); }

 protected:
  DeviceBackend& inner() const { return *inner_; }

 private:
  std::unique_ptr<DeviceBackend> owned_;  // null when borrowed
  DeviceBackend* inner_;
};

}  // namespace kvtier::tiers_test
