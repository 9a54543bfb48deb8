// Message pieces shared by the transport API: tags, outgoing frames that keep
// their memory alive until ZeroMQ has sent them (zero-copy), received messages,
// and completion handles. All handle types are thread-safe.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "common/status.h"
#include "transport/wire_format.h"

namespace xd {

namespace detail {
struct ReceivedFrames;  // ZeroMQ's message frames: transport/detail/received_frames.h
}

// What a receive matches on, together with the source rank and the job.
struct Tag {
  MessageKind kind = MessageKind::kPointToPoint;
  uint32_t step = 0;
  uint16_t layer = kNoLayer;
  uint16_t phase = 0;
  uint32_t chunk = 0;
};

// One outgoing tensor frame. `owner` keeps `data` alive until the frame is
// sent; with a null owner the caller must keep it alive until the send's
// Completion is done.
struct OutFrame {
  const void* data = nullptr;
  size_t size = 0;
  std::shared_ptr<const void> owner;

  // A frame that owns a copy of `bytes`.
  static OutFrame copy_of(const void* bytes, size_t size);
};

// A received message: the validated header, the msgpack metadata and the
// tensor frames, which stay in ZeroMQ's buffers (no copy on receipt, but for
// a frame ZeroMQ left at an address not 8-byte aligned: that one is copied,
// so every tensor frame can be read as an array of float, int32_t or double
// in place). Move-only.
class IncomingMessage {
 public:
  IncomingMessage();
  // `frames` holds [meta, tensor...].
  IncomingMessage(FrameHeader header, std::unique_ptr<detail::ReceivedFrames> frames);
  IncomingMessage(IncomingMessage&&) noexcept;
  IncomingMessage& operator=(IncomingMessage&&) noexcept;
  ~IncomingMessage();

  const FrameHeader& header() const { return header_; }
  const void* meta_data() const;
  size_t meta_size() const;
  size_t num_tensors() const;
  const void* tensor_data(size_t i) const;
  size_t tensor_size(size_t i) const;
  size_t payload_bytes() const { return header_.payload_len; }

 private:
  FrameHeader header_;
  std::unique_ptr<detail::ReceivedFrames> frames_;
};

// Counts down outstanding parts; done when all finished. Errors stick.
class Completion {
 public:
  explicit Completion(int parts = 1) : remaining_(parts) {}
  void finish_one(const Status& st = Status::ok());
  // Makes wait() return `st` now (the transport was cancelled); later
  // finish_one() calls still count down.
  void abort(const Status& st);
  // ok when done in time; timeout otherwise; or the first error.
  Status wait(std::chrono::milliseconds timeout = std::chrono::hours(24));

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  int remaining_;
  Status status_;
};

// A posted receive; filled by the transport's I/O thread.
class RecvSlot {
 public:
  void fulfil(IncomingMessage m);
  void fail(const Status& st);
  bool ready() const;
  Expected<IncomingMessage> wait(std::chrono::milliseconds timeout = std::chrono::hours(24));

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::optional<IncomingMessage> message_;
  Status status_;
};

}  // namespace xd
