#include "actors/expert_communicator.h"

#include <algorithm>
#include <cstring>

namespace xd {

namespace {
class CommActor : public Actor {
 public:
  CommActor() : Actor("expert-comm") {}
  ~CommActor() override {
    stop();
    join();
  }
};

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}
}  // namespace

ExpertCommunicator::ExpertCommunicator(Transport* transport, Topology topology,
                                       MoeTransformer<float>* model, std::chrono::milliseconds timeout)
    : transport_(transport),
      topology_(std::move(topology)),
      model_(model),
      timeout_(timeout),
      rank_(transport->rank()) {
  const ModelConfig& cfg = model->config();
  experts_per_worker_ = cfg.num_experts / topology_.world_size();
  layers_ = cfg.num_layers;
  expert_floats_ = (size_t)cfg.expert_intermediate_size * cfg.hidden_size;
  XD_CHECK(model->layout().num_local_experts() == experts_per_worker_);
  XD_CHECK(model->layout().first_expert() == rank_ * experts_per_worker_);
  replica_slot_.assign(cfg.num_experts, -1);
  for (int m : held_after(rank_, topology_.num_levels())) {
    if (m == rank_) continue;
    for (int j = 0; j < experts_per_worker_; ++j) replica_slot_[m * experts_per_worker_ + j] = replicas_per_layer_++;
  }
  const size_t n = (size_t)layers_ * replicas_per_layer_ * 3 * expert_floats_;
  replica_weights_.assign(n, 0.0f);
  replica_grads_.assign(n, 0.0f);
  state_.assign(layers_, LayerState{});
  gather_wait_.assign(layers_, 0.0);
  actor_ = std::make_unique<CommActor>();
  actor_->start();
}

ExpertCommunicator::~ExpertCommunicator() { actor_.reset(); }

size_t ExpertCommunicator::replica_bytes() const { return replica_weights_.size() * sizeof(float); }

std::vector<int> ExpertCommunicator::held_after(int m, int level) const {
  std::vector<int> out;
  for (int x = 0; x < topology_.world_size(); ++x) {
    bool ok = true;
    for (int l = 0; l < topology_.num_levels() && ok; ++l)
      ok = l < level ? topology_.domain(x, l) == topology_.domain(m, l)
                     : topology_.coordinate(x, l) == topology_.coordinate(m, l);
    if (ok) out.push_back(x);
  }
  return out;
}

float* ExpertCommunicator::tensor_of(int layer, int expert, int which, bool gradient) {
  const int owner = expert / experts_per_worker_;
  if (owner == rank_) {
    const LayerWeights<float>& W = (gradient ? model_->grad_weights() : model_->weights()).layers[layer];
    float* base = which == 0 ? W.w1 : which == 1 ? W.w3 : W.w2;
    return base + (size_t)(expert - rank_ * experts_per_worker_) * expert_floats_;
  }
  const int slot = replica_slot_[expert];
  XD_CHECK(slot >= 0);
  std::vector<float>& store = gradient ? replica_grads_ : replica_weights_;
  return &store[(((size_t)layer * replicas_per_layer_ + slot) * 3 + which) * expert_floats_];
}

float* ExpertCommunicator::weights_of(int layer, int expert, int which) {
  return tensor_of(layer, expert, which, false);
}

float* ExpertCommunicator::grads_of(int layer, int expert, int which) {
  return tensor_of(layer, expert, which, true);
}

ExpertParams<float> ExpertCommunicator::replica(int layer, int expert) {
  return {weights_of(layer, expert, 0), weights_of(layer, expert, 1), weights_of(layer, expert, 2),
          grads_of(layer, expert, 0),   grads_of(layer, expert, 1),   grads_of(layer, expert, 2)};
}

void ExpertCommunicator::zero_replica_grads() { std::fill(replica_grads_.begin(), replica_grads_.end(), 0.0f); }

void ExpertCommunicator::finish(int layer, bool gather, const Status& st) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!st.is_ok() && status_.is_ok()) status_ = st;
  (gather ? state_[layer].gathered : state_[layer].reduced) = true;
  cv_.notify_all();
}

void ExpertCommunicator::start_gather(uint32_t step) {
  if (!holds_replicas()) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& s : state_) s.gathered = false;
  }
  for (int layer = 0; layer < layers_; ++layer)
    actor_->post([this, step, layer] { finish(layer, true, gather_layer(step, layer)); });
}

void ExpertCommunicator::wait_gathered(int layer) {
  const auto start = std::chrono::steady_clock::now();
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return state_[layer].gathered; });
  gather_wait_[layer] += seconds_since(start);
}

void ExpertCommunicator::start_reduce(uint32_t step, int layer) {
  if (!holds_replicas()) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    state_[layer].reduced = false;
  }
  actor_->post([this, step, layer] { finish(layer, false, reduce_layer(step, layer)); });
}

Status ExpertCommunicator::wait_reduced() {
  const auto start = std::chrono::steady_clock::now();
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] {
    for (const auto& s : state_)
      if (!s.reduced) return false;
    return true;
  });
  reduce_wait_ += seconds_since(start);
  return status_;
}

std::vector<double> ExpertCommunicator::take_gather_wait_seconds() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<double> out = gather_wait_;
  std::fill(gather_wait_.begin(), gather_wait_.end(), 0.0);
  return out;
}

double ExpertCommunicator::take_reduce_wait_seconds() {
  std::lock_guard<std::mutex> lock(mu_);
  double s = reduce_wait_;
  reduce_wait_ = 0;
  return s;
}

Status ExpertCommunicator::status() const {
  std::lock_guard<std::mutex> lock(mu_);
  return status_;
}

Status ExpertCommunicator::gather_layer(uint32_t step, int layer) {
  const size_t per_expert = 3 * expert_floats_;
  for (int l = 0; l < topology_.num_levels(); ++l) {
    const std::vector<int> peers = topology_.ag_peers(rank_, l);
    if (peers.empty()) continue;
    const Tag tag{MessageKind::kExpertGather, step, static_cast<uint16_t>(layer), 0, static_cast<uint32_t>(l)};
    std::vector<std::shared_ptr<RecvSlot>> slots;
    for (int p : peers) slots.push_back(transport_->recv(p, tag));
    // Everything held after the outer levels, in worker order.
    const std::vector<int> mine = held_after(rank_, l);
    auto buf = std::make_shared<std::vector<float>>(mine.size() * experts_per_worker_ * per_expert);
    size_t off = 0;
    for (int m : mine)
      for (int j = 0; j < experts_per_worker_; ++j)
        for (int which = 0; which < 3; ++which, off += expert_floats_)
          std::memcpy(&(*buf)[off], weights_of(layer, m * experts_per_worker_ + j, which),
                      expert_floats_ * sizeof(float));
    OutFrame frame{buf->data(), buf->size() * sizeof(float), std::shared_ptr<const void>(buf, buf->data())};
    std::vector<std::shared_ptr<Completion>> sends;
    for (int p : peers) sends.push_back(transport_->send(p, tag, {frame}));
    for (size_t i = 0; i < peers.size(); ++i) {
      auto msg = slots[i]->wait(timeout_);
      if (!msg) return msg.status().with_context("expert all-gather from rank " + std::to_string(peers[i]));
      const std::vector<int> theirs = held_after(peers[i], l);
      const size_t expect = theirs.size() * experts_per_worker_ * per_expert * sizeof(float);
      if (msg->num_tensors() != 1 || msg->tensor_size(0) != expect)
        return Status::corruption("expert all-gather: wrong size from rank " + std::to_string(peers[i]));
      const float* src = static_cast<const float*>(msg->tensor_data(0));
      size_t in = 0;
      for (int m : theirs)
        for (int j = 0; j < experts_per_worker_; ++j)
          for (int which = 0; which < 3; ++which, in += expert_floats_)
            std::memcpy(weights_of(layer, m * experts_per_worker_ + j, which), src + in,
                        expert_floats_ * sizeof(float));
    }
    for (auto& c : sends) XD_RETURN_IF_ERROR(c->wait(timeout_));
  }
  return Status::ok();
}

Status ExpertCommunicator::reduce_layer(uint32_t step, int layer) {
  const size_t per_expert = 3 * expert_floats_;
  for (int l = topology_.num_levels() - 1; l >= 0; --l) {
    const std::vector<int> peers = topology_.ag_peers(rank_, l);
    if (peers.empty()) continue;
    const Tag tag{MessageKind::kExpertGrad, step, static_cast<uint16_t>(layer), 0, static_cast<uint32_t>(l)};
    std::vector<std::shared_ptr<RecvSlot>> slots;
    for (int p : peers) slots.push_back(transport_->recv(p, tag));
    std::vector<std::shared_ptr<Completion>> sends;
    for (int p : peers) {
      // The gradients of what p contributed at this level go back to p.
      const std::vector<int> theirs = held_after(p, l);
      auto buf = std::make_shared<std::vector<float>>(theirs.size() * experts_per_worker_ * per_expert);
      size_t off = 0;
      for (int m : theirs)
        for (int j = 0; j < experts_per_worker_; ++j)
          for (int which = 0; which < 3; ++which, off += expert_floats_)
            std::memcpy(&(*buf)[off], grads_of(layer, m * experts_per_worker_ + j, which),
                        expert_floats_ * sizeof(float));
      OutFrame frame{buf->data(), buf->size() * sizeof(float), std::shared_ptr<const void>(buf, buf->data())};
      sends.push_back(transport_->send(p, tag, {frame}));
    }
    const std::vector<int> mine = held_after(rank_, l);
    const size_t expect = mine.size() * experts_per_worker_ * per_expert * sizeof(float);
    for (size_t i = 0; i < peers.size(); ++i) {
      auto msg = slots[i]->wait(timeout_);
      if (!msg) return msg.status().with_context("expert gradient reduce from rank " + std::to_string(peers[i]));
      if (msg->num_tensors() != 1 || msg->tensor_size(0) != expect)
        return Status::corruption("expert gradient reduce: wrong size from rank " + std::to_string(peers[i]));
      const float* src = static_cast<const float*>(msg->tensor_data(0));
      size_t in = 0;
      for (int m : mine)
        for (int j = 0; j < experts_per_worker_; ++j)
          for (int which = 0; which < 3; ++which, in += expert_floats_) {
            float* dst = grads_of(layer, m * experts_per_worker_ + j, which);
            for (size_t k = 0; k < expert_floats_; ++k) dst[k] += src[in + k];
          }
    }
    for (auto& c : sends) XD_RETURN_IF_ERROR(c->wait(timeout_));
  }
  return Status::ok();
}

}  // namespace xd
