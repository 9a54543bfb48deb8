// ExpertCommunicator's gradient reduce (expert_communicator.h): the
// replicas' weight gradients go back to their owners level by level, from
// the innermost, and are added to the owned experts' gradients in a fixed
// order once those are final.
#include <algorithm>
#include <chrono>
#include <future>

#include "actors/detail/expert_wire_codec.h"
#include "actors/detail/held_back_gradients.h"
#include "actors/detail/work_thread.h"
#include "actors/expert_communicator.h"
#include "common/clock.h"

namespace xd {

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

// One level's reduce messages of one layer: the gradients of what each peer
// contributed at this level go back to it.
Status ExpertCommunicator::send_reduce_level(uint32_t step, int layer, int l, LevelExchange* x) {
  const std::vector<int> peers = topology_.ag_peers(rank_, l);
  const Tag tag{MessageKind::kExpertGrad, step, static_cast<uint16_t>(layer), 0, static_cast<uint32_t>(l)};
  for (int p : peers) x->slots.push_back(transport_->recv(p, tag));
  for (int p : peers) {
    std::vector<float> packed;
    EncodedTensor encoded;
    const double t0 = thread_cpu_seconds();
    ReconstructionError err;
    {
      std::lock_guard<std::mutex> lock(codec_mu_);
      XD_RETURN_IF_ERROR(
          grad_codecs_[l]->encode(grad_refs(layer, held_after(p, l)), &packed, &encoded, &err, nullptr, step)
              .with_context("expert gradient reduce"));
    }
    x->error += err.error;
    x->signal += err.signal;
    x->codec.encode += thread_cpu_seconds() - t0;
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

}  // namespace xd
