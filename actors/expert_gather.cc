// ExpertCommunicator's all-gather (expert_communicator.h): the messages
// that carry each layer's experts to the workers that compute with them,
// packed and encoded while the optimizer step writes the weights where the
// codec allows, sent level by level, and rebuilt into the replicas.
#include <algorithm>
#include <chrono>
#include <future>

#include "actors/detail/expert_wire_codec.h"
#include "actors/detail/work_thread.h"
#include "actors/expert_communicator.h"
#include "common/check.h"
#include "common/clock.h"

namespace xd {

struct ExpertCommunicator::PackedRows {
  std::vector<float> packed;  // the message's rows: (experts per worker, 3, ff*d)
  PackSums sums;
};

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
  return [this, blocks = std::move(blocks), codec, level, prep = &prepared_](size_t begin, size_t end) {
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
          const double t0 = thread_cpu_seconds();
          PackedRows& rows = *prep->rows[b.layer];
          const ExpertTensorRef ref{tensor_key(b.layer, expert, b.which), weights_of(b.layer, expert, b.which),
                                    base_of(b.layer, b.which)};
          {
            std::lock_guard<std::mutex> lock(codec_mu_);
            codec->pack(ref, k, count, &rows.packed[((size_t)j * 3 + b.which) * n + k], &rows.sums);
          }
          pack_s += thread_cpu_seconds() - t0;
        }
        at += count;
      }
    }
    if (pack_s > 0) {
      std::lock_guard<std::mutex> lock(mu_);
      figures_[level].gather_codec.encode += pack_s;
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
  const double t0 = steady_seconds();
  std::unique_lock<std::mutex> lock(mu_);
  if (state_[layer].gathered) return;
  cv_.wait(lock, [&] { return state_[layer].gathered; });
  const double t1 = steady_seconds();
  gather_wait_[layer] += t1 - t0;
  if (timeline_) timeline_->add(Span{"wait expert all-gather", layer, Lane::kCompute, true, t0, t1});
}

Status ExpertCommunicator::send_gather_level(uint32_t step, int layer, int l, LevelExchange* x, PackedRows* rows,
                                             const std::vector<int>* workers) {
  const std::vector<int> peers = topology_.ag_peers(rank_, l);
  const Tag tag{MessageKind::kExpertGather, step, static_cast<uint16_t>(layer), 0, static_cast<uint32_t>(l)};
  for (int p : peers) x->slots.push_back(transport_->recv(p, tag));
  const std::vector<ExpertTensorRef> mine = gather_refs(layer, workers ? *workers : held_after(rank_, l));
  std::vector<float> packed;
  if (rows) {
    packed.swap(rows->packed);
    ++fused_messages_;
  }
  EncodedTensor encoded;
  const double t0 = thread_cpu_seconds();
  ReconstructionError err;
  {
    std::lock_guard<std::mutex> lock(codec_mu_);
    XD_RETURN_IF_ERROR(gather_codecs_[l]->encode(mine, &packed, &encoded, &err, rows ? &rows->sums : nullptr, step)
                           .with_context("expert all-gather"));
  }
  x->error += err.error;
  x->signal += err.signal;
  x->codec.encode += thread_cpu_seconds() - t0;
  x->raw_bytes += double(packed.size() * sizeof(float)) * peers.size();
  detail::WireMessage w = detail::wire_message(std::move(packed), std::move(encoded));
  for (int p : peers) x->sends.push_back(transport_->send(p, tag, w.frames, w.metadata, w.flags));
  return Status::ok();
}

Status ExpertCommunicator::receive_gather_level(int layer, int l, LevelExchange* x, std::vector<Relayed>* kept) {
  return receive_level(
      l, x, /*gather=*/true, [&](int peer) { return gather_refs(layer, held_after(peer, l)); },
      gather_codecs_[l]->is_exact() ? nullptr : kept);
}

Status ExpertCommunicator::gather_layer(uint32_t step, int layer, LevelExchange* first_sent, PackedRows* rows) {
  XD_RETURN_IF_ERROR(base_status_);
  bool first = true;
  // What crossed lossy levels, kept for the raw levels inside them that relay it.
  std::vector<Relayed> kept;
  const bool relays =
      std::any_of(relay_levels_.begin(), relay_levels_.end(), [](const RelayLevel& r) { return r.relays; });
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
    XD_RETURN_IF_ERROR(receive_gather_level(layer, l, x, relays ? &kept : nullptr));
    first = false;
  }
  return Status::ok();
}

}  // namespace xd
