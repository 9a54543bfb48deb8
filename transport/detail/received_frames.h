// ReceivedFrames: the ZeroMQ frames of one received message, [meta, tensor...],
// left in ZeroMQ's buffers. Owned by an IncomingMessage (transport/message.h),
// which keeps ZeroMQ out of the public headers. Plain data; move-only.
//
// align_tensor_frames() gives every tensor frame an address aligned to
// kTensorFrameAlignment, so that a receiver may read it as an array of float,
// int32_t or double in place. ZeroMQ keeps a message that arrived in one read
// with others inside its receive buffer, starting at whatever byte it
// starts; only such a frame is copied, once, into memory of its own.
#pragma once

#include <zmq.hpp>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "common/check.h"

namespace xd::detail {

struct ReceivedFrames {
  std::vector<zmq::message_t> frames;
};

constexpr size_t kTensorFrameAlignment = 8;

// Frames [first, end) of `frames`.
inline void align_tensor_frames(std::vector<zmq::message_t>* frames, size_t first) {
  for (size_t i = first; i < frames->size(); ++i) {
    zmq::message_t& f = (*frames)[i];
    if (f.size() == 0 || reinterpret_cast<uintptr_t>(f.data()) % kTensorFrameAlignment == 0) continue;
    void* copy = std::malloc(f.size());  // aligned for every scalar type
    XD_CHECK_MSG(copy != nullptr, "out of memory copying a received frame");
    std::memcpy(copy, f.data(), f.size());
    f = zmq::message_t(copy, f.size(), [](void* data, void*) { std::free(data); }, nullptr);
  }
}

}  // namespace xd::detail
