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
#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"
#include "compression/codec.h"

namespace xd {

// How expert tensors (weights in the HybridEP all-gather, or replica
// gradients on their way back) cross one link class, as written in a job
// config: "[sr:][ef:][pred:]PIPELINE", or "delta:PIPELINE".
//   sr:  send the residual against the layer's base expert (weights only);
//        the receiver adds the base back.
//   ef:  error feedback: send the change against what the receivers already
//        hold (weights) or add back what earlier steps dropped (gradients),
//        so what one step leaves out is sent in a later one. Sender and
//        receivers keep the same state, so it is exact bookkeeping, not an
//        estimate.
//   pred: (weights, with ef:) predict each entry's next value from its past
//        changes and send only what the prediction missed. Sender and
//        receivers keep, per entry, a velocity v; the prediction is
//        held + v; after a message with correction d, held += v + d and
//        v += g * d, an alpha-beta tracker whose velocity gain g is the
//        pipeline's top-k density (the fraction of entries a step corrects,
//        so an entry's velocity is set by about one revisit), or 1 for a
//        dense pipeline. AdamW moves most weights in the same direction for
//        many steps; the prediction follows that drift between corrections.
//   delta: (weights only, alone, a lossless PIPELINE) send each weight's
//        bits as their difference from the bits the receivers hold (what the
//        last message brought them), in the floats' order as integers,
//        zigzag-coded and laid out byte plane by byte plane, so zstd finds
//        the high bytes an optimizer step leaves alone. Exact: receivers
//        rebuild the sender's weights to the bit, so a run keeps the one
//        process's numbers. Sender and receivers keep what the receivers
//        hold (one copy of the tensors on each side).
//   PIPELINE: a CodecPipeline spec, e.g. "topk:0.01+zstd:1", "bf16", "raw".
//   @STEP:PIPELINE (any number, steps increasing): from training step STEP
//        on, the sender uses that pipeline instead. AdamW moves the weights
//        most while the learning rate is high, so a schedule can spend bits
//        there and fewer later. A message's codec record says how it was
//        coded, so receivers need not know the schedule; sender and
//        receivers keep the same error-feedback state across a switch.
//        Not with pred: (its velocity gain is the pipeline's density).
// "sr:topk:0.02+zstd" is the paper's SR codec; "topk:0.02+zstd" the same
// top-k without the base; "sr:ef:topk_sign:1+zstd:1@130:topk_sign:0.05+zstd:1"
// every residual's sign for steps 0-129, then the largest 5%.
struct ExpertCodecSpec {
  struct Switch {
    uint64_t from_step = 0;
    CodecPipeline pipeline;
  };
  bool against_base = false;
  bool feedback = false;
  bool predict = false;  // pred:
  bool bit_delta = false;  // delta:
  CodecPipeline pipeline = CodecPipeline::raw();  // from step 0
  std::vector<Switch> later;                      // from_step increasing, > 0

  static Expected<ExpertCodecSpec> parse(const std::string& spec);
  std::string spec() const;  // parse(spec()) gives the same
  bool is_raw() const;       // no prefix and every pipeline raw
  // The pipeline the sender uses at training step `step`.
  const CodecPipeline& pipeline_at(uint64_t step) const;
  // pred:'s velocity gain: the top-k density (block_sign: the fraction of
  // blocks), or 1 for a dense pipeline.
  float velocity_gain() const;
};

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
