#include "actors/detail/expert_wire_codec.h"

namespace xd::detail {

WireMessage wire_message(std::vector<float> packed, EncodedTensor encoded) {
  WireMessage w;
  if (encoded.payload.empty() && encoded.metadata.empty()) {
    auto buf = std::make_shared<std::vector<float>>(std::move(packed));
    w.frames.push_back({buf->data(), buf->size() * sizeof(float), std::shared_ptr<const void>(buf, buf->data())});
    return w;
  }
  auto enc = std::make_shared<EncodedTensor>(std::move(encoded));
  w.frames.push_back({enc->payload.data(), enc->payload.size(), std::shared_ptr<const void>(enc, enc->payload.data())});
  w.metadata = std::move(enc->metadata);
  w.flags = kFlagCompressed;
  return w;
}

Status receive_message(ExpertStreamCodec& codec, const std::vector<ExpertTensorRef>& tensors,
                       const IncomingMessage& msg) {
  const size_t rows = tensors.size(), n = codec.tensor_floats();
  if (msg.num_tensors() != 1) return Status::corruption("expected one frame, got " + std::to_string(msg.num_tensors()));
  if (!(msg.header().flags & kFlagCompressed)) {
    if (msg.tensor_size(0) != rows * n * sizeof(float))
      return Status::corruption("wrong size: " + std::to_string(msg.tensor_size(0)) + " bytes, expected " +
                                std::to_string(rows * n * sizeof(float)));
    codec.apply(tensors, static_cast<const float*>(msg.tensor_data(0)));
    return Status::ok();
  }
  auto record = parse_codec_record(std::string(static_cast<const char*>(msg.meta_data()), msg.meta_size()));
  if (!record) return record.status();
  if (record->shape.rows != rows || record->shape.cols != n)
    return Status::corruption("compressed experts of shape " + std::to_string(record->shape.rows) + "x" +
                              std::to_string(record->shape.cols) + ", expected " + std::to_string(rows) + "x" +
                              std::to_string(n));
  return codec.apply_encoded(tensors, *record, static_cast<const uint8_t*>(msg.tensor_data(0)), msg.tensor_size(0));
}

}  // namespace xd::detail
