// KVTIER_CHECK: aborts the process with a message when an invariant is broken.
//
// For bugs only, never for bad input or I/O failures (those are Status).
// Active in every build type. Thread-safe.
#pragma once

#include <string_view>

namespace kvtier::internal {
// Writes "file:line: CHECK failed: <condition> <message>" to stderr and aborts.
[[noreturn]] void CheckFailed(const char* file, int line, const char* condition,
                              std::string_view message);
}  // namespace kvtier::internal

#define KVTIER_CHECK(cond)                                                      \
  do {                                                                          \
    if (__builtin_expect(!(cond), 0)) {                                         \
      ::kvtier::internal::CheckFailed(__FILE__, __LINE__, #cond, {});           \
    }                                                                           \
  } while (false)

// `msg` is anything convertible to std::string_view; it is only evaluated
// when the check fails.
#define KVTIER_CHECK_MSG(cond, msg)                                             \
  do {                                                                          \
    if (__builtin_expect(!(cond), 0)) {                                         \
      ::kvtier::internal::CheckFailed(__FILE__, __LINE__, #cond, (msg));        \
    }                                                                           \
  } while (false)

// Aborts with the status text when `expr` (a Status) is not OK.
#define KVTIER_CHECK_OK(expr)                                                   \
  do {                                                                          \
    const ::kvtier::Status kvtier_check_status_ = (expr);                       \
    if (__builtin_expect(!kvtier_check_status_.ok(), 0)) {                      \
      ::kvtier::internal::CheckFailed(__FILE__, __LINE__, #expr,                \
                                      kvtier_check_status_.ToString());         \
    }                                                                           \
  } while (false)
