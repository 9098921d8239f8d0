// MustStart: a real Redis Cluster (tools/redis_cluster_process.h) for a
// test, or nullptr with the test failed, saying why. For the remote tier's
// unit tests only.
#pragma once

#include <gtest/gtest.h>

#include <memory>
#include <utility>

#include "tools/redis_cluster_process.h"

namespace kvtier::testing {

inline std::unique_ptr<RedisClusterProcess> MustStart(RedisClusterProcess::Options options = {}) {
  Result<std::unique_ptr<RedisClusterProcess>> cluster = RedisClusterProcess::Start(options);
  EXPECT_TRUE(cluster.has_value()) << cluster.error();
  return cluster ? std::move(*cluster) : nullptr;
}

}  // namespace kvtier::testing
