// Status and Result<T>: kvtier's one error type.
//
// A Status is a code, a message and, when the error came from the OS, CUDA or
// RocksDB, the raw code from that source (errno, cudaError_t, the RocksDB
// status code) so callers and logs never lose it. Result<T> is
// tl::expected<T, Status>. Both are [[nodiscard]].
//
// Thread-compatible value types: copy them freely, share a const one.
#pragma once

#include <cstdint>
#include <memory>
#include <ostream>
#include <string>
#include <string_view>
#include <utility>

#include <tl/expected.hpp>

namespace kvtier {

enum class StatusCode : uint8_t {
  kOk = 0,
  kInvalidArgument,    // the caller passed something malformed
  kNotFound,           // a key, file or object does not exist
  kAlreadyExists,      // e.g. a store of a key that is present or in flight
  kResourceExhausted,  // no space or quota without evicting pinned blocks
  kFailedPrecondition, // the system is not in a state that allows the call
  kOutOfRange,         // an index or length outside the valid range
  kPermissionDenied,   // the peer is not allowed to do this
  kUnauthenticated,    // the peer's identity could not be established
  kUnavailable,        // transient: the daemon is restarting, retry later
  kDeadlineExceeded,
  kAborted,
  kCancelled,
  kUnimplemented,
  kIoError,            // an I/O call failed; raw_code() holds errno
  kCorruption,         // stored data failed a checksum or format check
  kInternal,           // a bug or an unexpected third-party failure
};

// Where raw_code() came from.
enum class ErrorSource : uint8_t { kNone = 0, kErrno, kCuda, kRocksDb };

std::string_view StatusCodeName(StatusCode code);
std::string_view ErrorSourceName(ErrorSource source);

class [[nodiscard]] Status {
 public:
  // OK.
  Status() = default;
  Status(StatusCode code, std::string message, ErrorSource source = ErrorSource::kNone,
         int raw_code = 0);

  // Lets `return Err(...)` and KVTIER_ASSIGN_OR_RETURN work in functions that
  // return Status as well as in those that return Result<T>.
  Status(tl::unexpected<Status> error)  // NOLINT(google-explicit-constructor)
      : Status(std::move(error).value()) {}

  static Status Ok() { return Status(); }

  // Builds a status from an errno value (positive, as errno holds it, or the
  // negative form liburing returns). The code is chosen from the errno:
  // ENOENT -> kNotFound, ENOSPC/ENOMEM -> kResourceExhausted, EACCES/EPERM ->
  // kPermissionDenied, EINVAL -> kInvalidArgument, EAGAIN -> kUnavailable,
  // anything else -> kIoError. `context` says what was attempted.
  static Status FromErrno(int err, std::string_view context);

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const;
  ErrorSource source() const { return rep_ ? rep_->source : ErrorSource::kNone; }
  int raw_code() const { return rep_ ? rep_->raw_code : 0; }

  // Returns a copy whose message is "<context>: <message>"; OK stays OK.
  Status WithContext(std::string_view context) const;

  // "OK", or "<CodeName>: <message> [errno 5]".
  std::string ToString() const;

  friend bool operator==(const Status& a, const Status& b) {
    return a.code() == b.code() && a.message() == b.message() && a.source() == b.source() &&
           a.raw_code() == b.raw_code();
  }

 private:
  struct Rep {
    std::string message;
    ErrorSource source = ErrorSource::kNone;
    int raw_code = 0;
  };
  StatusCode code_ = StatusCode::kOk;
  // Null when OK, so an OK status costs one byte plus a pointer and no
  // allocation; shared because statuses are immutable once built.
  std::shared_ptr<const Rep> rep_;
};

std::ostream& operator<<(std::ostream& os, const Status& status);

// Beware: `for (auto& x : MakeResult().value())` dangles (the temporary
// Result dies before the loop body runs); bind the Result to a variable first.
template <typename T>
using Result = tl::expected<T, Status>;

// Wraps an error status for returning from a function that returns Result<T>.
inline tl::unexpected<Status> Err(Status status) { return tl::unexpected<Status>(std::move(status)); }
inline tl::unexpected<Status> Err(StatusCode code, std::string message) {
  return tl::unexpected<Status>(Status(code, std::move(message)));
}

// Error shorthands.
inline Status InvalidArgument(std::string message) {
  return Status(StatusCode::kInvalidArgument, std::move(message));
}
inline Status Internal(std::string message) {
  return Status(StatusCode::kInternal, std::move(message));
}
inline Status Unavailable(std::string message) {
  return Status(StatusCode::kUnavailable, std::move(message));
}

}  // namespace kvtier

// Evaluates an expression returning Status; returns it from the enclosing
// function (which returns Status or Result<T>) if it is not OK.
#define KVTIER_RETURN_IF_ERROR(expr)                                                \
  do {                                                                              \
    ::kvtier::Status kvtier_status_ = (expr);                                       \
    if (!kvtier_status_.ok()) {                                                     \
      return ::tl::unexpected<::kvtier::Status>(std::move(kvtier_status_));        \
    }                                                                               \
  } while (false)

#define KVTIER_CONCAT_INNER_(a, b) a##b
#define KVTIER_CONCAT_(a, b) KVTIER_CONCAT_INNER_(a, b)

// KVTIER_ASSIGN_OR_RETURN(auto x, MakeX()); in a function returning Result<U>
// or Status: assigns the value, or returns the error.
#define KVTIER_ASSIGN_OR_RETURN(lhs, expr) \
  KVTIER_ASSIGN_OR_RETURN_IMPL_(KVTIER_CONCAT_(kvtier_result_, __LINE__), lhs, expr)
#define KVTIER_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr)                              \
  auto tmp = (expr);                                                               \
  if (!tmp.has_value()) return ::tl::unexpected<::kvtier::Status>(std::move(tmp).error()); \
  lhs = std::move(*tmp)
