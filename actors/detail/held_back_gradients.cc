#include "actors/detail/held_back_gradients.h"

#include <unordered_set>

#include "common/check.h"

namespace xd::detail {

HeldBackGradients::HeldBackGradients(std::vector<ExpertTensorRef> mine, const std::vector<ExpertTensorRef>& owned,
                                     size_t peers, size_t tensor_floats)
    : mine_(std::move(mine)), floats_(tensor_floats) {
  std::unordered_set<const float*> owned_data;
  for (const ExpertTensorRef& t : owned) owned_data.insert(t.data);
  for (size_t k = 0; k < mine_.size(); ++k)
    if (owned_data.count(mine_[k].data)) owned_at_.push_back(k);
  // -0, not +0: x + -0 is x for every x, -0 included, so an entry no
  // message touched adds nothing, to the bit.
  per_peer_.assign(peers, std::vector<float>(owned_at_.size() * floats_, -0.0f));
}

std::vector<ExpertTensorRef> HeldBackGradients::refs_for(size_t peer) {
  XD_CHECK(peer < per_peer_.size());
  std::vector<ExpertTensorRef> refs = mine_;
  for (size_t j = 0; j < owned_at_.size(); ++j) refs[owned_at_[j]].data = &per_peer_[peer][j * floats_];
  return refs;
}

void HeldBackGradients::add_to_owned() const {
  for (const std::vector<float>& held : per_peer_)
    for (size_t j = 0; j < owned_at_.size(); ++j) {
      float* to = mine_[owned_at_[j]].data;
      const float* from = &held[j * floats_];
      for (size_t k = 0; k < floats_; ++k) to[k] += from[k];
    }
}

}  // namespace xd::detail
