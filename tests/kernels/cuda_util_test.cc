// cuda_util's error classification, which needs no GPU: which errors lose
// the CUDA context for good (the cuda backend then reports itself lost and
// kvtierd restarts), and the Status they become. The backend's reaction to a
// real one is tested on a GPU (tests/gpu/cuda_backend_gpu_test.cc).
#include "kernels/cuda/cuda_util.h"

#include <gtest/gtest.h>

namespace kvtier::cuda {
namespace {

TEST(CudaUtilTest, FaultsOnTheDeviceLoseTheContextAndOtherErrorsDoNot) {
  for (cudaError_t e : {cudaErrorIllegalAddress, cudaErrorLaunchFailure, cudaErrorAssert, cudaErrorIllegalInstruction,
                        cudaErrorMisalignedAddress, cudaErrorHardwareStackError, cudaErrorInvalidPc,
                        cudaErrorLaunchTimeout, cudaErrorECCUncorrectable}) {
    EXPECT_TRUE(IsContextLost(e)) << cudaGetErrorName(e);
    const Status st = CudaStatus(e, "a copy batch");
    EXPECT_TRUE(IsContextLost(st)) << st;
    EXPECT_EQ(st.code(), StatusCode::kUnavailable) << st;
  }
  // Errors of one call, which the next call does not see again.
  for (cudaError_t e : {cudaSuccess, cudaErrorMemoryAllocation, cudaErrorInvalidValue, cudaErrorNotReady,
                        cudaErrorInvalidResourceHandle, cudaErrorLaunchOutOfResources, cudaErrorPeerAccessUnsupported,
                        cudaErrorNoDevice}) {
    EXPECT_FALSE(IsContextLost(e)) << cudaGetErrorName(e);
  }
  EXPECT_FALSE(IsContextLost(CudaStatus(cudaErrorMemoryAllocation, "cudaMalloc")));
  // The code of another source is never taken for a cudaError_t.
  EXPECT_FALSE(IsContextLost(Status(StatusCode::kIoError, "read", ErrorSource::kErrno, 700)));
  EXPECT_FALSE(IsContextLost(Status::Ok()));
}

}  // namespace
}  // namespace kvtier::cuda
