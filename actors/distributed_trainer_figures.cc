// DistributedTrainer's figures of a step (distributed_trainer.h): the
// bytes each link class carried, per traffic kind and before any codec, the
// codecs' time and error per link class and traffic kind, and the busiest
// link's transmit time in each direction; and the phase floor they are
// judged against.
#include <algorithm>
#include <array>
#include <map>
#include <string>

#include "actors/distributed_trainer.h"
#include "actors/detail/gradient_buckets.h"

namespace xd {

double phase_floor_seconds(const StepPhases& p) {
  const double window1 = std::max(p.previous_optimizer_s + p.forward_compute_s, p.forward_link_s);
  const double window2 = std::max(p.backward_compute_s - p.optimizer_s, p.backward_link_s);
  const double by_phase = window1 + window2 - p.previous_optimizer_s + p.optimizer_s;
  const double bound = std::max(p.forward_compute_s + p.backward_compute_s, p.forward_link_s + p.backward_link_s);
  return std::max(by_phase, bound);
}

void DistributedTrainer::record_codec_figures(StepMetrics* m) {
  // Per "link class/traffic" (the codec config's keys): the codecs' CPU
  // time, encoding and decoding apart, and the reconstruction error and
  // signal of the lossy ones.
  struct Figures {
    CodecSeconds seconds;
    double error = 0, signal = 0;
  };
  std::map<std::string, Figures> figures;
  auto add = [&](int level, const char* traffic, CodecSeconds seconds, double error, double signal) {
    Figures& f = figures[opts_.link_names[level] + "/" + traffic];
    f.seconds += seconds, f.error += error, f.signal += signal;
  };
  // Expert tensors: before any codec, and what the codecs cost and lost.
  const std::vector<ExpertCodecFigures> expert = comm_->take_codec_figures();
  for (size_t l = 0; l < expert.size(); ++l) {
    const std::string& name = opts_.link_names[l];
    const ExpertCodecFigures& f = expert[l];
    if (f.gather_raw_bytes > 0) m->bytes[name + "/expert_gather_raw"] += f.gather_raw_bytes;
    if (f.grad_raw_bytes > 0) m->bytes[name + "/expert_grad_raw"] += f.grad_raw_bytes;
    add(l, "expert_gather", f.gather_codec, f.gather_error, f.gather_signal);
    add(l, "expert_grad", f.grad_codec, f.grad_error, f.grad_signal);
    add(l, "expert_base", f.base_codec, f.base_error, f.base_signal);
  }
  // The dense gradients before the bf16 cast: the same messages in fp32.
  // The innermost level is the inner stage's, the others the outer's; a
  // bf16 stage's reduce-scatter and all-gather both carry them. The outer
  // stage's casts count at the outermost level.
  const size_t levels = opts_.link_names.size();
  for (size_t l = 0; l < levels; ++l) {
    const bool bf16 = l + 1 == levels ? buckets_->precision().inner_bf16 : buckets_->precision().outer_bf16;
    for (const char* op : {"/all_reduce", "/reduce_scatter"}) {
      const auto wire = m->bytes.find(opts_.link_names[l] + op);
      if (bf16 && wire != m->bytes.end()) m->bytes[wire->first + "_raw"] = 2 * wire->second;
    }
  }
  const detail::CastFigures dense = buckets_->take_cast_figures();
  add((int)levels - 1, "dense_grad", dense.inner.seconds, dense.inner.error, dense.inner.signal);
  add(0, "dense_grad", dense.outer.seconds, dense.outer.error, dense.outer.signal);
  // The token rows before any codec, beside what crossed each link class.
  const std::vector<TokenCodecFigures> tokens = exchange_->take_token_figures();
  for (int p = 0; p < world_; ++p) {
    const int level = link_level(opts_.level_sizes, opts_.rank, p);
    const TokenCodecFigures& t = tokens[p];
    if (level < 0) continue;
    add(level, "dispatch", t.codec[0], t.error[0], t.signal[0]);
    add(level, "combine", t.codec[1], t.error[1], t.signal[1]);
    if (t.raw_bytes[0] == 0 && t.raw_bytes[1] == 0) continue;
    const std::string& name = opts_.link_names[level];
    m->bytes[name + "/moe_dispatch_raw"] += t.raw_bytes[0];
    m->bytes[name + "/moe_combine_raw"] += t.raw_bytes[1];
  }
  m->codec_s = 0;
  for (const auto& [key, f] : figures) {
    if (f.seconds.total() > 0) {
      m->codec_encode_seconds[key] = f.seconds.encode;
      m->codec_decode_seconds[key] = f.seconds.decode;
    }
    if (f.signal > 0) m->nmse[key] = f.error / f.signal;
    m->codec_s += f.seconds.total();
  }
}

std::pair<double, double> DistributedTrainer::record_link_figures(const TransportStats& mid, TransportStats now,
                                                                  StepMetrics* m) {
  std::map<int, const LinkStats*> before;
  for (const LinkStats& l : last_stats_.links) before[l.peer] = &l;
  for (const LinkStats& l : now.links) {
    const LinkStats* prev = before.count(l.peer) ? before[l.peer] : nullptr;
    const std::string name = l.link_class < (int)opts_.link_names.size() ? opts_.link_names[l.link_class]
                                                                         : std::to_string(l.link_class);
    // This step's bytes sent, per "link class/operation" and per link class.
    m->bytes[name + "/total"] += double(l.bytes_sent) - (prev ? prev->bytes_sent : 0.0);
    for (int k = 0; k < kMaxMessageKind; ++k) {
      const double d = double(l.bytes_sent_by_kind[k]) - (prev ? prev->bytes_sent_by_kind[k] : 0.0);
      if (d > 0) m->bytes[name + "/" + message_kind_name(static_cast<MessageKind>(k))] += d;
    }
  }
  record_codec_figures(m);
  // Each hop as long as its larger side: over the rows sent, the routing's
  // imbalance on that link class (xdmoe simulate --a2a-imbalance).
  const std::vector<double> peak = exchange_->take_peak_bytes();
  for (size_t l = 0; l < peak.size() && l < opts_.link_names.size(); ++l)
    if (peak[l] > 0) m->bytes[opts_.link_names[l] + "/moe_peak_raw"] += peak[l];
  // The busiest link class's transmit time, over the step and over its
  // forward (until backward began) and backward parts.
  auto at = [](const TransportStats& s, size_t c) {
    return c < s.class_transmit_seconds.size() ? s.class_transmit_seconds[c] : 0.0;
  };
  double fwd_busy = 0, bwd_busy = 0;
  for (size_t c = 0; c < now.class_transmit_seconds.size(); ++c) {
    m->link_busy_s = std::max(m->link_busy_s, at(now, c) - at(last_stats_, c));
    fwd_busy = std::max(fwd_busy, at(mid, c) - at(last_stats_, c));
    bwd_busy = std::max(bwd_busy, at(now, c) - at(mid, c));
  }
  for (size_t c = 0; c < now.class_bursts.size() && c < opts_.link_names.size(); ++c) {
    const std::array<double, 3> zero{}, &prev = c < last_stats_.class_bursts.size() ? last_stats_.class_bursts[c] : zero;
    const std::array<double, 3>& cur = now.class_bursts[c];
    if (cur[0] > prev[0]) m->link_bursts[opts_.link_names[c]] = {cur[0] - prev[0], cur[1] - prev[1], cur[2] - prev[2]};
  }
  // Communication time, as for each direction: the busiest link class's
  // transmit time, at least what was exposed. (Summing each peer's in-flight
  // time instead counted concurrent links and latency several times over:
  // more communication than the step was long.)
  m->comm_s = std::max(m->link_busy_s, m->exposed_comm_s);
  m->fwd_comm_s = std::max(fwd_busy, m->fwd_exposed_s);
  m->bwd_comm_s = std::max(bwd_busy, m->bwd_exposed_s);
  last_stats_ = std::move(now);
  return {fwd_busy, bwd_busy};
}

}  // namespace xd
