// Status and Expected<T>: the recoverable-error channel (leveldb style).
// A Status is cheap to copy when ok. Expected<T> holds either a value or a
// non-ok Status; reading the value of an error is a broken invariant.
#pragma once

#include <optional>
#include <string>
#include <utility>

#include "common/check.h"

namespace xd {

class Status {
 public:
  enum class Code : int { kOk = 0, kInvalidArgument = 1, kNotFound = 2, kIoError = 3,
                          kCorruption = 4, kUnavailable = 5, kTimeout = 6, kInternal = 7 };

  Status() = default;
  static Status ok() { return Status(); }
  static Status invalid_argument(std::string m) { return {Code::kInvalidArgument, std::move(m)}; }
  static Status not_found(std::string m) { return {Code::kNotFound, std::move(m)}; }
  static Status io_error(std::string m) { return {Code::kIoError, std::move(m)}; }
  static Status corruption(std::string m) { return {Code::kCorruption, std::move(m)}; }
  static Status unavailable(std::string m) { return {Code::kUnavailable, std::move(m)}; }
  static Status timeout(std::string m) { return {Code::kTimeout, std::move(m)}; }
  static Status internal(std::string m) { return {Code::kInternal, std::move(m)}; }

  bool is_ok() const { return code_ == Code::kOk; }
  Code code() const { return code_; }
  const std::string& message() const { return message_; }
  std::string to_string() const;

  // Prefixes the message with context, keeping the code: "loading x: <msg>".
  Status with_context(const std::string& context) const {
    if (is_ok()) return *this;
    return Status(code_, context + ": " + message_);
  }

 private:
  Status(Code c, std::string m) : code_(c), message_(std::move(m)) {}
  Code code_ = Code::kOk;
  std::string message_;
};

inline std::string Status::to_string() const {
  static const char* names[] = {"OK", "invalid argument", "not found", "I/O error",
                                "corruption", "unavailable", "timeout", "internal"};
  if (is_ok()) return "OK";
  return std::string(names[static_cast<int>(code_)]) + ": " + message_;
}

template <typename T>
class Expected {
 public:
  Expected(T value) : value_(std::move(value)) {}  // NOLINT: implicit by design
  Expected(Status status) : status_(std::move(status)) {  // NOLINT
    XD_CHECK_MSG(!status_.is_ok(), "Expected built from an ok Status without a value");
  }
  bool has_value() const { return value_.has_value(); }
  explicit operator bool() const { return has_value(); }
  const Status& status() const { return status_; }
  T& value() & { XD_CHECK_MSG(value_.has_value(), status_.message().c_str()); return *value_; }
  const T& value() const& { XD_CHECK_MSG(value_.has_value(), status_.message().c_str()); return *value_; }
  T&& value() && { XD_CHECK_MSG(value_.has_value(), status_.message().c_str()); return std::move(*value_); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() { return value(); }

 private:
  std::optional<T> value_;
  Status status_;
};

#define XD_RETURN_IF_ERROR(expr)              \
  do {                                        \
    ::xd::Status _xd_st = (expr);             \
    if (!_xd_st.is_ok()) return _xd_st;       \
  } while (0)

}  // namespace xd
