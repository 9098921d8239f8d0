#include "common/status.h"

#include <cerrno>
#include <cstdlib>
#include <cstring>

namespace kvtier {
namespace {

const std::string& EmptyString() {
  static const std::string* const kEmpty = new std::string();
  return *kEmpty;
}

StatusCode CodeForErrno(int err) {
  switch (err) {
    case ENOENT:
      return StatusCode::kNotFound;
    case EEXIST:
      return StatusCode::kAlreadyExists;
    case ENOSPC:
    case ENOMEM:
    case EDQUOT:
    case EMFILE:
    case ENFILE:
      return StatusCode::kResourceExhausted;
    case EACCES:
    case EPERM:
      return StatusCode::kPermissionDenied;
    case EINVAL:
      return StatusCode::kInvalidArgument;
    case EAGAIN:
    case ECONNREFUSED:
      return StatusCode::kUnavailable;
    case ETIMEDOUT:
      return StatusCode::kDeadlineExceeded;
    case ECANCELED:
      return StatusCode::kCancelled;
    case ENOSYS:
    case EOPNOTSUPP:
      return StatusCode::kUnimplemented;
    default:
      return StatusCode::kIoError;
  }
}

}  // namespace

std::string_view StatusCodeName(StatusCode code) {
  switch (code) {
    case StatusCode::kOk: return "OK";
    case StatusCode::kInvalidArgument: return "InvalidArgument";
    case StatusCode::kNotFound: return "NotFound";
    case StatusCode::kAlreadyExists: return "AlreadyExists";
    case StatusCode::kResourceExhausted: return "ResourceExhausted";
    case StatusCode::kFailedPrecondition: return "FailedPrecondition";
    case StatusCode::kOutOfRange: return "OutOfRange";
    case StatusCode::kPermissionDenied: return "PermissionDenied";
    case StatusCode::kUnauthenticated: return "Unauthenticated";
    case StatusCode::kUnavailable: return "Unavailable";
    case StatusCode::kDeadlineExceeded: return "DeadlineExceeded";
    case StatusCode::kAborted: return "Aborted";
    case StatusCode::kCancelled: return "Cancelled";
    case StatusCode::kUnimplemented: return "Unimplemented";
    case StatusCode::kIoError: return "IoError";
    case StatusCode::kCorruption: return "Corruption";
    case StatusCode::kInternal: return "Internal";
  }
  return "Unknown";
}

std::string_view ErrorSourceName(ErrorSource source) {
  switch (source) {
    case ErrorSource::kNone: return "none";
    case ErrorSource::kErrno: return "errno";
    case ErrorSource::kCuda: return "cuda";
    case ErrorSource::kRocksDb: return "rocksdb";
  }
  return "unknown";
}

Status::Status(StatusCode code, std::string message, ErrorSource source, int raw_code)
    : code_(code) {
  if (code_ != StatusCode::kOk) {
    rep_ = std::make_shared<const Rep>(Rep{std::move(message), source, raw_code});
  }
}

Status Status::FromErrno(int err, std::string_view context) {
  const int e = std::abs(err);
  std::string message(context);
  message += ": ";
  message += std::strerror(e);  // glibc's strerror is thread-safe for valid errnos.
  return Status(CodeForErrno(e), std::move(message), ErrorSource::kErrno, e);
}

const std::string& Status::message() const { return rep_ ? rep_->message : EmptyString(); }

Status Status::WithContext(std::string_view context) const {
  if (ok()) return *this;
  std::string message(context);
  message += ": ";
  message += rep_->message;
  return Status(code_, std::move(message), rep_->source, rep_->raw_code);
}

std::string Status::ToString() const {
  if (ok()) return "OK";
  std::string out(StatusCodeName(code_));
  out += ": ";
  out += rep_->message;
  if (rep_->source != ErrorSource::kNone) {
    out += " [";
    out += ErrorSourceName(rep_->source);
    out += ' ';
    out += std::to_string(rep_->raw_code);
    out += ']';
  }
  return out;
}

std::ostream& operator<<(std::ostream& os, const Status& status) {
  return os << status.ToString();
}

}  // namespace kvtier
