// The body of a control message (transport/control_channel.h): its metadata
// frame, msgpack of one JSON object. unpack_control_body is what a control
// channel runs on every message it receives. nlohmann's msgpack reader
// recurses once per nesting level, so a body nested deeper than
// kMaxControlDepth is refused by a first pass that builds nothing (a message
// of a million nested arrays would otherwise exhaust the stack). Never throws.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "common/status.h"

namespace xd {

inline constexpr int kMaxControlDepth = 64;

namespace control_body_internal {
// Reads msgpack without building anything; stops past kMaxControlDepth.
class DepthCheck : public nlohmann::json_sax<nlohmann::json> {
 public:
  bool null() override { return true; }
  bool boolean(bool) override { return true; }
  bool number_integer(number_integer_t) override { return true; }
  bool number_unsigned(number_unsigned_t) override { return true; }
  bool number_float(number_float_t, const string_t&) override { return true; }
  bool string(string_t&) override { return true; }
  bool binary(binary_t&) override { return true; }
  bool start_object(std::size_t) override { return ++depth_ <= kMaxControlDepth; }
  bool key(string_t&) override { return true; }
  bool end_object() override { return --depth_, true; }
  bool start_array(std::size_t) override { return ++depth_ <= kMaxControlDepth; }
  bool end_array() override { return --depth_, true; }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception&) override { return false; }

 private:
  int depth_ = 0;
};
}  // namespace control_body_internal

// The JSON object in `size` bytes of msgpack; corruption for anything else.
inline Expected<nlohmann::json> unpack_control_body(const void* data, size_t size) {
  const uint8_t* p = static_cast<const uint8_t*>(data);
  nlohmann::json body;
  try {
    control_body_internal::DepthCheck depth;
    if (!nlohmann::json::sax_parse(p, p + size, &depth, nlohmann::json::input_format_t::msgpack))
      return Status::corruption("bad msgpack body");
    body = nlohmann::json::from_msgpack(p, p + size);
  } catch (const std::exception&) {
    return Status::corruption("bad msgpack body");
  }
  if (!body.is_object()) return Status::corruption("body is not a map");
  return body;
}

}  // namespace xd
