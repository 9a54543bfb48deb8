#include "actors/detail/expert_wire_codec.h"

#include <cstring>

namespace xd::detail {

ExpertWireCodec::ExpertWireCodec(ExpertCodecSpec spec, Traffic traffic, size_t tensor_floats)
    : spec_(std::move(spec)), traffic_(traffic), n_(tensor_floats) {}

std::vector<float>& ExpertWireCodec::state(uint64_t key) {
  std::vector<float>& s = state_[key];
  if (s.empty()) s.assign(n_, 0.0f);
  return s;
}

Status ExpertWireCodec::encode(const std::vector<ExpertTensorRef>& tensors, std::vector<float>* packed,
                               EncodedTensor* out, ReconstructionError* err) {
  const bool weights = traffic_ == Traffic::kWeights;
  // With feedback, receivers hold nothing yet the first time: that transfer
  // goes raw and exact, so replicas start from the owners' weights and only
  // changes are compressed after it (both sides see the fresh state).
  bool first = false;
  for (const ExpertTensorRef& t : tensors) first = first || (weights && spec_.feedback && !state_.count(t.key));
  packed->resize(tensors.size() * n_);
  for (size_t i = 0; i < tensors.size(); ++i) {
    const ExpertTensorRef& t = tensors[i];
    float* dst = packed->data() + i * n_;
    std::memcpy(dst, t.data, n_ * sizeof(float));
    if (weights && spec_.against_base && t.base)
      for (size_t k = 0; k < n_; ++k) dst[k] -= t.base[k];
    if (spec_.feedback) {
      const std::vector<float>& s = state(t.key);
      // Weights: the change against what the receivers hold. Gradients: what
      // earlier steps' codecs dropped rides along.
      if (weights)
        for (size_t k = 0; k < n_; ++k) dst[k] -= s[k];
      else
        for (size_t k = 0; k < n_; ++k) dst[k] += s[k];
    }
  }
  out->metadata.clear();
  out->payload.clear();
  if (spec_.is_raw()) return Status::ok();  // exact: no error, no state
  const float* decoded = packed->data();
  if (!spec_.pipeline.is_raw() && !first) {
    XD_RETURN_IF_ERROR(spec_.pipeline.encode(packed->data(), {tensors.size(), n_}, out));
    // The sender decodes what it sent: the error-feedback state must be the
    // receivers' to the bit, and the reconstruction error is measured here.
    decoded_.resize(packed->size());
    XD_RETURN_IF_ERROR(decode_tensor(out->metadata, out->payload.data(), out->payload.size(), decoded_.data(),
                                     decoded_.size()));
    decoded = decoded_.data();
  }
  for (size_t i = 0; i < tensors.size(); ++i) {
    const ExpertTensorRef& t = tensors[i];
    const float* d = decoded + i * n_;
    const float* sent = packed->data() + i * n_;
    std::vector<float>* s = spec_.feedback ? &state(t.key) : nullptr;
    for (size_t k = 0; k < n_; ++k) {
      if (weights) {
        if (s) (*s)[k] += d[k];
        const float rebuilt = (spec_.against_base && t.base ? t.base[k] : 0.0f) + (s ? (*s)[k] : d[k]);
        const double e = double(t.data[k]) - rebuilt;
        err->error += e * e;
        err->signal += double(t.data[k]) * t.data[k];
      } else {
        const double e = double(sent[k]) - d[k];
        if (s) (*s)[k] = sent[k] - d[k];
        err->error += e * e;
        err->signal += double(sent[k]) * sent[k];
      }
    }
  }
  return Status::ok();
}

void ExpertWireCodec::apply(const std::vector<ExpertTensorRef>& tensors, const float* decoded) {
  for (size_t i = 0; i < tensors.size(); ++i) {
    const ExpertTensorRef& t = tensors[i];
    const float* d = decoded + i * n_;
    if (traffic_ == Traffic::kGradients) {
      for (size_t k = 0; k < n_; ++k) t.data[k] += d[k];
      continue;
    }
    const float* base = spec_.against_base ? t.base : nullptr;
    if (spec_.feedback) {
      std::vector<float>& s = state(t.key);
      for (size_t k = 0; k < n_; ++k) {
        s[k] += d[k];
        t.data[k] = (base ? base[k] : 0.0f) + s[k];
      }
    } else if (base) {
      for (size_t k = 0; k < n_; ++k) t.data[k] = base[k] + d[k];
    } else {
      std::memcpy(t.data, d, n_ * sizeof(float));
    }
  }
}

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

Expected<const float*> received_floats(const IncomingMessage& msg, size_t tensors, size_t n,
                                       std::vector<float>* scratch) {
  if (msg.num_tensors() != 1) return Status::corruption("expected one frame, got " + std::to_string(msg.num_tensors()));
  if (!(msg.header().flags & kFlagCompressed)) {
    if (msg.tensor_size(0) != tensors * n * sizeof(float))
      return Status::corruption("wrong size: " + std::to_string(msg.tensor_size(0)) + " bytes, expected " +
                                std::to_string(tensors * n * sizeof(float)));
    return static_cast<const float*>(msg.tensor_data(0));
  }
  auto record = parse_codec_record(std::string(static_cast<const char*>(msg.meta_data()), msg.meta_size()));
  if (!record) return record.status();
  if (record->shape.rows != tensors || record->shape.cols != n)
    return Status::corruption("compressed experts of shape " + std::to_string(record->shape.rows) + "x" +
                              std::to_string(record->shape.cols) + ", expected " + std::to_string(tensors) + "x" +
                              std::to_string(n));
  scratch->resize(tensors * n);
  XD_RETURN_IF_ERROR(decode_tensor(*record, static_cast<const uint8_t*>(msg.tensor_data(0)), msg.tensor_size(0),
                                   scratch->data(), scratch->size()));
  return static_cast<const float*>(scratch->data());
}
}  // namespace xd::detail
