#include "common/mutex.h"

#include <thread>
#include <vector>

#include <gtest/gtest.h>

namespace kvtier {
namespace {

class Counter {
 public:
  void Add() {
    MutexLock lock(&mu_);
    ++value_;
    cv_.SignalAll();
  }
  // Blocks until value reaches `target`.
  void WaitFor(int target) {
    MutexLock lock(&mu_);
    while (value_ < target) cv_.Wait(&mu_);
  }
  int value() {
    MutexLock lock(&mu_);
    return value_;
  }

 private:
  Mutex mu_;
  CondVar cv_;
  int value_ KVTIER_GUARDED_BY(mu_) = 0;
};

TEST(MutexTest, SerialisesIncrementsAndWakesWaiters) {
  Counter counter;
  constexpr int kThreads = 4;
  constexpr int kPerThread = 10000;
  std::thread waiter([&] { counter.WaitFor(kThreads * kPerThread); });
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < kPerThread; ++i) counter.Add();
    });
  }
  for (auto& t : threads) t.join();
  waiter.join();
  EXPECT_EQ(counter.value(), kThreads * kPerThread);
}

bool TryLockAndUnlock(Mutex* mu) {
  if (!mu->TryLock()) return false;
  mu->Unlock();
  return true;
}

TEST(MutexTest, TryLockFailsWhileHeld) {
  Mutex mu;
  bool acquired = true;
  {
    MutexLock lock(&mu);
    std::thread other([&] { acquired = TryLockAndUnlock(&mu); });
    other.join();
  }
  EXPECT_FALSE(acquired);
  EXPECT_TRUE(TryLockAndUnlock(&mu));
}

TEST(CondVarTest, WaitForTimesOut) {
  Mutex mu;
  CondVar cv;
  MutexLock lock(&mu);
  // Nobody signals; a spurious wake-up may report true, but not 20 in a row.
  bool signalled = true;
  for (int i = 0; i < 20 && signalled; ++i) signalled = cv.WaitFor(&mu, std::chrono::milliseconds(1));
  EXPECT_FALSE(signalled);
}

}  // namespace
}  // namespace kvtier
