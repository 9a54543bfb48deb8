// HeldBackGradients: what an inner level's peers send back for this worker's
// own experts, kept aside while an outer level still has to send. The outer
// level's messages carry only the replicas' sums, so with these held back
// they leave before the owned experts' own gradients are final (the
// overlapped schedule computes those at the end of backward). Once they are,
// add_to_owned() adds each peer's share in peer order: every owned gradient
// is summed in the order, and to the bits, of the simple schedule. Owns its
// buffers; not thread-safe: one per layer's reduce at one level, filled on
// the expert communicator's receiving thread and added on the thread that
// waits for the owned gradients, after a hand-over.
#pragma once

#include <cstddef>
#include <vector>

#include "compression/expert_stream_codec.h"

namespace xd::detail {

class HeldBackGradients {
 public:
  // `mine`: the tensors the level's messages add into, in message order;
  // those whose data is one of `owned`'s are held back. `peers` messages
  // arrive, each of `mine.size()` tensors of `tensor_floats`.
  HeldBackGradients(std::vector<ExpertTensorRef> mine, const std::vector<ExpertTensorRef>& owned, size_t peers,
                    size_t tensor_floats);

  // The tensors peer i's message adds into: `mine`, with the owned ones in
  // peer i's own zeroed buffer.
  std::vector<ExpertTensorRef> refs_for(size_t peer);
  // Adds every peer's held-back gradients into the owned ones, peer by peer.
  void add_to_owned() const;
  size_t owned_tensors() const { return owned_at_.size(); }

 private:
  std::vector<ExpertTensorRef> mine_;
  std::vector<size_t> owned_at_;  // positions in mine_
  size_t floats_;
  std::vector<std::vector<float>> per_peer_;  // (owned tensors, floats) each
};

}  // namespace xd::detail
