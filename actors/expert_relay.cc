// The all-gather's relays (ExpertCommunicator::Relayed). A replica that
// crossed a lossy level (the SR codec on the inter-DC link) used to be
// passed on inside its DC as the floats it decoded to, raw: a relay passes
// on the message itself, a fraction of those bytes, and every receiver
// decodes it with the lossy level's codec. The receivers of one message
// hold the same codec state (every message of a stream reaches each of them
// in the same order, from the same start), so they rebuild the same bits
// as the worker that relays it, which is what the raw floats gave them.
#include <algorithm>
#include <chrono>
#include <string>

#include "actors/detail/expert_wire_codec.h"
#include "actors/expert_communicator.h"
#include "common/check.h"
#include "common/clock.h"

namespace xd {

namespace {

// A relayed message's tag: the expert gather's kind, step and layer, phase 1,
// and in the chunk the level it is relayed at, the level it was first sent
// at and its first sender.
Tag relay_tag(uint32_t step, int layer, int level, int first_level, int first_sender) {
  XD_CHECK(level < 16 && first_level < 16 && first_sender < (1 << 24));  // as the exchange's chunk field
  return Tag{MessageKind::kExpertGather, step, static_cast<uint16_t>(layer), 1,
             static_cast<uint32_t>(level + 16 * (first_level + 16 * first_sender))};
}

}  // namespace

std::vector<std::pair<int, int>> ExpertCommunicator::relay_origins(int m, int level) const {
  std::vector<std::pair<int, int>> out;
  if (!gather_codecs_[level]->is_raw()) return out;
  for (int l = 0; l < level; ++l) {
    const std::vector<int> peers = topology_.ag_peers(m, l);
    if (!gather_codecs_[l]->is_exact()) {  // an exact level's replicas go on as floats
      for (int q : peers) out.emplace_back(l, q);
    } else {
      for (int p : peers)
        for (const auto& o : relay_origins(p, l)) out.push_back(o);
    }
  }
  return out;
}

std::vector<int> ExpertCommunicator::own_message_workers(int m, int level) const {
  std::vector<int> relayed(topology_.world_size(), 0);
  for (const auto& [l, q] : relay_origins(m, level))
    for (int w : held_after(q, l)) relayed[w] = 1;
  std::vector<int> out;
  for (int w : held_after(m, level))
    if (!relayed[w]) out.push_back(w);
  return out;
}

void ExpertCommunicator::plan_relays() {
  relay_levels_.assign(topology_.num_levels(), RelayLevel{});
  for (int l = 0; l < topology_.num_levels(); ++l) {
    RelayLevel& r = relay_levels_[l];
    r.relays = !topology_.ag_peers(rank_, l).empty() && !relay_origins(rank_, l).empty();
    if (!r.relays) continue;
    r.own = own_message_workers(rank_, l);
    for (int p : topology_.ag_peers(rank_, l)) {
      r.peer_own.push_back(own_message_workers(p, l));
      std::vector<RelaySource>& from = r.peer_relayed.emplace_back();
      for (const auto& [level, origin] : relay_origins(p, l))
        from.push_back({level, origin, held_after(origin, level)});
    }
  }
}

Status ExpertCommunicator::relay_gather_level(uint32_t step, int layer, int l, std::vector<Relayed>* kept) {
  const RelayLevel& route = relay_levels_[l];
  const std::vector<int> peers = topology_.ag_peers(rank_, l);
  std::vector<std::vector<std::shared_ptr<RecvSlot>>> relayed_in(peers.size());
  for (size_t i = 0; i < peers.size(); ++i)
    for (const RelaySource& from : route.peer_relayed[i])
      relayed_in[i].push_back(transport_->recv(peers[i], relay_tag(step, layer, l, from.level, from.origin)));
  // This worker's own message (its experts, and any replicas it took raw).
  LevelExchange x;
  XD_RETURN_IF_ERROR(send_gather_level(step, layer, l, &x, nullptr, &route.own));
  // The kept messages, as they arrived; their frames live while the sends need them.
  for (const Relayed& r : *kept) {
    const std::vector<OutFrame> frames{
        OutFrame{r.message->tensor_data(0), r.message->tensor_size(0), std::shared_ptr<const void>(r.message)}};
    const std::string metadata(static_cast<const char*>(r.message->meta_data()), r.message->meta_size());
    for (int p : peers)
      x.sends.push_back(transport_->send(p, relay_tag(step, layer, l, r.level, r.origin), frames, metadata,
                                         r.message->header().flags));
    x.raw_bytes += double(r.tensors * expert_floats_ * sizeof(float)) * peers.size();
  }
  // What the peers relay, decoded as at the level it was first sent at.
  std::vector<double> relay_codec_s(figures_.size(), 0.0);  // per level first sent at
  for (size_t i = 0; i < peers.size(); ++i)
    for (size_t k = 0; k < route.peer_relayed[i].size(); ++k) {
      const RelaySource& source = route.peer_relayed[i][k];
      auto msg = relayed_in[i][k]->wait(timeout_);
      const std::string from = "expert all-gather relayed by rank " + std::to_string(peers[i]) + " from rank " +
                               std::to_string(source.origin);
      if (!msg) return msg.status().with_context(from);
      const std::vector<ExpertTensorRef> refs = gather_refs(layer, source.workers);
      const double t0 = thread_cpu_seconds();
      {
        std::lock_guard<std::mutex> lock(codec_mu_);
        XD_RETURN_IF_ERROR(
            detail::receive_message(*gather_codecs_[source.level], refs, *msg).with_context(from));
      }
      relay_codec_s[source.level] += thread_cpu_seconds() - t0;
      kept->push_back({source.level, source.origin, refs.size(), std::make_shared<IncomingMessage>(std::move(*msg))});
    }
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t at = 0; at < relay_codec_s.size(); ++at) figures_[at].gather_codec.decode += relay_codec_s[at];
  }
  // The peers' own messages, then the sends; the level's figures.
  return receive_level(l, &x, /*gather=*/true, [&](int peer) {
    return gather_refs(layer, route.peer_own[std::find(peers.begin(), peers.end(), peer) - peers.begin()]);
  });
}

}  // namespace xd
