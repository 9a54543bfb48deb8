// Feeds arbitrary bytes to the data-plane header decoder (transport/wire_format.h):
// decode_header and parse_header. Checks that the two agree on every input,
// that a rejection names a known reason, and that an accepted header encodes
// back to exactly the bytes it was decoded from.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "transport/wire_format.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace xd;
  Expected<FrameHeader> decoded = decode_header(data, size);
  FrameHeader parsed;
  RejectReason why = RejectReason::kTooFewFrames;
  const bool accepted = parse_header(data, size, &parsed, &why);
  if (accepted != decoded.has_value()) std::abort();  // the two decoders disagree
  if (!accepted) {
    if (std::strcmp(reject_reason_name(why), "?") == 0) std::abort();
    return 0;
  }
  const FrameHeader& h = *decoded;
  if (!is_known_kind(static_cast<uint8_t>(h.kind))) std::abort();
  if (std::strcmp(message_kind_name(h.kind), "unknown") == 0) std::abort();
  if (h.flags & ~kKnownFlags) std::abort();
  uint8_t again[kHeaderSize];
  encode_header(h, again);
  if (std::memcmp(again, data, kHeaderSize) != 0) std::abort();  // decode is not the inverse of encode
  encode_header(parsed, again);
  if (std::memcmp(again, data, kHeaderSize) != 0) std::abort();
  return 0;
}
