// The transport side of an ExpertStreamCodec (compression/
// expert_stream_codec.h): an encoded expert message as frames for
// Transport::send, and a received one checked and handed to the codec.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"
#include "compression/codec.h"
#include "compression/expert_stream_codec.h"
#include "transport/message.h"
#include "transport/transport.h"

namespace xd::detail {

// An expert message ready for Transport::send: the packed floats as one raw
// frame, or the codec payload with its record and kFlagCompressed. The frames
// own their buffers until ZeroMQ has sent them.
struct WireMessage {
  std::vector<OutFrame> frames;
  std::string metadata;
  uint16_t flags = kFlagNone;
};
WireMessage wire_message(std::vector<float> packed, EncodedTensor encoded);

// A received message of `tensors` (a raw frame or a codec payload, its shape
// checked before anything is allocated for it) into the tensors, through
// `codec`.
Status receive_message(ExpertStreamCodec& codec, const std::vector<ExpertTensorRef>& tensors,
                       const IncomingMessage& msg);

}  // namespace xd::detail
