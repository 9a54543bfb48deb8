// The SR expert codec (HybridEP Sec. IV-B): an expert is sent as its residual
// against the layer's base expert -- the mean of all the layer's experts,
// which every worker holds bit-identically -- kept sparse (top-k by
// magnitude, values in bf16, indices delta-coded) and then zstd-compressed.
// The receiver rebuilds base + residual. The owner keeps its exact weights,
// so the error of one step never feeds the next.
//
// The codec works on one tensor at a time (one of an expert's w1, w3, w2),
// against the base of that tensor. A pipeline other than top-k can be given
// too (for example bf16 of the residual). Immutable; thread-safe.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "common/status.h"
#include "compression/codec.h"

namespace xd {

class ExpertResidualCodec {
 public:
  // `residual` is the pipeline for expert - base, e.g. "topk:0.01+zstd:1".
  static Expected<ExpertResidualCodec> create(const std::string& residual);

  // base[i] = mean over the experts of experts[e][i], summed in expert order
  // in double, so every worker that holds the same experts gets the same
  // bits.
  static void mean_expert(const std::vector<const float*>& experts, size_t n, float* base);

  Status encode(const float* expert, const float* base, TensorShape shape, EncodedTensor* out) const;
  // out[i] = base[i] + residual[i]; out and base hold n floats.
  Status decode(const std::string& metadata, const uint8_t* payload, size_t payload_bytes, const float* base,
                float* out, size_t n) const;

 private:
  explicit ExpertResidualCodec(CodecPipeline p) : residual_(std::move(p)) {}
  CodecPipeline residual_;
};

}  // namespace xd
