#include "actors/expert_communicator.h"

#include <algorithm>
#include <cstring>
#include <future>

#include "actors/detail/dense_all_reduce.h"
#include "actors/detail/expert_wire_codec.h"
#include "actors/detail/held_back_gradients.h"
#include "actors/detail/work_thread.h"

namespace xd {

namespace {
double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

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

struct ExpertCommunicator::PackedRows {
  std::vector<float> packed;  // the message's rows: (experts per worker, 3, ff*d)
  PackSums sums;
};

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

double ExpertCommunicator::take_codec_seconds() {
  std::lock_guard<std::mutex> lock(mu_);
  const double s = codec_s_;
  codec_s_ = 0;
  return s;
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
    XD_RETURN_IF_ERROR(detail::dense_all_reduce(inner, outer, precision, tag, sums.data(), sums.size()));
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

std::function<void(size_t, size_t)> ExpertCommunicator::fused_encoder(uint32_t next_step) {
  prepared_ = Prepared{};
  std::function<void(size_t, size_t)> pack = packer(next_step);
  // The first gathers of a communicator wait behind its first base
  // all-reduce (start_gather). Later ones encode against the base installed
  // by now (wait_reduced() ran after every base all-reduce posted so far).
  if (!holds_replicas() || first_gather_ || next_step == 0 || first_gather_level() < 0) return pack;
  // Where each layer's own experts end in the parameters: once the update
  // has passed it, that layer's messages can leave.
  std::vector<size_t> layer_end(layers_, 0);
  const size_t span = (size_t)experts_per_worker_ * expert_floats_;
  for (int layer = 0; layer < layers_; ++layer)
    for (int which = 0; which < 3; ++which) layer_end[layer] = std::max(layer_end[layer], own_block(layer, which) + span);
  prepared_.step = next_step;
  prepared_.sent.assign(layers_, FirstSend{});
  return [this, pack = std::move(pack), layer_end = std::move(layer_end), next_step, next = 0](
             size_t begin, size_t end) mutable {
    if (pack) pack(begin, end);
    for (; next < layers_ && end >= layer_end[next]; ++next) {
      std::shared_ptr<PackedRows> rows = prepared_.rows.empty() ? nullptr : prepared_.rows[next];
      prepared_.sent[next] = post_first_send(next_step, next, std::move(rows));
      ++sent_during_update_;
    }
  };
}

// fused_encoder's packing: the next base's share and the first-level rows.
std::function<void(size_t, size_t)> ExpertCommunicator::packer(uint32_t next_step) {
  // Before the first gather the base is synced first, against weights this
  // update has not written yet: nothing to fuse.
  if (!holds_replicas() || !codec_options_.fused_encode || first_gather_ || next_step == 0) return {};
  const bool base = base_due(next_step);
  const int level = first_gather_level();
  // Only messages of this worker's own experts can be packed from the update.
  ExpertStreamCodec* codec =
      level >= 0 && !gather_codecs_[level]->is_raw() && held_after(rank_, level) == std::vector<int>{rank_}
          ? gather_codecs_[level].get()
          : nullptr;
  if (!base && !codec) return {};
  prepared_.step = next_step;
  if (base) prepared_.base_sums = std::make_shared<std::vector<float>>((size_t)layers_ * 3 * expert_floats_, 0.0f);
  for (int layer = 0; codec && layer < layers_; ++layer) {
    auto rows = std::make_shared<PackedRows>();
    rows->packed.assign((size_t)experts_per_worker_ * 3 * expert_floats_, 0.0f);
    prepared_.rows.push_back(std::move(rows));
  }
  // Each (layer, which) block of own experts, (experts per worker, ff*d), as
  // an offset into the parameters.
  struct Block {
    size_t begin;
    int layer, which;
  };
  std::vector<Block> blocks;
  for (int layer = 0; layer < layers_; ++layer)
    for (int which = 0; which < 3; ++which) blocks.push_back({own_block(layer, which), layer, which});
  return [this, blocks = std::move(blocks), codec, prep = &prepared_](size_t begin, size_t end) {
    const size_t n = expert_floats_, span = (size_t)experts_per_worker_ * n;
    double pack_s = 0;
    for (const Block& b : blocks) {
      const size_t lo = std::max(begin, b.begin), hi = std::min(end, b.begin + span);
      for (size_t at = lo; at < hi;) {
        const int j = (int)((at - b.begin) / n);
        const size_t k = (at - b.begin) % n, count = std::min(hi - at, n - k);
        const int expert = rank_ * experts_per_worker_ + j;
        if (prep->base_sums) {
          // Experts in order per element, as base_share() sums them: the same bits.
          const float* w = weights_of(b.layer, expert, b.which) + k;
          float* s = &(*prep->base_sums)[((size_t)b.layer * 3 + b.which) * n + k];
          for (size_t q = 0; q < count; ++q) s[q] += w[q];
        }
        if (codec) {
          const auto t0 = std::chrono::steady_clock::now();
          PackedRows& rows = *prep->rows[b.layer];
          const ExpertTensorRef ref{tensor_key(b.layer, expert, b.which), weights_of(b.layer, expert, b.which),
                                    base_of(b.layer, b.which)};
          {
            std::lock_guard<std::mutex> lock(codec_mu_);
            codec->pack(ref, k, count, &rows.packed[((size_t)j * 3 + b.which) * n + k], &rows.sums);
          }
          pack_s += seconds_since(t0);
        }
        at += count;
      }
    }
    if (pack_s > 0) {
      std::lock_guard<std::mutex> lock(mu_);
      codec_s_ += pack_s;
    }
  };
}

void ExpertCommunicator::start_gather(uint32_t step) {
  Prepared prep = std::move(prepared_);
  prepared_ = Prepared{};
  // Messages the update sent have moved the codecs' state: this must be
  // their step.
  for (const FirstSend& f : prep.sent) XD_CHECK(!f.exchange || prep.step == step);
  if (prep.step != step) prep = Prepared{};  // packed for another step (or nothing)
  if (!holds_replicas()) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& s : state_) s.gathered = false;
  }
  const bool first = first_gather_ || step == 0;
  const bool due = base_due(step);
  first_gather_ = false;
  std::shared_ptr<std::vector<float>> sums;
  // This worker's share of every layer's mean expert, taken now (or packed
  // by the optimizer step just before): nothing touches the weights until
  // the next step's update.
  if (due) sums = prep.base_sums ? prep.base_sums : std::make_shared<std::vector<float>>(base_share());
  auto post_sync = [this, step, sums] {
    actor_->post([this, step, sums] {
      // A failed sync leaves this worker's base unlike its peers': every
      // later gather refuses to run against it (gather_layer).
      ScopedSpan span(timeline_, "SR base all-reduce", -1, Lane::kExperts);
      if (base_status_.is_ok()) base_status_ = sync_base(step, *sums).with_context("SR base all-reduce");
    });
  };
  // The first gathers need a base; later ones use the last.
  if (due && first) post_sync();
  // Every layer's first-level messages leave at once (from the sender
  // thread), so the link never idles between layers and their latencies
  // overlap; the actor thread takes them in layer order. With sr: the sends
  // stay on the actor thread, behind the base all-reduce they encode against,
  // unless the optimizer step sent them: after wait_reduced() the actor
  // thread has installed every base posted before, and a base due now is
  // installed after this step's gathers.
  // One sender closure per layer, so layer k waits only for its own send.
  // Layers the optimizer step sent already keep their sends.
  std::vector<std::shared_ptr<LevelExchange>> sent(layers_);
  std::vector<std::shared_future<void>> layer_sent(layers_);
  std::vector<std::shared_ptr<PackedRows>> rows = std::move(prep.rows);
  rows.resize(layers_);
  prep.sent.resize(layers_);
  for (int layer = 0; layer < layers_; ++layer) {
    if (!prep.sent[layer].exchange && uses_base_) continue;  // the actor thread sends
    FirstSend f = prep.sent[layer].exchange ? prep.sent[layer] : post_first_send(step, layer, rows[layer]);
    sent[layer] = f.exchange;
    layer_sent[layer] = f.sent;
  }
  for (int layer = 0; layer < layers_; ++layer)
    actor_->post([this, step, layer, x = sent[layer], ready = layer_sent[layer], r = sent[layer] ? nullptr : rows[layer]] {
      ScopedSpan span(timeline_, "expert all-gather", layer, Lane::kExperts);
      if (ready.valid()) ready.wait();
      finish(layer, true, gather_layer(step, layer, x.get(), r.get()));
    });
  if (due && !first) post_sync();
}

size_t ExpertCommunicator::own_block(int layer, int which) {
  return (size_t)(weights_of(layer, rank_ * experts_per_worker_, which) - model_->params().data());
}

ExpertCommunicator::FirstSend ExpertCommunicator::post_first_send(uint32_t step, int layer,
                                                                  std::shared_ptr<PackedRows> rows) {
  auto x = std::make_shared<LevelExchange>();
  auto done = std::make_shared<std::promise<void>>();
  FirstSend f{x, done->get_future().share()};
  sender_->post([this, step, layer, x, done, rows = std::move(rows)] {
    const int l = first_gather_level();
    if (l >= 0) x->status = send_gather_level(step, layer, l, x.get(), rows.get());
    done->set_value();
  });
  return f;
}

bool ExpertCommunicator::gathered(int layer) const {
  std::lock_guard<std::mutex> lock(mu_);
  return state_[layer].gathered;
}

void ExpertCommunicator::wait_gathered(int layer) {
  const auto start = std::chrono::steady_clock::now();
  const double t0 = steady_seconds();
  std::unique_lock<std::mutex> lock(mu_);
  if (state_[layer].gathered) return;
  cv_.wait(lock, [&] { return state_[layer].gathered; });
  gather_wait_[layer] += seconds_since(start);
  if (timeline_) timeline_->add(Span{"wait expert all-gather", layer, Lane::kCompute, true, t0, steady_seconds()});
}

void ExpertCommunicator::start_reduce(uint32_t step, int layer) {
  if (!holds_replicas()) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    state_[layer].reduced = false;
  }
  // The first level's messages leave from the sender thread right away, not
  // behind the previous layer's receives.
  auto x = std::make_shared<LevelExchange>();
  auto done = std::make_shared<std::promise<void>>();
  std::shared_future<void> sent = done->get_future().share();
  sender_->post([this, step, layer, x, done] {
    for (int l = topology_.num_levels() - 1; l >= 0; --l)
      if (!topology_.ag_peers(rank_, l).empty()) {
        x->status = send_reduce_level(step, layer, l, x.get());
        break;
      }
    done->set_value();
  });
  auto pending = std::make_shared<PendingReduce>();
  auto received = std::make_shared<std::promise<void>>();
  std::shared_future<void> replicas_done = received->get_future().share();
  actor_->post([this, step, layer, x, sent, pending, received] {
    ScopedSpan span(timeline_, "replica gradients", layer, Lane::kExperts);
    sent.wait();
    pending->status = reduce_replicas(step, layer, x, pending.get());
    received->set_value();
  });
  owned_->post([this, layer, pending, replicas_done] {
    replicas_done.wait();
    finish(layer, false, pending->status.is_ok() ? reduce_owned(layer, pending.get()) : pending->status);
  });
}

Status ExpertCommunicator::wait_reduced() {
  const auto start = std::chrono::steady_clock::now();
  const double t0 = steady_seconds();
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] {
    for (const auto& s : state_)
      if (!s.reduced) return false;
    return true;
  });
  reduce_wait_ += seconds_since(start);
  // Drawn like every other wait, so the end of a HybridEP backward shows the
  // replica gradients' return instead of a gap in the compute row.
  if (timeline_) timeline_->add(Span{"wait replica gradients", -1, Lane::kCompute, true, t0, steady_seconds()});
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

// One level's gather messages of one layer: this worker's held experts (as
// of the outer levels) to every AG peer of the level.
Status ExpertCommunicator::send_gather_level(uint32_t step, int layer, int l, LevelExchange* x, PackedRows* rows) {
  const std::vector<int> peers = topology_.ag_peers(rank_, l);
  const Tag tag{MessageKind::kExpertGather, step, static_cast<uint16_t>(layer), 0, static_cast<uint32_t>(l)};
  for (int p : peers) x->slots.push_back(transport_->recv(p, tag));
  const std::vector<ExpertTensorRef> mine = gather_refs(layer, held_after(rank_, l));
  std::vector<float> packed;
  if (rows) {
    packed.swap(rows->packed);
    ++fused_messages_;
  }
  EncodedTensor encoded;
  const auto t0 = std::chrono::steady_clock::now();
  ReconstructionError err;
  {
    std::lock_guard<std::mutex> lock(codec_mu_);
    XD_RETURN_IF_ERROR(gather_codecs_[l]->encode(mine, &packed, &encoded, &err, rows ? &rows->sums : nullptr, step)
                           .with_context("expert all-gather"));
  }
  x->error += err.error;
  x->signal += err.signal;
  x->codec_s += seconds_since(t0);
  x->raw_bytes += double(packed.size() * sizeof(float)) * peers.size();
  detail::WireMessage w = detail::wire_message(std::move(packed), std::move(encoded));
  for (int p : peers) x->sends.push_back(transport_->send(p, tag, w.frames, w.metadata, w.flags));
  return Status::ok();
}

Status ExpertCommunicator::receive_gather_level(int layer, int l, LevelExchange* x, std::vector<Relayed>* kept) {
  return receive_level(
      l, x, /*gather=*/true, [&](int peer) { return gather_refs(layer, held_after(peer, l)); },
      gather_codecs_[l]->is_raw() ? nullptr : kept);
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
    const auto t0 = std::chrono::steady_clock::now();
    {
      std::lock_guard<std::mutex> lock(codec_mu_);
      XD_RETURN_IF_ERROR(detail::receive_message(codec, refs, *msg).with_context(from));
    }
    x->codec_s += seconds_since(t0);
    if (kept) kept->push_back({l, peers[i], refs.size(), std::make_shared<IncomingMessage>(std::move(*msg))});
  }
  for (auto& c : x->sends) XD_RETURN_IF_ERROR(c->wait(timeout_));
  std::lock_guard<std::mutex> lock(mu_);
  ExpertCodecFigures& f = figures_[l];
  (gather ? f.gather_raw_bytes : f.grad_raw_bytes) += x->raw_bytes;
  (gather ? f.gather_error : f.grad_error) += x->error;
  (gather ? f.gather_signal : f.grad_signal) += x->signal;
  if (!codec.is_raw()) codec_s_ += x->codec_s;
  return Status::ok();
}

Status ExpertCommunicator::gather_layer(uint32_t step, int layer, LevelExchange* first_sent, PackedRows* rows) {
  XD_RETURN_IF_ERROR(base_status_);
  bool first = true;
  std::vector<Relayed> kept;  // what crossed lossy levels, for the raw ones inside them
  for (int l = 0; l < topology_.num_levels(); ++l) {
    if (topology_.ag_peers(rank_, l).empty()) continue;
    if (relay_levels_[l].relays) {
      XD_RETURN_IF_ERROR(relay_gather_level(step, layer, l, &kept));
      first = false;
      continue;
    }
    LevelExchange own;
    LevelExchange* x = first && first_sent ? first_sent : &own;
    if (x == &own) XD_RETURN_IF_ERROR(send_gather_level(step, layer, l, x, first ? rows : nullptr));
    XD_RETURN_IF_ERROR(x->status);
    XD_RETURN_IF_ERROR(receive_gather_level(layer, l, x, &kept));
    first = false;
  }
  return Status::ok();
}

// One level's reduce messages of one layer: the gradients of what each peer
// contributed at this level go back to it.
Status ExpertCommunicator::send_reduce_level(uint32_t step, int layer, int l, LevelExchange* x) {
  const std::vector<int> peers = topology_.ag_peers(rank_, l);
  const Tag tag{MessageKind::kExpertGrad, step, static_cast<uint16_t>(layer), 0, static_cast<uint32_t>(l)};
  for (int p : peers) x->slots.push_back(transport_->recv(p, tag));
  for (int p : peers) {
    std::vector<float> packed;
    EncodedTensor encoded;
    const auto t0 = std::chrono::steady_clock::now();
    ReconstructionError err;
    {
      std::lock_guard<std::mutex> lock(codec_mu_);
      XD_RETURN_IF_ERROR(
          grad_codecs_[l]->encode(grad_refs(layer, held_after(p, l)), &packed, &encoded, &err, nullptr, step)
              .with_context("expert gradient reduce"));
    }
    x->error += err.error;
    x->signal += err.signal;
    x->codec_s += seconds_since(t0);
    x->raw_bytes += double(packed.size() * sizeof(float));
    detail::WireMessage w = detail::wire_message(std::move(packed), std::move(encoded));
    x->sends.push_back(transport_->send(p, tag, w.frames, w.metadata, w.flags));
  }
  return Status::ok();
}

Status ExpertCommunicator::wait_owned_final(int layer) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!cv_.wait_for(lock, timeout_, [&] { return state_[layer].owned_final || stopping_; }))
    return Status::timeout("layer " + std::to_string(layer) + ": the owned experts' gradients were not final after " +
                           std::to_string(timeout_.count()) + " ms");
  if (!state_[layer].owned_final) return Status::unavailable("the expert communicator is stopping");
  return Status::ok();
}

Status ExpertCommunicator::receive_reduce_level(int layer, int l, LevelExchange* x,
                                                std::unique_ptr<detail::HeldBackGradients>* held_back) {
  // Every peer sends the gradients of this worker's held experts.
  const std::vector<ExpertTensorRef> mine = grad_refs(layer, held_after(rank_, l));
  // The messages kept arriving while the compute thread wrote the owned
  // gradients; added now, in peer order: the same sums as when nothing overlapped.
  if (!held_back) return receive_level(l, x, /*gather=*/false, [&](int) { return mine; });
  const std::vector<int> peers = topology_.ag_peers(rank_, l);
  *held_back = std::make_unique<detail::HeldBackGradients>(mine, grad_refs(layer, {rank_}), peers.size(),
                                                           expert_floats_);
  detail::HeldBackGradients& held = **held_back;
  return receive_level(l, x, /*gather=*/false, [&](int peer) {
    return held.refs_for(static_cast<size_t>(std::find(peers.begin(), peers.end(), peer) - peers.begin()));
  });
}

Status ExpertCommunicator::reduce_replicas(uint32_t step, int layer, const std::shared_ptr<LevelExchange>& first_sent,
                                           PendingReduce* pending) {
  bool first = true;
  for (int l = topology_.num_levels() - 1; l >= 0; --l) {
    if (topology_.ag_peers(rank_, l).empty()) continue;
    std::shared_ptr<LevelExchange> x = first ? first_sent : std::make_shared<LevelExchange>();
    if (!first) {
      // A trace shows when each outer level's gradients left (levels past the fourth are not named).
      static const char* const kSendNames[] = {"replica gradients out, level 0", "replica gradients out, level 1",
                                               "replica gradients out, level 2", "replica gradients out, level 3"};
      ScopedSpan span(l < 4 ? timeline_ : nullptr, l < 4 ? kSendNames[l] : "", layer, Lane::kExperts);
      XD_RETURN_IF_ERROR(send_reduce_level(step, layer, l, x.get()));
    }
    XD_RETURN_IF_ERROR(x->status);
    first = false;
    bool outer_after = false;
    for (int o = 0; o < l; ++o) outer_after = outer_after || !topology_.ag_peers(rank_, o).empty();
    if (!outer_after) {
      pending->last_level = l;
      pending->last = std::move(x);
      return Status::ok();
    }
    XD_RETURN_IF_ERROR(receive_reduce_level(layer, l, x.get(), &pending->held_back.emplace_back()));
  }
  return Status::ok();
}

Status ExpertCommunicator::reduce_owned(int layer, PendingReduce* pending) {
  XD_RETURN_IF_ERROR(wait_owned_final(layer));
  // Innermost first, then the outermost level: the simple schedule's order.
  for (const auto& held : pending->held_back) held->add_to_owned();
  if (!pending->last) return Status::ok();
  return receive_reduce_level(layer, pending->last_level, pending->last.get(), nullptr);
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
