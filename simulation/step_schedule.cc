#include "simulation/step_schedule.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <set>
#include <tuple>

#include "common/check.h"
#include "common/clock.h"
#include "common/timeline.h"
#include "model/expert_exchange.h"
#include "model/moe_transformer.h"
#include "model/param_layout.h"

namespace xd {

const char* comm_kind_name(CommKind k) {
  switch (k) {
    case CommKind::kDispatch: return "dispatch";
    case CommKind::kCombine: return "combine";
    case CommKind::kCombineBackward: return "combine backward";
    case CommKind::kDispatchBackward: return "dispatch backward";
    case CommKind::kExpertGather: return "expert all-gather";
    case CommKind::kReplicaGradients: return "replica gradients";
    case CommKind::kDenseBucket: return "dense bucket";
    case CommKind::kNormSum: return "norm sum";
  }
  return "?";
}

const char* compute_kind_name(ComputeKind k) {
  switch (k) {
    case ComputeKind::kAttentionA: return "attention (a)";
    case ComputeKind::kRouter: return "router";
    case ComputeKind::kAttentionB: return "attention (b)";
    case ComputeKind::kRoutedExperts: return "routed experts";
    case ComputeKind::kSharedExperts: return "shared experts";
    case ComputeKind::kHead: return "head";
    case ComputeKind::kHeadBackward: return "head backward";
    case ComputeKind::kOptimizer: return "optimizer";
    case ComputeKind::kOwnedExpertsWeightBackward: return "owned experts' weight gradients";
    case ComputeKind::kReplicaExpertsWeightBackward: return "replicas' weight gradients";
    case ComputeKind::kAttentionBackward: return "attention backward";
    case ComputeKind::kRouterBackward: return "router backward";
    case ComputeKind::kExpertsInputBackward: return "routed experts backward (inputs)";
    case ComputeKind::kExpertsWeightBackward: return "routed experts backward (weights)";
    case ComputeKind::kSharedBackward: return "shared experts backward";
  }
  return "?";
}

std::string StepSchedule::describe() const {
  std::string out;
  for (const StepOp& op : ops) {
    if (op.type == StepOp::Type::kCompute) {
      out += "compute " + std::string(compute_kind_name(op.compute));
    } else {
      const ScheduledComm& c = comms[op.comm];
      out += op.type == StepOp::Type::kStart ? "start   " : "wait    ";
      out += comm_kind_name(c.kind);
      // Appended piece by piece: GCC 12 warns falsely (-Wrestrict) on "lit" + std::to_string().
      if (c.kind == CommKind::kDenseBucket) {
        out += ' ';
        out += std::to_string(c.chunk);
      } else if (c.span > 1) {
        out += " chunks ";
        out += std::to_string(c.chunk);
        out += "..";
        out += std::to_string(c.chunk + c.span - 1);
      } else if (pipeline_degree > 1 && c.kind <= CommKind::kDispatchBackward) {
        out += " chunk ";
        out += std::to_string(c.chunk);
      }
    }
    if (op.layer >= 0) {
      out += " (layer ";
      out += std::to_string(op.layer);
      out += ')';
    }
    out += "\n";
  }
  return out;
}

namespace {

// One thing the miniature run did, stamped with steady_seconds(); spans come
// from the model's Timeline, the rest from the recording exchange and hooks.
struct Mark {
  double t = 0;
  int order = 0;  // ties: marks made later sort later
  enum Kind { kSpanBegin, kSpanEnd, kStart, kWait, kFinish } kind = kStart;  // kFinish: rows handed over, no wait
  const char* span = "";
  int layer = -1;
  int comm = -1;
};

class Recorder {
 public:
  Recorder(StepSchedule* s) : s_(s) {}
  int comm(CommKind kind, int layer, int chunk, int span = 1) {
    auto key = std::make_tuple((int)kind, layer, chunk);
    auto it = index_.find(key);
    if (it != index_.end()) return it->second;
    ScheduledComm c{kind, layer, chunk, 0, span};
    switch (kind) {
      case CommKind::kDispatch:
      case CommKind::kCombineBackward: c.stream = kToExpertsStream; break;
      case CommKind::kCombine:
      case CommKind::kDispatchBackward: c.stream = kToSourcesStream; break;
      case CommKind::kExpertGather:
      case CommKind::kReplicaGradients: c.stream = kExpertsStream; break;
      case CommKind::kDenseBucket: c.stream = kDenseStream + chunk % kDenseBucketThreads; break;
      case CommKind::kNormSum: c.stream = kNormStream; break;
    }
    s_->comms.push_back(c);
    return index_[key] = static_cast<int>(s_->comms.size()) - 1;
  }
  void mark(Mark::Kind kind, int comm, int layer) {
    marks_.push_back(Mark{steady_seconds(), next_++, kind, "", layer, comm});
  }
  void start(CommKind kind, int layer, int chunk, int span = 1) {
    mark(Mark::kStart, comm(kind, layer, chunk, span), layer);
  }
  void wait(CommKind kind, int layer, int chunk, int span = 1) {
    mark(Mark::kWait, comm(kind, layer, chunk, span), layer);
  }
  void finish(CommKind kind, int layer, int chunk, int span = 1) {
    mark(Mark::kFinish, comm(kind, layer, chunk, span), layer);
  }
  void span(const Span& sp) {
    marks_.push_back(Mark{sp.start_s, next_++, Mark::kSpanBegin, sp.name, sp.layer, -1});
    marks_.push_back(Mark{sp.end_s, next_++, Mark::kSpanEnd, sp.name, sp.layer, -1});
  }
  std::vector<Mark>& marks() { return marks_; }

 private:
  StepSchedule* s_;
  std::map<std::tuple<int, int, int>, int> index_;
  std::vector<Mark> marks_;
  int next_ = 0;
};

CommKind kind_of(int phase) {
  switch (static_cast<ExchangePhase>(phase)) {
    case ExchangePhase::kDispatch: return CommKind::kDispatch;
    case ExchangePhase::kCombine: return CommKind::kCombine;
    case ExchangePhase::kCombineBackward: return CommKind::kCombineBackward;
    case ExchangePhase::kDispatchBackward: return CommKind::kDispatchBackward;
  }
  return CommKind::kDispatch;
}

// The one-process exchange, recording every start and finish the model
// makes. Not overlapped, the runtime moves the rows inside start_* (inline on
// the compute thread), so the wait follows the start at once. Before a
// Dispatch's rows are handed over, the runtime waits for the layer's gathered
// experts (HybridExpertExchange::set_before_replicas).
class RecordingExchange final : public ExpertExchange<float> {
 public:
  RecordingExchange(int num_experts, Recorder* rec, bool overlapped, bool gathers)
      : inner_(num_experts), rec_(rec), overlapped_(overlapped), gathers_(gathers) {}
  void start_to_experts(const ExchangeTag& tag, std::vector<float> rows, const std::vector<int>& counts,
                        int width) override {
    started(tag);
    inner_.start_to_experts(tag, std::move(rows), counts, width);
  }
  void finish_to_experts(const ExchangeTag& tag, std::vector<float>* out, std::vector<int>* out_counts) override {
    // The runtime computes owned experts between the Dispatch and the wait
    // for the gathered ones; the recording keeps all of the routed experts'
    // compute after both (a little pessimistic where the gather is late).
    if (tag.phase == (int)ExchangePhase::kDispatch && gathers_ && gather_waited_.insert(tag.layer).second)
      rec_->wait(CommKind::kExpertGather, tag.layer, 0);
    finished(tag);
    inner_.finish_to_experts(tag, out, out_counts);
  }
  // The runtime sends the replica gradients before the owned experts'
  // weight gradients; the recording puts the start after the layer's whole
  // weight backward (the same pessimism).
  void replicas_backward_done(int layer) override {
    if (gathers_) rec_->start(CommKind::kReplicaGradients, layer, 0);
  }
  void start_to_sources(const ExchangeTag& tag, std::vector<float> rows, int width) override {
    started(tag);
    inner_.start_to_sources(tag, std::move(rows), width);
  }
  void finish_to_sources(const ExchangeTag& tag, std::vector<float>* out) override {
    finished(tag);
    inner_.finish_to_sources(tag, out);
  }
  const std::vector<int>& computed_experts() const override { return inner_.computed_experts(); }
  // With gathered experts, half of them stand for the replicas (a domain of
  // two): the model then orders its backward as the runtime's does.
  bool is_replica(size_t j) const override { return gathers_ && j >= computed_experts().size() / 2; }

 private:
  void started(const ExchangeTag& tag) {
    rec_->start(kind_of(tag.phase), tag.layer, tag.chunk, tag.span);
    if (!overlapped_) rec_->wait(kind_of(tag.phase), tag.layer, tag.chunk, tag.span);
  }
  void finished(const ExchangeTag& tag) {
    if (overlapped_) rec_->wait(kind_of(tag.phase), tag.layer, tag.chunk, tag.span);
    else rec_->finish(kind_of(tag.phase), tag.layer, tag.chunk, tag.span);
  }
  LocalExpertExchange<float> inner_;
  Recorder* rec_;
  bool overlapped_, gathers_;
  std::set<int> gather_waited_;
};

// The span names of MoeTransformer's forward and backward.
struct SpanRule {
  const char* name;
  ComputeKind at_begin;  // the span's compute, unless split below
  bool split_by_chunks;  // routed experts: compute after each chunk's events
  bool per_replica_send = false;  // late replica weights: a layer's compute before each layer's send
};
constexpr SpanRule kSpans[] = {
    {"attention (a)", ComputeKind::kAttentionA, false},
    {"router", ComputeKind::kRouter, false},
    {"attention (b)", ComputeKind::kAttentionB, false},
    {"routed experts", ComputeKind::kRoutedExperts, true},
    {"shared experts", ComputeKind::kSharedExperts, false},
    {"head", ComputeKind::kHead, false},
    {"head backward", ComputeKind::kHeadBackward, false},
    {"attention backward", ComputeKind::kAttentionBackward, false},
    {"router backward", ComputeKind::kRouterBackward, false},
    {"routed experts backward", ComputeKind::kExpertsInputBackward, true},
    {"shared experts backward", ComputeKind::kSharedBackward, false},
    {"owned experts' weight gradients", ComputeKind::kOwnedExpertsWeightBackward, false},
    {"replicas' weight gradients", ComputeKind::kReplicaExpertsWeightBackward, false, true},
};

ModelConfig miniature(const ModelConfig& m) {
  ModelConfig c = m;
  c.vocab_size = 16;
  c.num_heads = 2;
  c.num_kv_heads = m.num_kv_heads < m.num_heads ? 1 : 2;
  c.hidden_size = 8;
  c.num_experts = std::max(m.top_k, std::min(m.num_experts, 4));
  c.expert_intermediate_size = 8;
  c.shared_intermediate_size = 8;
  c.soft_moe_slots = std::min(m.soft_moe_slots, 2);
  c.router_dim = m.router_dim > 0 ? std::min(m.router_dim, 4) : 0;
  return c;
}

}  // namespace

Expected<StepSchedule> record_step_schedule(const ScheduleShape& shape) {
  if (shape.pipeline_degree < 1) return Status::invalid_argument("schedule: pipeline degree must be >= 1");
  const int backward_r = shape.backward_pipeline_degree > 0 ? shape.backward_pipeline_degree : shape.pipeline_degree;
  if (shape.pipeline_degree % backward_r != 0)
    return Status::invalid_argument("schedule: the backward pipeline degree must divide the forward one");
  const ModelConfig cfg = miniature(shape.model);
  XD_RETURN_IF_ERROR(cfg.validate().with_context("schedule: the model's miniature"));
  StepSchedule s;
  s.pipeline_degree = shape.pipeline_degree;
  s.backward_pipeline_degree = backward_r;
  s.overlapped = shape.overlapped;
  s.gathers_experts = shape.gathers_experts;
  s.defers_owned_expert_weights = shape.defers_owned_expert_weights && shape.gathers_experts;
  s.defers_replica_expert_weights = s.defers_owned_expert_weights && shape.defers_replica_expert_weights;
  s.defers_first_layer_expert_weights = shape.defers_owned_expert_weights && !shape.gathers_experts;
  Recorder rec(&s);
  const int L = cfg.num_layers;

  ParamLayout layout(cfg);
  MoeTransformer<float> model(layout);
  model.init(1);
  model.set_pipeline_degree(shape.pipeline_degree, backward_r);
  Timeline timeline;
  timeline.set_enabled(true);
  model.set_timeline(&timeline);
  const int buckets = static_cast<int>(dense_gradient_buckets(layout).size());
  // DistributedTrainer's hooks: overlapped, a dense bucket leaves when
  // backward has finished it (group -1: the embedding's, the last).
  MoeTransformer<float>::BackwardHooks hooks;
  hooks.defer_owned_expert_weights = shape.defers_owned_expert_weights;
  hooks.defer_replica_expert_weights = s.defers_replica_expert_weights;
  hooks.grads_ready = [&](int group) {
    if (shape.overlapped) rec.start(CommKind::kDenseBucket, -1, dense_bucket_of_group(L, group));
  };
  // Overlapped with no replicas, the norm's sum leaves once layer 0's
  // experts are done (DistributedTrainer::start_norm_sum).
  const bool norm_in_backward = shape.overlapped && !shape.gathers_experts;
  hooks.experts_done = [&](int layer) {
    if (layer == 0 && norm_in_backward) rec.start(CommKind::kNormSum, -1, 0);
  };
  model.set_backward_hooks(hooks);
  RecordingExchange exchange(cfg.num_experts, &rec, shape.overlapped, shape.gathers_experts);

  // The step: the all-gathers left at the end of the last step (after its
  // optimizer), so they lead this one.
  if (shape.gathers_experts)
    for (int l = 0; l < L; ++l) rec.start(CommKind::kExpertGather, l, 0);
  const int batch = 2, seq = std::min(16, cfg.max_seq_len);
  std::vector<int32_t> inputs(batch * seq), targets(batch * seq);
  for (size_t i = 0; i < inputs.size(); ++i) {
    inputs[i] = static_cast<int32_t>((i * 7 + 3) % cfg.vocab_size);
    targets[i] = static_cast<int32_t>((i * 5 + 1) % cfg.vocab_size);
  }
  model.zero_grad();
  model.forward(inputs.data(), targets.data(), batch, seq, &exchange);
  model.backward(&exchange);
  // reduce_dense_gradients: every replica gradient home; the norm's sum
  // starts (unless backward started it); simple, every bucket in order;
  // then all buckets done, then the norm's sum.
  if (shape.gathers_experts)
    for (int l = 0; l < L; ++l) rec.wait(CommKind::kReplicaGradients, l, 0);
  if (!norm_in_backward) rec.start(CommKind::kNormSum, -1, 0);
  for (int b = 0; b < buckets; ++b) {
    if (!shape.overlapped) rec.start(CommKind::kDenseBucket, -1, b);
    rec.wait(CommKind::kDenseBucket, -1, b);
  }
  rec.wait(CommKind::kNormSum, -1, 0);
  timeline.set_enabled(false);
  for (const Span& sp : timeline.take()) rec.span(sp);

  std::vector<Mark>& marks = rec.marks();
  std::stable_sort(marks.begin(), marks.end(), [](const Mark& a, const Mark& b) {
    return a.t != b.t ? a.t < b.t : a.order < b.order;
  });
  // The order is that of the clock: two marks at the same instant could be
  // either way round, so a clock that coarse is refused.
  for (size_t i = 1; i < marks.size(); ++i)
    if (marks[i].t == marks[i - 1].t)
      return Status::internal("schedule: two events of the miniature step share one clock reading; "
                              "the steady clock is too coarse to order them");
  const SpanRule* open = nullptr;
  int open_layer = -1;
  for (const Mark& m : marks) {
    switch (m.kind) {
      case Mark::kSpanBegin: {
        open = nullptr;
        for (const SpanRule& r : kSpans)
          if (std::strcmp(r.name, m.span) == 0) open = &r;
        XD_CHECK_MSG(open, "a model span the schedule does not know; add it to kSpans");
        open_layer = m.layer;
        if (!open->split_by_chunks && !open->per_replica_send)
          s.ops.push_back({StepOp::Type::kCompute, open->at_begin, -1, m.layer});
        break;
      }
      case Mark::kSpanEnd: open = nullptr; break;
      case Mark::kStart:
      case Mark::kWait:
      case Mark::kFinish: {
        // Late replica weights: each layer's, then that layer's send.
        if (open && open->per_replica_send && m.kind == Mark::kStart &&
            s.comms[m.comm].kind == CommKind::kReplicaGradients)
          s.ops.push_back({StepOp::Type::kCompute, open->at_begin, -1, m.layer});
        if (m.kind != Mark::kFinish)
          s.ops.push_back({m.kind == Mark::kStart ? StepOp::Type::kStart : StepOp::Type::kWait,
                           ComputeKind::kAttentionA, m.comm, m.layer});
        // Inside the routed experts: a chunk computes once its rows are
        // handed over (forward; backward, the input half), and backward
        // computes the weight half once the input gradients are on their way
        // back (not overlapped: once they are back).
        if (open && open->split_by_chunks) {
          const CommKind k = s.comms[m.comm].kind;
          const bool handed_over = m.kind == Mark::kFinish || (m.kind == Mark::kWait && shape.overlapped);
          const bool sent_back = m.kind == (shape.overlapped ? Mark::kStart : Mark::kWait);
          if (handed_over && k == CommKind::kDispatch)
            s.ops.push_back({StepOp::Type::kCompute, ComputeKind::kRoutedExperts, -1, open_layer});
          // A backward exchange of span s hands over s chunks' rows.
          for (int c = 0; c < s.comms[m.comm].span; ++c) {
            if (handed_over && k == CommKind::kCombineBackward)
              s.ops.push_back({StepOp::Type::kCompute, ComputeKind::kExpertsInputBackward, -1, open_layer});
            if (sent_back && k == CommKind::kDispatchBackward && !(s.defers_first_layer_expert_weights && open_layer == 0))
              s.ops.push_back({StepOp::Type::kCompute, ComputeKind::kExpertsWeightBackward, -1, open_layer});
          }
        }
        break;
      }
    }
  }
  // The optimizer's update, after the last wait (the trainer's order).
  s.ops.push_back({StepOp::Type::kCompute, ComputeKind::kOptimizer, -1, -1});
  return s;
}

}  // namespace xd
