// ExpertStreamCodec: how the expert tensors one worker sends, or receives, at
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
// sent raw (exact); later ones carry compressed changes. With pred:, each
// weight tensor also has a `velocity` on both sides: the rows are
// x - base - held - velocity, and a message's change d moves
// held += velocity + d and velocity += gain * d (a first message leaves the
// velocity at zero).
//
// Packing (x - base - held) is one pass that can run anywhere the weights are
// at hand: pack() does it for a whole message, and the optimizer step calls
// pack() on each block it has just written (HybridEP Fig. 10a, SREncode fused
// with the update), so encode() finds the rows packed. A top-k message is
// applied sparsely on both sides (SRDecode's recovery fused with the
// addition): only its kept entries touch `held`, `carried` or the gradients,
// and, with feedback, a replica rebuilt against the same base version is
// brought up to date at those entries alone (the others have not changed).
// apply() is the dense reference of that path.
//
// delta: (weights) the rows are each weight's bit difference from `held`,
// what the receivers hold, and the message is their byte planes; both sides
// step `held` by the same integers, so it is the sender's weights exactly.
//
// One per (link class, traffic kind) on a worker; not thread-safe (the
// runtime's ExpertCommunicator calls it under its codec mutex).
#pragma once

#include <cstddef>
#include <cstdint>
#include <unordered_map>
#include <vector>

#include "common/status.h"
#include "compression/codec.h"
#include "compression/expert_codec.h"

namespace xd {

struct ExpertTensorRef {
  uint64_t key = 0;            // the caller's name for (layer, expert, which)
  float* data = nullptr;       // tensor_floats; read by encode, written by decode
  const float* base = nullptr; // the base expert's tensor, or null
  uint64_t base_version = 0;   // changes whenever the base's values may have
};

// Sums for the reconstruction error of what was encoded: NMSE = error / signal.
struct ReconstructionError {
  double error = 0, signal = 0;
};

// What packing a message's rows added up: signal = the sum of squares of
// what the receivers should end up with (weights) or of what is sent
// (gradients); residual = the sum of squares of the packed rows.
struct PackSums {
  double signal = 0, residual = 0;
};

class ExpertStreamCodec {
 public:
  enum class Traffic : int { kWeights = 0, kGradients = 1 };
  ExpertStreamCodec(ExpertCodecSpec spec, Traffic traffic, size_t tensor_floats);

  const ExpertCodecSpec& spec() const { return spec_; }
  bool is_raw() const { return spec_.is_raw(); }
  // Receivers rebuild the sender's floats to the bit (raw, or delta:).
  bool is_exact() const { return spec_.is_raw() || spec_.bit_delta; }
  size_t tensor_floats() const { return n_; }

  // Writes elements [from, from + count) of tensor t's row into row[0..count):
  // weights x - base - held, gradients g + carried. Reads the state, never
  // creates it.
  void pack(const ExpertTensorRef& t, size_t from, size_t count, float* row, PackSums* sums) const;
  // Packs `tensors` into `packed` (raw) or `out` (compressed). With a raw
  // spec the packed floats are the message and `out` is left empty. When
  // `prepacked` is given, `packed` already holds every row, from pack().
  // `step` picks the pipeline of a scheduled spec (ExpertCodecSpec::later).
  Status encode(const std::vector<ExpertTensorRef>& tensors, std::vector<float>* packed, EncodedTensor* out,
                ReconstructionError* err, const PackSums* prepacked = nullptr, uint64_t step = 0);
  // A received codec payload of `tensors` (its record's shape already
  // checked against them) into the tensors: weights data = base + decoded
  // (+ held), gradients data += decoded. A top-k message that keeps fewer
  // than all its entries goes the sparse path.
  Status apply_encoded(const std::vector<ExpertTensorRef>& tensors, const CodecRecord& record, const uint8_t* payload,
                       size_t payload_bytes);
  // A message encode() made, taken in by a receiver in the same process (no
  // wire): `packed` when `out` is empty, else `out` decoded. For probes and
  // benchmarks; the runtime's receivers read the wire (expert_wire_codec.h).
  Status receive(const std::vector<ExpertTensorRef>& tensors, const std::vector<float>& packed,
                 const EncodedTensor& out);
  // The dense reference of receive(): `decoded` holds tensors.size() *
  // tensor_floats floats.
  void apply(const std::vector<ExpertTensorRef>& tensors, const float* decoded);
  // The sparse path: `decoded` is the top-k message's kept entries, indices
  // into the packed rows.
  void apply_sparse(const std::vector<ExpertTensorRef>& tensors, const SparseTensor& decoded);

 private:
  std::vector<float>& state(uint64_t key);
  const std::vector<float>* find_state(uint64_t key) const;
  float* velocity(uint64_t key);  // pred: only; null otherwise
  // A message's change d of one weight tensor into `held`, the same float
  // operations on the sender and the receivers: held += d, or with pred:
  // held += velocity (predict), then += d and velocity += gain * d unless
  // the tensor is `fresh` (its first message, which is no change). advance
  // takes a dense d; the sparse path calls predict, then correct per kept
  // entry.
  void advance(float* held, float* velocity, const float* d, bool fresh) const;
  void predict(float* held, const float* velocity) const;  // no-op without a velocity
  Status encode_bit_delta(const std::vector<ExpertTensorRef>& tensors, std::vector<float>* packed,
                          EncodedTensor* out, uint64_t step);
  void correct(float* held, float* velocity, size_t k, float d, bool fresh) const {
    held[k] += d;
    if (velocity && !fresh) velocity[k] += gain_ * d;
  }

  ExpertCodecSpec spec_;
  Traffic traffic_;
  size_t n_;
  std::unordered_map<uint64_t, std::vector<float>> state_;  // held (weights) or carried (gradients)
  std::unordered_map<uint64_t, std::vector<float>> velocity_;  // pred: per weight tensor
  float gain_ = 0;                                              // pred:'s velocity gain
  // Weights with feedback: 1 + the base version a replica was last rebuilt
  // against in full; 0 or absent: never.
  std::unordered_map<uint64_t, uint64_t> rebuilt_;
  std::vector<float> decoded_;
  std::vector<float> scratch_;  // delta: a message's byte planes, or their words
  SparseTensor sparse_;
};

}  // namespace xd
