// CudaExport without the CUDA toolkit: libkvtier still builds and serves CPU
// engines; GPU registration says why it cannot work.
#include "client/cuda_export.h"

namespace kvtier {
namespace {
Status NoCuda() {
  return Status(StatusCode::kUnimplemented, "libkvtier was built without CUDA; GPU KV caches need a CUDA build");
}
}  // namespace

Result<std::unique_ptr<CudaExport>> CudaExport::Create(std::span<const CudaKvRegion>, uint32_t) {
  return Err(NoCuda());
}
CudaExport::~CudaExport() = default;
std::optional<int32_t> CudaExport::AcquireEvent() { return std::nullopt; }
void CudaExport::ReleaseEvent(int32_t) {}
Status CudaExport::Record(int32_t, CudaStream) const { return NoCuda(); }
Status CudaExport::StreamWait(CudaStream, int32_t) const { return NoCuda(); }
Status CudaExport::Synchronize(CudaStream) const { return NoCuda(); }
uint32_t CudaExport::NextCompletionValue(int32_t) { return 0; }
Result<CudaEvent> CudaExport::CompletionEvent(int32_t, uint32_t) { return Err(NoCuda()); }
void CudaExport::Complete(int32_t, uint32_t) {}

Result<std::unique_ptr<CudaLayerWaits>> CudaLayerWaits::Create(const uint64_t*, uint32_t) { return Err(NoCuda()); }
CudaLayerWaits::~CudaLayerWaits() = default;
Status CudaLayerWaits::Wait(CudaStream, uint32_t, uint64_t) { return NoCuda(); }

}  // namespace kvtier
