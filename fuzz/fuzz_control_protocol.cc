// Feeds the control protocol's decoders (cluster/protocol.h) as a peer on the
// control channel would: a control message's [header, metadata] frames are
// checked the way transport/control_channel.cc's decode() does it (that
// function is private to the channel and takes ZeroMQ frames, so its checks
// are repeated here with the same product calls), the body is unpacked by
// unpack_control_body (transport/control_body.h), then op_of and every typed
// from_json run on it. Checks that nothing throws or crashes, and that every
// message a from_json accepts is written back by to_json as a message that
// the same from_json accepts, unchanged.
//
// Input: byte 0 picks the form of the rest. Even: the rest is the msgpack
// body alone. Odd: the rest is a 40-byte wire header, then the metadata frame.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <utility>

#include <nlohmann/json.hpp>

#include "cluster/protocol.h"
#include "transport/control_body.h"
#include "transport/wire_format.h"

namespace {

using nlohmann::json;

// A message accepted once must survive its own encoding.
template <typename T>
void check(const json& body) {
  T first;
  if (!xd::from_json(body, &first).is_ok()) return;
  const json written = xd::to_json(first);
  T second;
  xd::Status st = xd::from_json(written, &second);
  if (!st.is_ok()) {
    std::fprintf(stderr, "accepted message not re-accepted: %s\n", st.to_string().c_str());
    std::abort();
  }
  // Compared as msgpack bytes, so that a NaN equals itself.
  if (json::to_msgpack(xd::to_json(second)) != json::to_msgpack(written)) {
    std::fprintf(stderr, "message changed in a round trip: %s\n", written.dump().c_str());
    std::abort();
  }
}

// What control_channel.cc's decode() does with [header, meta]; false when it
// drops the message.
bool unpack_frames(const uint8_t* data, size_t size, json* body) {
  if (size < xd::kHeaderSize) return false;
  xd::FrameHeader h;
  xd::RejectReason why;
  if (!xd::parse_header(data, xd::kHeaderSize, &h, &why)) return false;
  const size_t meta = size - xd::kHeaderSize;
  if (h.meta_len != meta || h.payload_len != 0) return false;
  auto unpacked = xd::unpack_control_body(data + xd::kHeaderSize, meta);
  if (!unpacked) return false;
  *body = std::move(*unpacked);
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  json body;
  if (data[0] & 1) {
    if (!unpack_frames(data + 1, size - 1, &body)) return 0;
  } else {
    auto unpacked = xd::unpack_control_body(data + 1, size - 1);
    if (!unpacked) return 0;
    body = std::move(*unpacked);
  }
  (void)xd::op_of(body);
  check<xd::RegisterRequest>(body);
  check<xd::Assignment>(body);
  check<xd::StepMetrics>(body);
  check<xd::ErrorReport>(body);
  check<xd::StopOrder>(body);
  check<xd::ThrottleRequest>(body);
  check<xd::ThrottleOrder>(body);
  check<xd::PlanUpdate>(body);
  check<xd::CheckpointSaved>(body);
  return 0;
}
