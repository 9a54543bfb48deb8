#include "actors/expert_communicator.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <mutex>

#include "actors/detail/dense_all_reduce.h"
#include "actors/detail/expert_wire_codec.h"
#include "actors/detail/held_back_gradients.h"
#include "actors/detail/work_thread.h"
#include "common/clock.h"

namespace xd {

namespace {

// One layer's tensors (w1, w3, w2) of every expert of `workers`, in worker
// order: the layout of an expert message.
template <typename RefOf>
std::vector<ExpertTensorRef> tensor_refs(const std::vector<int>& workers, int per_worker, RefOf ref_of) {
  std::vector<ExpertTensorRef> out;
  for (int m : workers)
    for (int j = 0; j < per_worker; ++j)
      for (int which = 0; which < 3; ++which) out.push_back(ref_of(m * per_worker + j, which));
  return out;
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
  const int levels = topology_.num_levels();
  figures_.assign(levels, ExpertCodecFigures{});
  XD_CHECK(set_codecs(ExpertCodecOptions{std::vector<ExpertCodecSpec>(levels), std::vector<ExpertCodecSpec>(levels)})
               .is_ok());
  actor_ = std::make_unique<detail::WorkThread>("expert-comm");
  sender_ = std::make_unique<detail::WorkThread>("expert-send");
  owned_ = std::make_unique<detail::WorkThread>("expert-owned");
}

ExpertCommunicator::~ExpertCommunicator() {
  // A wait for owned gradients that will not come (a step abandoned mid-backward) ends now.
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  // The receiving actor may wait for the sender: stop it first.
  owned_.reset();  // waits for the receiving actor
  actor_.reset();
  sender_.reset();
}

Status ExpertCommunicator::set_codecs(const ExpertCodecOptions& o) {
  const int levels = topology_.num_levels();
  if ((int)o.gather.size() != levels || (int)o.grad.size() != levels)
    return Status::invalid_argument("expert codecs: one per level expected (" + std::to_string(levels) + ")");
  bool base = false;
  gather_codecs_.clear();
  grad_codecs_.clear();
  for (int l = 0; l < levels; ++l) {
    if (o.grad[l].against_base) return Status::invalid_argument("expert gradients have no base ('sr:')");
    if (o.grad[l].predict) return Status::invalid_argument("expert gradients take no prediction ('pred:')");
    if (o.grad[l].bit_delta)
      return Status::invalid_argument("expert gradients take no bit differences ('delta:'): a step's gradients "
                                      "are not the last step's plus a little");
    base = base || (o.gather[l].against_base && !topology_.ag_peers(rank_, l).empty());
    gather_codecs_.push_back(std::make_unique<ExpertStreamCodec>(
        o.gather[l], ExpertStreamCodec::Traffic::kWeights, expert_floats_));
    grad_codecs_.push_back(std::make_unique<ExpertStreamCodec>(
        o.grad[l], ExpertStreamCodec::Traffic::kGradients, expert_floats_));
  }
  if (base && o.base_sync_every < 0) return Status::invalid_argument("base_sync_every must be >= 0");
  codec_options_ = o;
  uses_base_ = base;
  plan_relays();
  std::lock_guard<std::mutex> lock(mu_);
  base_.assign(base ? (size_t)layers_ * 3 * expert_floats_ : 0, 0.0f);
  return Status::ok();
}

std::vector<float> ExpertCommunicator::base_copy() const {
  std::lock_guard<std::mutex> lock(mu_);
  return base_;
}

std::vector<ExpertCodecFigures> ExpertCommunicator::take_codec_figures() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<ExpertCodecFigures> out = figures_;
  std::fill(figures_.begin(), figures_.end(), ExpertCodecFigures{});
  return out;
}

void ExpertCommunicator::drain() {
  // The owned-gradient thread's closures follow the receiving actor's.
  for (Actor* a : {actor_.get(), owned_.get()}) {
    std::mutex m;
    std::condition_variable cv;
    bool done = false;
    a->post([&] {
      std::lock_guard<std::mutex> lock(m);
      done = true;
      cv.notify_all();
    });
    std::unique_lock<std::mutex> lock(m);
    cv.wait(lock, [&] { return done; });
  }
}

uint64_t ExpertCommunicator::tensor_key(int layer, int expert, int which) const {
  return ((uint64_t)layer * model_->config().num_experts + expert) * 3 + which;
}

const float* ExpertCommunicator::base_of(int layer, int which) const {
  return uses_base_ ? &base_[((size_t)layer * 3 + which) * expert_floats_] : nullptr;
}

Status ExpertCommunicator::sync_base(uint32_t step, std::vector<float>& sums) {
  Communicator* inner = codec_options_.base_inner;
  Communicator* outer = codec_options_.base_outer;
  if (inner && outer && (inner->size() > 1 || outer->size() > 1)) {
    // Every rank ends with the same bits: each shard is summed in one place
    // and then copied (reduce-scatter, then all-gather), in bf16 or fp32.
    CollectiveTag tag{step, kNoLayer, 2, MessageKind::kExpertBase};
    if (codec_options_.base_outer_sign && !base_sign_) base_sign_ = std::make_unique<detail::SignDeltaState>();
    const detail::DenseWirePrecision precision{codec_options_.base_inner_bf16, codec_options_.base_outer_bf16,
                                               codec_options_.base_outer_sign ? base_sign_.get() : nullptr};
    detail::CastFigures cast;
    Status st = detail::dense_all_reduce(inner, outer, precision, tag, sums.data(), sums.size(), &cast);
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto [f, c] : {std::pair{&figures_.back(), &cast.inner}, std::pair{&figures_.front(), &cast.outer}}) {
        f->base_codec += c->seconds;
        f->base_error += c->error;
        f->base_signal += c->signal;
      }
    }
    XD_RETURN_IF_ERROR(st);
  }
  const float inv = 1.0f / model_->config().num_experts;
  for (float& v : sums) v *= inv;
  std::lock_guard<std::mutex> lock(mu_);
  base_.swap(sums);
  ++base_version_;
  return Status::ok();
}
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

void ExpertCommunicator::zero_replica_grads() {
  std::fill(replica_grads_.begin(), replica_grads_.end(), 0.0f);
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& s : state_) s.owned_final = false;
}

void ExpertCommunicator::owned_grads_final(int layer) {
  std::lock_guard<std::mutex> lock(mu_);
  state_[layer].owned_final = true;
  cv_.notify_all();
}

void ExpertCommunicator::finish(int layer, bool gather, const Status& st) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!st.is_ok() && status_.is_ok()) status_ = st;
  (gather ? state_[layer].gathered : state_[layer].reduced) = true;
  cv_.notify_all();
}

int ExpertCommunicator::first_gather_level() const {
  for (int l = 0; l < topology_.num_levels(); ++l)
    if (!topology_.ag_peers(rank_, l).empty()) return l;
  return -1;
}

bool ExpertCommunicator::base_due(uint32_t step) const {
  const int every = codec_options_.base_sync_every;
  // A communicator made mid-job (a plan switch) has no base yet: its first gather syncs one.
  return uses_base_ && (first_gather_ || step == 0 || (every > 0 && step % every == 0));
}

std::vector<float> ExpertCommunicator::base_share() {
  std::vector<float> sums((size_t)layers_ * 3 * expert_floats_, 0.0f);
  for (int layer = 0; layer < layers_; ++layer)
    for (int j = 0; j < experts_per_worker_; ++j)
      for (int which = 0; which < 3; ++which) {
        const float* w = weights_of(layer, rank_ * experts_per_worker_ + j, which);
        float* s = &sums[((size_t)layer * 3 + which) * expert_floats_];
        for (size_t k = 0; k < expert_floats_; ++k) s[k] += w[k];
      }
  return sums;
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

// Peer i's message goes through the level's codec into refs_of(peer i); then
// the sends are waited for and the level's figures added.
Status ExpertCommunicator::receive_level(int l, LevelExchange* x, bool gather,
                                         const std::function<std::vector<ExpertTensorRef>(int)>& refs_of,
                                         std::vector<Relayed>* kept) {
  const std::vector<int> peers = topology_.ag_peers(rank_, l);
  ExpertStreamCodec& codec = gather ? *gather_codecs_[l] : *grad_codecs_[l];
  for (size_t i = 0; i < peers.size(); ++i) {
    auto msg = x->slots[i]->wait(timeout_);
    const std::string from =
        std::string(gather ? "expert all-gather" : "expert gradient reduce") + " from rank " + std::to_string(peers[i]);
    if (!msg) return msg.status().with_context(from);
    const std::vector<ExpertTensorRef> refs = refs_of(peers[i]);
    const double t0 = thread_cpu_seconds();
    {
      std::lock_guard<std::mutex> lock(codec_mu_);
      XD_RETURN_IF_ERROR(detail::receive_message(codec, refs, *msg).with_context(from));
    }
    x->codec.decode += thread_cpu_seconds() - t0;
    if (kept) kept->push_back({l, peers[i], refs.size(), std::make_shared<IncomingMessage>(std::move(*msg))});
  }
  for (auto& c : x->sends) XD_RETURN_IF_ERROR(c->wait(timeout_));
  std::lock_guard<std::mutex> lock(mu_);
  ExpertCodecFigures& f = figures_[l];
  (gather ? f.gather_raw_bytes : f.grad_raw_bytes) += x->raw_bytes;
  (gather ? f.gather_error : f.grad_error) += x->error;
  (gather ? f.gather_signal : f.grad_signal) += x->signal;
  if (!codec.is_raw()) (gather ? f.gather_codec : f.grad_codec) += x->codec;
  return Status::ok();
}

std::vector<ExpertTensorRef> ExpertCommunicator::gather_refs(int layer, const std::vector<int>& workers) {
  return tensor_refs(workers, experts_per_worker_, [&](int e, int which) {
    return ExpertTensorRef{tensor_key(layer, e, which), weights_of(layer, e, which), base_of(layer, which),
                           base_version_.load()};
  });
}

std::vector<ExpertTensorRef> ExpertCommunicator::grad_refs(int layer, const std::vector<int>& workers) {
  return tensor_refs(workers, experts_per_worker_, [&](int e, int which) {
    return ExpertTensorRef{tensor_key(layer, e, which), grads_of(layer, e, which), nullptr};
  });
}

}  // namespace xd
