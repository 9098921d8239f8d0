#include "common/status.h"

#include <cerrno>

#include <gtest/gtest.h>

#include "common/check.h"

namespace kvtier {
namespace {

TEST(StatusTest, DefaultIsOk) {
  Status s;
  EXPECT_TRUE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kOk);
  EXPECT_EQ(s.message(), "");
  EXPECT_EQ(s.source(), ErrorSource::kNone);
  EXPECT_EQ(s.raw_code(), 0);
  EXPECT_EQ(s.ToString(), "OK");
}

TEST(StatusTest, KeepsCodeMessageAndRawCode) {
  Status s(StatusCode::kCorruption, "bad header", ErrorSource::kRocksDb, 2);
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kCorruption);
  EXPECT_EQ(s.message(), "bad header");
  EXPECT_EQ(s.source(), ErrorSource::kRocksDb);
  EXPECT_EQ(s.raw_code(), 2);
  EXPECT_EQ(s.ToString(), "Corruption: bad header [rocksdb 2]");
}

TEST(StatusTest, FromErrnoKeepsErrnoAndMapsCode) {
  struct Case {
    int err;
    StatusCode code;
  };
  for (const Case& c : {Case{ENOENT, StatusCode::kNotFound}, Case{ENOSPC, StatusCode::kResourceExhausted},
                        Case{EACCES, StatusCode::kPermissionDenied}, Case{EIO, StatusCode::kIoError},
                        Case{EAGAIN, StatusCode::kUnavailable}, Case{EINVAL, StatusCode::kInvalidArgument}}) {
    const Status s = Status::FromErrno(c.err, "open /x");
    EXPECT_EQ(s.code(), c.code) << c.err;
    EXPECT_EQ(s.source(), ErrorSource::kErrno);
    EXPECT_EQ(s.raw_code(), c.err);
    EXPECT_EQ(s.message().rfind("open /x: ", 0), 0u) << s.message();
  }
  // liburing returns -errno; the sign is dropped.
  EXPECT_EQ(Status::FromErrno(-EIO, "read").raw_code(), EIO);
}

TEST(StatusTest, WithContextPrefixesAndKeepsRawCode) {
  const Status s = Status::FromErrno(EIO, "pread").WithContext("segment 3");
  EXPECT_EQ(s.code(), StatusCode::kIoError);
  EXPECT_EQ(s.raw_code(), EIO);
  EXPECT_EQ(s.message().rfind("segment 3: pread: ", 0), 0u) << s.message();
  EXPECT_TRUE(Status::Ok().WithContext("x").ok());
}

Result<int> Half(int v) {
  if (v % 2 != 0) return Err(InvalidArgument("odd"));
  return v / 2;
}

Result<int> Quarter(int v) {
  KVTIER_ASSIGN_OR_RETURN(int h, Half(v));
  KVTIER_ASSIGN_OR_RETURN(int q, Half(h));
  return q;
}

Status CheckQuarter(int v) {
  KVTIER_ASSIGN_OR_RETURN(int q, Quarter(v));
  if (q > 10) return Status(StatusCode::kOutOfRange, "too big");
  return Status::Ok();
}

Status FailIfNegative(int v) {
  return v < 0 ? InvalidArgument("negative") : Status::Ok();
}

Result<int> Checked(int v) {
  KVTIER_RETURN_IF_ERROR(FailIfNegative(v));
  return v;
}

TEST(StatusTest, ResultMacrosPropagateErrors) {
  EXPECT_EQ(Quarter(8).value(), 2);
  ASSERT_FALSE(Quarter(6).has_value());
  EXPECT_EQ(Quarter(6).error().message(), "odd");
  EXPECT_TRUE(CheckQuarter(8).ok());
  EXPECT_EQ(CheckQuarter(6).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(CheckQuarter(80).code(), StatusCode::kOutOfRange);
  EXPECT_EQ(Checked(3).value(), 3);
  EXPECT_EQ(Checked(-3).error().message(), "negative");
}

TEST(StatusTest, ErrConvertsToStatus) {
  const Status s = Err(StatusCode::kUnavailable, "restarting");
  EXPECT_EQ(s.code(), StatusCode::kUnavailable);
  EXPECT_EQ(s.message(), "restarting");
}

TEST(CheckDeathTest, CheckAbortsWithMessage) {
  EXPECT_DEATH(KVTIER_CHECK_MSG(1 + 1 == 3, "arithmetic"), "CHECK failed: 1 \\+ 1 == 3: arithmetic");
  EXPECT_DEATH(KVTIER_CHECK_OK(Status(StatusCode::kInternal, "boom")), "Internal: boom");
}

}  // namespace
}  // namespace kvtier
