// ReceivedFrames: the ZeroMQ frames of one received message, [meta, tensor...],
// left in ZeroMQ's buffers. Owned by an IncomingMessage (transport/message.h),
// which keeps ZeroMQ out of the public headers and aligns the tensor frames
// when it takes them. Plain data; move-only.
#pragma once

#include <zmq.hpp>

#include <vector>

namespace xd::detail {

struct ReceivedFrames {
  std::vector<zmq::message_t> frames;
};

}  // namespace xd::detail
