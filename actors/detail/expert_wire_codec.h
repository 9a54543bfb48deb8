// ExpertWireCodec: how the expert tensors one worker sends, or receives, at
// one level of the HybridEP all-gather (weights) or of the gradient return
// (replica gradients) are put on the wire, with the state error feedback
// needs (compression/expert_codec.h says what sr: and ef: mean).
//
// One message carries a packed batch of tensors (rows = tensors, cols =
// tensor_floats). Weights: the sender encodes x - base - held and both sides
// add the decoded change to `held` (what every receiver holds, minus the
// base); gradients: the sender encodes g + carried and keeps what the codec
// dropped as the next step's `carried`. State is keyed per tensor by the
// caller; a worker is never both sender and receiver of one key. With
// feedback, the first message of weights whose receivers hold nothing yet is
// sent raw (exact); later ones carry compressed changes.
//
// Owned by the ExpertCommunicator; used from its actor thread only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <unordered_map>
#include <vector>

#include "common/status.h"
#include "compression/codec.h"
#include "compression/expert_codec.h"
#include "transport/message.h"
#include "transport/transport.h"

namespace xd::detail {

struct ExpertTensorRef {
  uint64_t key = 0;            // the caller's name for (layer, expert, which)
  float* data = nullptr;       // tensor_floats; read by encode, written by decode
  const float* base = nullptr; // the base expert's tensor, or null
};

// Sums for the reconstruction error of what was encoded: NMSE = error / signal.
struct ReconstructionError {
  double error = 0, signal = 0;
};

class ExpertWireCodec {
 public:
  enum class Traffic : int { kWeights = 0, kGradients = 1 };
  ExpertWireCodec(ExpertCodecSpec spec, Traffic traffic, size_t tensor_floats);

  const ExpertCodecSpec& spec() const { return spec_; }
  bool is_raw() const { return spec_.is_raw(); }

  // Packs `tensors` into `packed` (raw) or `out` (compressed). With a raw
  // spec the packed floats are the message and `out` is left empty.
  Status encode(const std::vector<ExpertTensorRef>& tensors, std::vector<float>* packed, EncodedTensor* out,
                ReconstructionError* err);
  // Weights: data = base + decoded (+ held). Gradients: data += decoded.
  // `decoded` holds tensors.size() * tensor_floats floats.
  void apply(const std::vector<ExpertTensorRef>& tensors, const float* decoded);

 private:
  std::vector<float>& state(uint64_t key);

  ExpertCodecSpec spec_;
  Traffic traffic_;
  size_t n_;
  std::unordered_map<uint64_t, std::vector<float>> state_;  // held (weights) or carried (gradients)
  std::vector<float> decoded_;
};

// An expert message ready for Transport::send: the packed floats as one raw
// frame, or the codec payload with its record and kFlagCompressed. The frames
// own their buffers until ZeroMQ has sent them.
struct WireMessage {
  std::vector<OutFrame> frames;
  std::string metadata;
  uint16_t flags = kFlagNone;
};
WireMessage wire_message(std::vector<float> packed, EncodedTensor encoded);

// The floats of a received expert message: its raw frame, or its codec
// payload decoded into `scratch`. `tensors` * `n` floats are expected; any
// other shape or size is refused before anything is allocated for it.
Expected<const float*> received_floats(const IncomingMessage& msg, size_t tensors, size_t n,
                                       std::vector<float>* scratch);

}  // namespace xd::detail
