#include "daemon/turn_profile.h"

#include <gtest/gtest.h>

#include <chrono>
#include <string>

namespace kvtier {
namespace {

using std::chrono::milliseconds;

TEST(TurnProfileTest, NamesTheLargestPartsFirstWithTheirCounts) {
  TurnProfile t;
  const auto start = TurnProfile::Clock::now();
  t.Begin(start);
  static const char* kStore = "Store";
  static const char* kPosted = "posted";
  t.Add(kStore, milliseconds(3));
  t.Add(kPosted, milliseconds(1));
  t.Add(kStore, milliseconds(4));
  EXPECT_EQ(t.Describe(), "Store x2 7.00 ms, posted x1 1.00 ms");
  EXPECT_EQ(t.Length(start + milliseconds(9)), milliseconds(9));
  // A new turn starts empty.
  t.Begin(start);
  EXPECT_EQ(t.Describe(), "");
}

TEST(TurnProfileTest, ManyPartsKeepTheLargestSixAndSumTheRest) {
  static const char* kNames[20] = {"a", "b", "c", "d", "e", "f", "g", "h", "i", "j",
                                   "k", "l", "m", "n", "o", "p", "q", "r", "s", "t"};
  TurnProfile t;
  t.Begin(TurnProfile::Clock::now());
  for (int i = 0; i < 20; ++i) t.Add(kNames[i], milliseconds(i + 1));
  // Parts past the 16th are "other" (17 + 18 + 19 + 20 ms), the largest.
  EXPECT_EQ(t.Describe(),
            "other x4 74.00 ms, p x1 16.00 ms, o x1 15.00 ms, n x1 14.00 ms, m x1 13.00 ms, l x1 12.00 ms, "
            "the rest 66.00 ms");
}

}  // namespace
}  // namespace kvtier
