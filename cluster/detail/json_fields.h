// JsonFields: strict reading of one JSON object into typed fields. It keeps
// the first error, naming the dotted key ("job.train.steps: missing"), and
// finish() reports any key that nobody read, so a typo or a field of another
// protocol version is an error rather than silently ignored. Never throws.
// Not thread-safe; one per object read.
#pragma once

#include <limits>
#include <map>
#include <set>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/status.h"

namespace xd::detail {

// Whether `j` holds a T that nlohmann's get<T>() converts exactly: an integer
// field only from a JSON integer inside T's range (get<int>() of 1e300 is
// undefined behaviour, of 2^32 a silent wrap), also inside lists and maps.
// Other mismatches are left to get<T>(), which throws.
template <typename T>
struct JsonFits {
  static bool check(const nlohmann::json& j) {
    if constexpr (std::is_integral_v<T> && !std::is_same_v<T, bool>) {
      if (!j.is_number_integer()) return false;
      return j.is_number_unsigned() ? std::in_range<T>(j.get<uint64_t>()) : std::in_range<T>(j.get<int64_t>());
    }
    return true;
  }
};
template <typename T>
struct JsonFits<std::vector<T>> {
  static bool check(const nlohmann::json& j) {
    for (const nlohmann::json& e : j) if (!JsonFits<T>::check(e)) return false;
    return true;
  }
};
template <typename T>
struct JsonFits<std::map<std::string, T>> {
  static bool check(const nlohmann::json& j) {
    for (const nlohmann::json& e : j) if (!JsonFits<T>::check(e)) return false;
    return true;
  }
};

class JsonFields {
 public:
  JsonFields(const nlohmann::json& object, std::string prefix) : j_(object), prefix_(std::move(prefix)) {
    if (!j_.is_object()) fail(prefix_.empty() ? "message" : prefix_, "is not a JSON object");
  }

  template <typename T>
  void get(const char* key, T* out) {
    if (!ok()) return;
    seen_.insert(key);
    auto it = j_.find(key);
    if (it == j_.end()) return fail(name(key), "missing");
    if (!JsonFits<T>::check(*it)) return fail(name(key), "has the wrong type");
    try {
      *out = it->template get<T>();
    } catch (const std::exception&) {
      fail(name(key), "has the wrong type");
    }
  }
  // The sub-object under `key`, marked as read; null when missing (an error).
  const nlohmann::json* object(const char* key) {
    seen_.insert(key);
    if (!ok()) return nullptr;
    auto it = j_.find(key);
    if (it == j_.end()) return fail(name(key), "missing"), nullptr;
    return &*it;
  }
  // A double that JSON writes as null for +infinity.
  void get_or_infinity(const char* key, double* out);

  void fail(const std::string& key, const std::string& why) {
    if (status_.is_ok()) status_ = Status::invalid_argument(key + ": " + why);
  }
  // Keeps a nested reader's error as it is.
  void fail(const Status& st) {
    if (status_.is_ok() && !st.is_ok()) status_ = st;
  }
  std::string name(const std::string& key) const { return prefix_.empty() ? key : prefix_ + "." + key; }
  bool ok() const { return status_.is_ok(); }
  // The first error, or an unknown key.
  Status finish() {
    if (ok() && j_.is_object())
      for (auto it = j_.begin(); it != j_.end(); ++it)
        if (!seen_.count(it.key())) {
          fail(name(it.key()), "unknown key");
          break;
        }
    return status_;
  }

 private:
  const nlohmann::json& j_;
  std::string prefix_;
  std::set<std::string> seen_;
  Status status_;
};

inline void JsonFields::get_or_infinity(const char* key, double* out) {
  if (!ok()) return;
  auto it = j_.find(key);
  if (it != j_.end() && it->is_null()) {
    seen_.insert(key);
    *out = std::numeric_limits<double>::infinity();
    return;
  }
  get(key, out);
}

}  // namespace xd::detail
