#include "transport/message.h"

#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "common/check.h"
#include "transport/detail/received_frames.h"

namespace xd {
namespace {

// ZeroMQ keeps a message that arrived in one read with others inside its
// receive buffer, starting at whatever byte it starts. Such a tensor frame is
// copied once into memory of its own, so that every tensor frame reads as an
// array of float, int32_t or double in place.
constexpr size_t kTensorFrameAlignment = 8;

void align_tensor_frames(std::vector<zmq::message_t>* frames) {
  for (size_t i = 1; i < frames->size(); ++i) {  // frame 0 is the metadata, read as bytes
    zmq::message_t& f = (*frames)[i];
    if (f.size() == 0 || reinterpret_cast<uintptr_t>(f.data()) % kTensorFrameAlignment == 0) continue;
    void* copy = std::malloc(f.size());  // aligned for every scalar type
    XD_CHECK_MSG(copy != nullptr, "out of memory copying a received frame");
    std::memcpy(copy, f.data(), f.size());
    f = zmq::message_t(copy, f.size(), [](void* data, void*) { std::free(data); }, nullptr);
  }
}

}  // namespace

IncomingMessage::IncomingMessage() = default;
IncomingMessage::IncomingMessage(FrameHeader header, std::unique_ptr<detail::ReceivedFrames> frames)
    : header_(header), frames_(std::move(frames)) {
  if (frames_) align_tensor_frames(&frames_->frames);
}
IncomingMessage::IncomingMessage(IncomingMessage&&) noexcept = default;
IncomingMessage& IncomingMessage::operator=(IncomingMessage&&) noexcept = default;
IncomingMessage::~IncomingMessage() = default;

const void* IncomingMessage::meta_data() const { return frames_->frames[0].data(); }
size_t IncomingMessage::meta_size() const { return frames_->frames[0].size(); }
size_t IncomingMessage::num_tensors() const {
  return !frames_ || frames_->frames.empty() ? 0 : frames_->frames.size() - 1;
}
const void* IncomingMessage::tensor_data(size_t i) const { return frames_->frames[i + 1].data(); }
size_t IncomingMessage::tensor_size(size_t i) const { return frames_->frames[i + 1].size(); }

OutFrame OutFrame::copy_of(const void* bytes, size_t size) {
  auto buf = std::shared_ptr<uint8_t[]>(new uint8_t[size ? size : 1]);
  if (size) std::memcpy(buf.get(), bytes, size);
  OutFrame f;
  f.data = buf.get();
  f.size = size;
  f.owner = std::shared_ptr<const void>(buf, buf.get());
  return f;
}

void Completion::finish_one(const Status& st) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!st.is_ok() && status_.is_ok()) status_ = st;
  if (--remaining_ <= 0) cv_.notify_all();
}

void Completion::abort(const Status& st) {
  std::lock_guard<std::mutex> lock(mu_);
  if (status_.is_ok()) status_ = st;
  cv_.notify_all();
}

Status Completion::wait(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!cv_.wait_for(lock, timeout, [&] { return remaining_ <= 0 || !status_.is_ok(); }))
    return Status::timeout("send not completed within " + std::to_string(timeout.count()) + " ms");
  return status_;
}

void RecvSlot::fulfil(IncomingMessage m) {
  std::lock_guard<std::mutex> lock(mu_);
  message_ = std::move(m);
  cv_.notify_all();
}

void RecvSlot::fail(const Status& st) {
  std::lock_guard<std::mutex> lock(mu_);
  status_ = st;
  cv_.notify_all();
}

bool RecvSlot::ready() const {
  std::lock_guard<std::mutex> lock(mu_);
  return message_.has_value() || !status_.is_ok();
}

Expected<IncomingMessage> RecvSlot::wait(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!cv_.wait_for(lock, timeout, [&] { return message_.has_value() || !status_.is_ok(); }))
    return Status::timeout("no message within " + std::to_string(timeout.count()) + " ms");
  if (!status_.is_ok()) return status_;
  IncomingMessage m = std::move(*message_);
  message_.reset();
  return m;
}

}  // namespace xd
