// The remote tier's circuit breaker, on a fake clock: it opens after enough
// failures, refuses while cooling down, lets one probe through at a time,
// and no admitted batch that ends without a verdict can keep it open.
#include "tiers/remote/circuit_breaker.h"

#include <gtest/gtest.h>

#include <chrono>
#include <optional>

namespace kvtier {
namespace {

using std::chrono::milliseconds;

class CircuitBreakerTest : public ::testing::Test {
 protected:
  std::chrono::steady_clock::time_point now_{};
  CircuitBreaker breaker_{
      {.failures = 2, .cooldown = milliseconds(500), .clock = [this] { return now_; }}};

  void Fail(int times) {
    for (int i = 0; i < times; ++i) {
      std::optional<CircuitBreaker::Ticket> t = breaker_.Admit();
      ASSERT_TRUE(t.has_value());
      t->Record(false);
    }
  }
};

TEST_F(CircuitBreakerTest, OpensAfterFailuresInARowAndAProbeClosesIt) {
  Fail(1);
  breaker_.Admit()->Record(true);  // a success in between: the count starts again
  Fail(1);
  EXPECT_FALSE(breaker_.counters().open);
  Fail(1);
  EXPECT_TRUE(breaker_.counters().open);
  EXPECT_EQ(breaker_.counters().opened, 1u);
  EXPECT_EQ(breaker_.counters().unavailable, 3u);

  EXPECT_FALSE(breaker_.Admit().has_value());  // cooling down
  EXPECT_TRUE(breaker_.RefuseNow());
  EXPECT_EQ(breaker_.counters().refused, 2u);

  now_ += milliseconds(500);
  EXPECT_FALSE(breaker_.RefuseNow());
  std::optional<CircuitBreaker::Ticket> probe = breaker_.Admit();
  ASSERT_TRUE(probe.has_value());
  EXPECT_FALSE(breaker_.Admit().has_value());  // one probe at a time
  probe->Record(true);
  EXPECT_FALSE(breaker_.counters().open);
  EXPECT_TRUE(breaker_.Admit().has_value());
}

TEST_F(CircuitBreakerTest, AFailedProbeCoolsDownAgain) {
  Fail(2);
  now_ += milliseconds(500);
  breaker_.Admit()->Record(false);
  EXPECT_TRUE(breaker_.counters().open);
  now_ += milliseconds(499);
  EXPECT_FALSE(breaker_.Admit().has_value());
  now_ += milliseconds(1);
  EXPECT_TRUE(breaker_.Admit().has_value());
}

// A probe whose batch ended before it tried the network (a codec it could
// not make, say) gives its turn back: before, the breaker stayed open for
// good, every later batch refused.
TEST_F(CircuitBreakerTest, AProbeDroppedWithoutAVerdictPassesItsTurnOn) {
  Fail(2);
  now_ += milliseconds(500);
  {
    std::optional<CircuitBreaker::Ticket> probe = breaker_.Admit();
    ASSERT_TRUE(probe.has_value());
  }
  EXPECT_TRUE(breaker_.counters().open);
  EXPECT_EQ(breaker_.counters().unavailable, 2u);  // nothing counted for it
  std::optional<CircuitBreaker::Ticket> next = breaker_.Admit();
  ASSERT_TRUE(next.has_value());
  next->Record(true);
  EXPECT_FALSE(breaker_.counters().open);
}

// Batches admitted before it opened, failing after, neither close it nor
// push its probe back.
TEST_F(CircuitBreakerTest, LateVerdictsOfBatchesAdmittedBeforeItOpenedDoNotMoveTheProbe) {
  std::optional<CircuitBreaker::Ticket> late = breaker_.Admit();
  Fail(2);
  now_ += milliseconds(500);
  late->Record(false);
  EXPECT_TRUE(breaker_.Admit().has_value());
}

}  // namespace
}  // namespace kvtier
