#include "actors/distributed_trainer.h"

#include <sched.h>
#include <unistd.h>
#include <sys/resource.h>

#include <cmath>
#include <limits>

#include <algorithm>
#include <fstream>

#include "actors/detail/dense_all_reduce.h"
#include "actors/detail/gradient_buckets.h"
#include "common/clock.h"
#include "common/log.h"
#include "model/trainer.h"

namespace xd {

namespace {
double peak_rss_bytes() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return double(u.ru_maxrss) * 1024.0;
}

// The CPUs this process may run on (its affinity mask, as taskset or a
// Slurm allocation sets it); empty when the mask cannot be read.
std::vector<int> usable_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  std::vector<int> out;
  if (sched_getaffinity(0, sizeof set, &set) != 0) return out;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &set)) out.push_back(c);
  return out;
}

// This machine: the kernel's boot id, which every network namespace of it
// shares (emulated hosts are one machine), else its host name.
std::string machine_id() {
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::string id;
  if (in && std::getline(in, id) && !id.empty()) return id;
  char host[256] = "localhost";
  ::gethostname(host, sizeof host - 1);
  return host;
}
}  // namespace

DistributedTrainer::~DistributedTrainer() {
  if (transport_) transport_->set_timeline(nullptr);
}

Expected<std::unique_ptr<DistributedTrainer>> DistributedTrainer::create(const JobConfig& job,
                                                                         const DistributedOptions& o,
                                                                         Transport* transport) {
  std::unique_ptr<DistributedTrainer> t(new DistributedTrainer());
  t->job_ = job;
  t->opts_ = o;
  t->transport_ = transport;
  transport->set_timeline(&t->timeline_);
  const TrainConfig& tc = job.train;
  const ModelConfig& mc = tc.model;
  auto topo = Topology::create(o.level_sizes, o.domain_sizes);
  if (!topo) return topo.status();
  t->world_ = topo->world_size();
  t->cpus_ = usable_cpus();
  t->machine_ = machine_id();
  if (mc.num_experts % t->world_ != 0)
    return Status::invalid_argument("model.num_experts (" + std::to_string(mc.num_experts) +
                                    ") must be a multiple of the number of workers (" +
                                    std::to_string(t->world_) + ")");
  const int per_worker = mc.num_experts / t->world_;

  auto tokens = load_training_tokens(tc.data);
  if (!tokens) return tokens.status();
  const size_t held_out = held_out_tokens(tokens->size(), tc.data);
  auto train = std::make_shared<std::vector<int32_t>>(tokens->begin(), tokens->end() - held_out);
  XD_RETURN_IF_ERROR(BatchSampler::validate(train->size(), tc.batch_size, tc.seq_len, o.rank, t->world_));
  t->sampler_ = std::make_unique<BatchSampler>(train, tc.batch_size, tc.seq_len, tc.seed, o.rank, t->world_);

  t->layout_ = std::make_unique<ParamLayout>(mc, o.rank * per_worker, per_worker);
  t->model_ = std::make_unique<MoeTransformer<float>>(*t->layout_);
  t->model_->init(tc.seed);
  std::vector<std::pair<size_t, size_t>> no_decay;
  for (const TensorSlot& s : t->layout_->slots()) {
    if (s.shape.size() == 1) no_decay.emplace_back(s.offset, s.offset + s.numel());
    auto& ranges = s.is_routed_expert() ? t->expert_ranges_ : t->dense_ranges_;
    if (!ranges.empty() && ranges.back().second == s.offset) ranges.back().second += s.numel();
    else ranges.emplace_back(s.offset, s.offset + s.numel());
  }
  t->optimizer_ = std::make_unique<AdamW<float>>(t->layout_->size(), tc.optimizer, no_decay);

  // Hierarchical all-reduce of dense gradients: inside the innermost level
  // (fast links), then across the workers at the same inner position.
  const int L = topo->num_levels();
  t->inner_ = std::make_unique<Communicator>(transport, topo->level_group(o.rank, L - 1), o.timeout);
  std::vector<int> outer;
  for (int m = 0; m < t->world_; ++m)
    if (topo->coordinate(m, L - 1) == topo->coordinate(o.rank, L - 1)) outer.push_back(m);
  t->outer_ = std::make_unique<Communicator>(transport, outer, o.timeout);
  // bf16 on a stage when a link class it crosses asks for it: the inner
  // group's is the innermost level's, the outer group's all the others.
  detail::DenseWirePrecision precision;
  for (int l = 0; l < L; ++l)
    if (job.cluster.levels[l].link.codecs.dense_grad == "bf16")
      (l == L - 1 ? precision.inner_bf16 : precision.outer_bf16) = true;
  std::vector<detail::GradientBuckets::Ranges> buckets = dense_gradient_buckets(*t->layout_);
  const bool overlapped = tc.farskip.overlapped;
  t->buckets_ = std::make_unique<detail::GradientBuckets>(t->inner_.get(), t->outer_.get(), precision,
                                                          std::move(buckets), overlapped, &t->timeline_);
  // The coordinator resolves auto; a job run without one (tests) takes 1,
  // and a backward r that is not given follows the forward's.
  const int r = std::max(1, job.cluster.expert_parallel.pipeline_degree);
  const int rb = job.cluster.expert_parallel.backward_pipeline_degree;
  if (rb > 0 && r % rb != 0)
    return Status::invalid_argument("backward pipeline degree " + std::to_string(rb) +
                                    " does not divide the forward one, " + std::to_string(r));
  t->model_->set_pipeline_degree(r, rb > 0 ? rb : r);
  // auto without a coordinator (tests) stays off, as the replicas' early weight gradients do.
  t->model_->set_tokens_once_per_worker(job.cluster.expert_parallel.tokens_once_per_worker ==
                                        TokensOncePerWorker::kOn);
  t->model_->set_timeline(&t->timeline_);
  XD_RETURN_IF_ERROR(t->wire_experts(*topo));
  if (!o.resume_dir.empty()) XD_RETURN_IF_ERROR(t->resume(o.resume_dir));
  t->last_stats_ = transport->stats();
  if (t->traces(t->step_ + 1)) t->timeline_.set_enabled(true);
  t->comm_->start_gather(static_cast<uint32_t>(t->step_));
  return t;
}

// The exchange of token rows and the communicator of gathered experts for the
// domains of `topo`, wired into the model. The old ones, if any, must be idle
// (a step boundary, before the next step's gather starts); they stay in place
// when the new ones cannot be built.
Status DistributedTrainer::wire_experts(const Topology& topo) {
  const DistributedOptions& o = opts_;
  const ModelConfig& mc = job_.train.model;
  // Flat EP: one level of G workers, every owner one hop away.
  bool ep = true;
  for (int s : topo.domain_sizes()) ep = ep && s == 1;
  Topology exchange_topology = o.flat_ep && ep ? Topology({world_}, {1}) : topo;
  auto exchange = std::make_unique<HybridExpertExchange>(transport_, exchange_topology, mc.num_experts, o.timeout);
  // Token rows to each peer go through the codecs of the link class between
  // the two workers (cluster.levels[].link.codecs; raw by default).
  std::vector<CodecPipeline> to_experts, to_sources;
  for (int p = 0; p < world_; ++p) {
    const int level = link_level(o.level_sizes, o.rank, p);
    const LinkCodecs codecs = level < 0 ? LinkCodecs{} : job_.cluster.levels[level].link.codecs;
    auto d = CodecPipeline::parse(codecs.dispatch);
    auto c = CodecPipeline::parse(codecs.combine);
    if (!d) return d.status();
    if (!c) return c.status();
    to_experts.push_back(std::move(*d));
    to_sources.push_back(std::move(*c));
  }
  exchange->set_codecs(std::move(to_experts), std::move(to_sources));
  // Flat EP's one level spans every link class: its hops' imbalance is
  // measured per class, as a hierarchical exchange's is per level.
  std::vector<int> class_of_peer(world_);
  for (int p = 0; p < world_; ++p) class_of_peer[p] = link_level(o.level_sizes, o.rank, p);
  exchange->set_peer_link_classes(std::move(class_of_peer), static_cast<int>(o.level_sizes.size()));
  exchange->set_overlapped(job_.train.farskip.overlapped);
  exchange->set_timeline(&timeline_);
  auto comm = std::make_unique<ExpertCommunicator>(transport_, topo, model_.get(), o.timeout);
  ExpertCodecOptions codec_options;
  const int L = topo.num_levels();
  for (int l = 0; l < L; ++l) {
    const LinkCodecs& lc = job_.cluster.levels[l].link.codecs;
    auto g = ExpertCodecSpec::parse(lc.expert_gather);
    auto r = ExpertCodecSpec::parse(lc.expert_grad);
    if (!g) return g.status();
    if (!r) return r.status();
    // The SR base crosses a link class in bf16 where that class's AG codes
    // against it (the stages as in the dense all-reduce: inner = innermost).
    if (g->against_base) (l == L - 1 ? codec_options.base_inner_bf16 : codec_options.base_outer_bf16) = true;
    if (job_.cluster.base_as_signs(l, g->against_base)) codec_options.base_outer_sign = true;
    codec_options.gather.push_back(std::move(*g));
    codec_options.grad.push_back(std::move(*r));
  }
  codec_options.base_sync_every = job_.cluster.expert_parallel.base_sync_every;
  codec_options.fused_encode = job_.cluster.expert_parallel.fused_encode;
  codec_options.base_inner = inner_.get();
  codec_options.base_outer = outer_.get();
  XD_RETURN_IF_ERROR(comm->set_codecs(codec_options));
  if (o.memory_cap_bytes > 0 && comm->replica_bytes() > o.memory_cap_bytes)
    return Status::invalid_argument("gathered experts need " + std::to_string(comm->replica_bytes()) +
                                    " bytes, above the memory cap of " + std::to_string((size_t)o.memory_cap_bytes));
  // Built: rewire the model to the new pair, then let the old pair go.
  ExpertCommunicator* c = comm.get();
  model_->set_expert_resolver([c](int layer, int expert) { return c->replica(layer, expert); });
  c->set_timeline(&timeline_);
  exchange->set_before_replicas([c](int layer) { c->wait_gathered(layer); });
  exchange->set_replicas_landed([c](int layer) { return c->gathered(layer); });
  exchange->set_after_replica_grads([c, this](int layer) { c->start_reduce((uint32_t)step_, layer); });
  wire_backward_hooks(c);
  comm_ = std::move(comm);
  exchange_ = std::move(exchange);
  return Status::ok();
}

void DistributedTrainer::wire_backward_hooks(ExpertCommunicator* c) {
  const ModelConfig& mc = job_.train.model;
  MoeTransformer<float>::BackwardHooks hooks;
  // Overlapped, the owned experts' weight gradients run while the replicas'
  // and the last dense buckets cross the links, instead of before them
  // (without replicas, layer 0's: MoeTransformer::BackwardHooks). With
  // two levels of replicas (domains such as 2 x 2) an outer level's
  // gradients leave without them too: an inner level's share of the owned
  // experts' is held back until they are final (detail::HeldBackGradients).
  hooks.defer_owned_expert_weights = job_.train.farskip.overlapped;
  // (auto here: a job run without a coordinator takes early)
  hooks.defer_replica_expert_weights =
      job_.cluster.expert_parallel.replica_weight_gradients == ReplicaWeightGradients::kLate;
  const int layers = mc.num_layers;
  const bool norm_in_backward = !c->holds_replicas() && job_.train.farskip.overlapped;
  hooks.experts_done = [this, c, norm_in_backward](int layer) {
    c->owned_grads_final(layer);
    // Backward ends with layer 0; with no replicas nothing comes back to the
    // owned experts, so their norm is final now and its sum (a latency per
    // level) leaves beside the last dense buckets. (Layer 0's weight
    // gradients ran after the embedding's bucket left, hiding its flight: the
    // norm's sum, one small message a level, is the shorter wait.)
    if (layer == 0 && norm_in_backward) start_norm_sum();
  };
  hooks.grads_ready = [this, layers](int group) {
    // The expert norm goes apart (reduce_dense_gradients), so no bucket waits
    // for the replica gradients.
    buckets_->start((uint32_t)step_, dense_bucket_of_group(layers, group), model_->grads().data());
  };
  model_->set_backward_hooks(std::move(hooks));
}

Status DistributedTrainer::switch_plan(const PlanUpdate& plan) {
  auto topo = Topology::create(opts_.level_sizes, plan.domain_sizes);
  if (!topo) return topo.status().with_context("plan update");
  job_.cluster.expert_parallel.replica_weight_gradients =
      replica_weight_gradients_of(plan.replica_weights_late);
  if (rebuilds_experts(plan))
    XD_RETURN_IF_ERROR(wire_experts(*topo));
  else
    wire_backward_hooks(comm_.get());
  opts_.domain_sizes = plan.domain_sizes;
  opts_.predicted_step_s = plan.predicted_step_s;
  model_->set_pipeline_degree(plan.pipeline_degree, plan.backward_pipeline_degree);
  std::string domains;
  for (int s : plan.domain_sizes) {
    if (!domains.empty()) domains += 'x';
    domains += std::to_string(s);
  }
  XD_LOG_INFO("trainer",
              "rank %d: from step %lld, domains %s, r = %d, backward r = %d, replicas' weight gradients %s (%s)",
              opts_.rank, (long long)plan.step, domains.c_str(), plan.pipeline_degree, plan.backward_pipeline_degree,
              replica_weight_gradients_name(replica_weight_gradients_of(plan.replica_weights_late)), plan.reason.c_str());
  return Status::ok();
}

void DistributedTrainer::start_norm_sum() {
  if (norm_sum_started_) return;
  (void)norm_sum_handle_.wait();  // a step that failed may have left one behind; it writes norm_sum_
  const std::vector<float>& g = model_->grads();
  double local = 0;
  for (auto [b, e] : expert_ranges_)
    for (size_t i = b; i < e; ++i) local += (double)g[i] * g[i];
  // A non-finite local loss joins the sum as NaN, so every worker sees it.
  norm_sum_ = loss_finite_ ? local : std::numeric_limits<double>::quiet_NaN();
  norm_sum_handle_ = hierarchical_sum(inner_.get(), outer_.get(),
                                      CollectiveTag(static_cast<uint32_t>(step_), kNoLayer, kNormSumPhase), &norm_sum_);
  norm_sum_started_ = true;
}

Status DistributedTrainer::reduce_dense_gradients(double* expert_norm_sq) {
  // Replica gradients must have reached their owners before the owners'
  // gradients are scaled and their norm joins the all-reduce.
  XD_RETURN_IF_ERROR(comm_->wait_reduced());
  std::vector<float>& g = model_->grads();
  const uint32_t step = static_cast<uint32_t>(step_);
  // The norm's sum (one latency per level) runs beside the buckets: those in
  // flight already when overlapped, those reduced now when not.
  start_norm_sum();
  const float inv = 1.0f / world_;
  const Status buckets = buckets_->finish(step, g.data(), inv);
  // The buckets may be done before the norm (overlapped, they left while
  // backward ran): the rest of the norm's wait is exposed communication too.
  const double t0 = steady_seconds();
  const Status summed = norm_sum_handle_.wait();
  const double norm = norm_sum_;
  const double t1 = steady_seconds();
  norm_wait_s_ += t1 - t0;
  timeline_.add(Span{"wait norm sum", -1, Lane::kCompute, true, t0, t1});
  XD_RETURN_IF_ERROR(summed);
  XD_RETURN_IF_ERROR(buckets);
  for (auto [b, e] : expert_ranges_)
    for (size_t i = b; i < e; ++i) g[i] *= inv;
  *expert_norm_sq = norm * (double)inv * inv;
  return Status::ok();
}

Expected<StepMetrics> DistributedTrainer::step() {
  const TrainConfig& tc = job_.train;
  const auto start = std::chrono::steady_clock::now();
  const double cpu_start = process_cpu_seconds();
  const bool traced = traces(step_ + 1);
  timeline_.set_enabled(traced);
  exchange_->set_step(static_cast<uint32_t>(step_));
  // This worker's rows are rank * batch_size.. of the global batch, so the
  // routing noise is what one process draws for them.
  model_->set_routing_context(
      RoutingContext{true, tc.seed, sampler_->position(), static_cast<int64_t>(opts_.rank) * tc.batch_size});
  sampler_->next(&inputs_, &targets_);
  model_->zero_grad();
  comm_->zero_replica_grads();
  const LossStats loss = model_->forward(inputs_.data(), targets_.data(), tc.batch_size, tc.seq_len, exchange_.get());
  XD_RETURN_IF_ERROR(exchange_->status());
  XD_RETURN_IF_ERROR(comm_->status());
  if (!std::isfinite(loss.loss) && tc.nan_policy != "skip")
    return Status::internal("loss is " + std::to_string(loss.loss) + " at step " + std::to_string(step_ + 1) +
                            " on rank " + std::to_string(opts_.rank) + "; weights not finite: " +
                            non_finite_tensors(*layout_, model_->params().data()) + " (train.nan_policy: stop)");
  const TransportStats mid = transport_->stats();
  const double forward_s = seconds_since(start);
  // A plan update is taken here, before the optimizer step sends anything
  // for the next step: one that switches at the next step must be known
  // before it (the coordinator sends updates at least lead_seconds and 3
  // steps ahead; one that comes later than this fails the job below).
  if (opts_.take_plan)
    if (auto p = opts_.take_plan()) next_plan_ = std::move(*p);
  loss_finite_ = std::isfinite(loss.loss);
  norm_sum_started_ = false;
  model_->backward(exchange_.get());
  XD_RETURN_IF_ERROR(exchange_->status());
  double expert_norm_sq = 0;
  // A non-finite local loss joins the all-reduced norm as NaN, so that every
  // worker sees it and takes the same decision below.
  XD_RETURN_IF_ERROR(reduce_dense_gradients(&expert_norm_sq));
  // The step's traffic ends here: the update sends the next step's gathers.
  const TransportStats before_update = transport_->stats();
  double dense_norm_sq = 0;
  const std::vector<float>& g = model_->grads();
  for (auto [b, e] : dense_ranges_)
    for (size_t i = b; i < e; ++i) dense_norm_sq += (double)g[i] * g[i];
  const double norm_sq = dense_norm_sq + expert_norm_sq;
  const bool finite = std::isfinite(norm_sq);
  double optimizer_s = 0;
  if (!finite) {
    const std::string what = "step " + std::to_string(step_ + 1) + ": " +
                             (std::isfinite(loss.loss) ? ""
                                                       : "loss " + std::to_string(loss.loss) + " (weights not finite: " +
                                                             non_finite_tensors(*layout_, model_->params().data()) + "); ") +
                             "gradient norm not finite; on rank " + std::to_string(opts_.rank) + ": " +
                             non_finite_gradients();
    if (tc.nan_policy != "skip") return Status::internal(what + " (train.nan_policy: stop)");
    if (++skipped_in_a_row_ >= TrainConfig::kMaxSkippedInARow)
      return Status::internal(what + "; " + std::to_string(skipped_in_a_row_) + " steps in a row were not finite");
    XD_LOG_WARN("trainer", "skipped %s", what.c_str());
  } else {
    skipped_in_a_row_ = 0;
    const double lr = tc.learning_rate_at(step_);
    // A traced next step's trace begins with this update: its expert
    // all-gather leaves from inside it.
    if (!traced && traces(step_ + 2)) timeline_.set_enabled(true);
    ScopedSpan span(&timeline_, "optimizer");
    const double optimizer_t0 = steady_seconds();
    // The next step's first-level AG rows are packed, and each layer's sent,
    // as the update writes the weights (nothing when there is no next step,
    // or the next one runs other domains: the communicator is rebuilt).
    const bool switching = next_plan_ && next_plan_->step == step_ + 2 && rebuilds_experts(*next_plan_);
    const auto fused = step_ + 1 < tc.steps && !switching ? comm_->fused_encoder(static_cast<uint32_t>(step_ + 1))
                                                          : std::function<void(size_t, size_t)>{};
    optimizer_->step(model_->params().data(), model_->grads().data(), lr, norm_sq, fused);
    optimizer_s = steady_seconds() - optimizer_t0;
  }
  ++step_;
  if (traced) write_trace(step_);
  // Otherwise a traced step's trace begins with its all-gather's receives.
  if (traces(step_ + 1)) timeline_.set_enabled(true);

  exchange_->complete_sends();
  StepMetrics m;
  m.step = step_;
  m.skipped = !finite;
  m.loss = loss.loss;
  m.ce_loss = loss.ce_loss;
  m.aux_loss = loss.aux_loss;
  m.step_s = seconds_since(start);
  m.tokens_per_s = tc.batch_size * tc.seq_len / m.step_s;
  gather_wait_ = comm_->take_gather_wait_seconds();
  m.gather_wait_s = gather_wait_;
  double gather_wait = 0;
  for (double w : gather_wait_) gather_wait += w;
  const std::array<double, 2> blocked = exchange_->take_blocked_seconds();
  const double replica_wait = comm_->take_reduce_wait_seconds(), bucket_wait = buckets_->take_wait_seconds();
  m.fwd_exposed_s = std::min(forward_s, blocked[0] + gather_wait);
  m.bwd_exposed_s = blocked[1] + replica_wait + bucket_wait + norm_wait_s_;
  m.waits_s = {{step_waits::kForwardTokenExchange, blocked[0]},
               {step_waits::kForwardExpertAllGather, gather_wait},
               {step_waits::kBackwardTokenExchange, blocked[1]},
               {step_waits::kBackwardReplicaGradients, replica_wait},
               {step_waits::kBackwardDenseAllReduce, bucket_wait},
               {step_waits::kBackwardGradientNorm, norm_wait_s_}};
  norm_wait_s_ = 0;
  m.exposed_comm_s = m.fwd_exposed_s + m.bwd_exposed_s;
  m.compute_s = std::max(0.0, m.step_s - m.exposed_comm_s);
  const auto [fwd_busy, bwd_busy] = record_link_figures(mid, before_update, &m);
  StepPhases phases;
  phases.previous_optimizer_s = last_optimizer_s_;
  phases.forward_compute_s = std::max(0.0, forward_s - m.fwd_exposed_s);
  phases.forward_link_s = fwd_busy;
  phases.backward_compute_s = std::max(0.0, m.compute_s - phases.forward_compute_s);
  phases.optimizer_s = optimizer_s;
  phases.backward_link_s = bwd_busy;
  m.phase_floor_s = phase_floor_seconds(phases);
  m.fwd_compute_s = phases.forward_compute_s;
  m.bwd_compute_s = phases.backward_compute_s;
  last_optimizer_s_ = optimizer_s;
  m.predicted_step_s = opts_.predicted_step_s;
  m.peak_rss_bytes = peak_rss_bytes();
  // Over the step's own window, as step_s (a checkpoint written between steps is not in it).
  m.cpu_s = std::max(0.0, process_cpu_seconds() - cpu_start);
  m.cpus = cpus_;
  m.machine = machine_;
  // A new plan takes effect at this boundary: the next step's replicas have
  // not started moving yet. Every worker switches at the same step.
  if (next_plan_ && next_plan_->step <= step_)
    return Status::internal("a plan update for step " + std::to_string(next_plan_->step) + " arrived after step " +
                            std::to_string(step_) + "; the workers would disagree on the domains");
  if (next_plan_ && next_plan_->step == step_ + 1) {
    XD_RETURN_IF_ERROR(switch_plan(*next_plan_));
    next_plan_.reset();
  }
  // The next step's replicas start moving now; after the last step there is
  // nothing to gather for.
  if (step_ < tc.steps) comm_->start_gather(static_cast<uint32_t>(step_));
  return m;
}

}  // namespace xd
