#include "config/size.h"

#include <gtest/gtest.h>

namespace kvtier {
namespace {

TEST(SizeTest, ParsesUnits) {
  EXPECT_EQ(ParseSize("4096").value(), 4096u);
  EXPECT_EQ(ParseSize("0").value(), 0u);
  EXPECT_EQ(ParseSize("12B").value(), 12u);
  EXPECT_EQ(ParseSize("64GiB").value(), 64ull << 30);
  EXPECT_EQ(ParseSize("64G").value(), 64ull << 30);
  EXPECT_EQ(ParseSize("512 MiB").value(), 512ull << 20);
  EXPECT_EQ(ParseSize(" 2KiB ").value(), 2048u);
  EXPECT_EQ(ParseSize("3TiB").value(), 3ull << 40);
  EXPECT_EQ(ParseSize("20TB").value(), 20'000'000'000'000ull);
  EXPECT_EQ(ParseSize("5MB").value(), 5'000'000u);
  EXPECT_EQ(ParseSize("16EiB").has_value(), false);
}

TEST(SizeTest, RejectsBadSizes) {
  for (const char* bad : {"", "-5", "-5GiB", "GiB", "1.5GiB", "10 gigs", "0x10", "1e9",
                          "99999999999999999999", "16777216TiB", "64 GiB extra"}) {
    Result<uint64_t> r = ParseSize(bad);
    EXPECT_FALSE(r.has_value()) << bad;
    if (!r) {
      EXPECT_EQ(r.error().code(), StatusCode::kInvalidArgument);
    }
  }
  EXPECT_NE(ParseSize("-5").error().message().find("negative"), std::string::npos);
}

TEST(SizeTest, FormatsWithTheLargestExactUnit) {
  EXPECT_EQ(FormatSize(64ull << 30), "64GiB");
  EXPECT_EQ(FormatSize(1536ull << 20), "1536MiB");
  EXPECT_EQ(FormatSize(4097), "4097B");
  EXPECT_EQ(FormatSize(0), "0B");
  EXPECT_EQ(FormatSize(20'000'000'000'000ull), "20TB");
  for (uint64_t v : {1ull, 4096ull, 3ull << 40, 123456789ull, 5'000'000ull}) {
    EXPECT_EQ(ParseSize(FormatSize(v)).value(), v) << v;
  }
}

}  // namespace
}  // namespace kvtier
