#include "coordinator/routing_probe.h"

#include <algorithm>
#include <memory>
#include <string>

#include "common/clock.h"
#include "model/batch_sampler.h"
#include "model/expert_exchange.h"
#include "model/moe_transformer.h"
#include "model/param_layout.h"
#include "model/trainer.h"

namespace xd {

Expected<RoutingProbe> probe_routing(const JobConfig& job, const RoutingProbeOptions& options) {
  const double t0 = steady_seconds();
  const TrainConfig& tc = job.train;
  const ModelConfig& mc = tc.model;
  const int world = job.cluster.world_size();
  ParamLayout layout(mc);
  const double param_bytes = double(layout.size()) * sizeof(float);
  if (param_bytes > options.max_param_bytes)
    return Status::unavailable("the whole model (" + std::to_string(static_cast<long long>(param_bytes / 1e6)) +
                               " MB) is larger than the routing probe holds (" +
                               std::to_string(static_cast<long long>(options.max_param_bytes / 1e6)) + " MB)");
  auto tokens = load_training_tokens(tc.data);
  if (!tokens) return tokens.status().with_context("the routing probe reads the training data");
  const size_t held_out = held_out_tokens(tokens->size(), tc.data);
  auto train = std::make_shared<std::vector<int32_t>>(tokens->begin(), tokens->end() - held_out);
  XD_RETURN_IF_ERROR(BatchSampler::validate(train->size(), tc.batch_size, tc.seq_len, 0, world)
                         .with_context("the routing probe"));
  // The first sequences of each worker's first batch: the routing of a
  // sequence does not depend on the others in its batch. Every worker gets
  // as many, or the counts would be uneven by the sample alone.
  const long long per_worker = std::max<long long>(1, options.max_tokens / world);
  int sequences = static_cast<int>(std::clamp<long long>(per_worker / tc.seq_len, 1, tc.batch_size));

  MoeTransformer<float> net(layout);
  net.init(tc.seed);
  std::vector<int32_t> inputs, targets;
  if (options.max_seconds > 0 && sequences > 1) {
    // One sequence first, timed, so that a large model routes fewer of them.
    BatchSampler sampler(train, tc.batch_size, tc.seq_len, tc.seed, 0, world);
    sampler.next(&inputs, &targets);
    const double s0 = steady_seconds();
    net.forward(inputs.data(), targets.data(), 1, tc.seq_len);
    const double per_sequence = std::max(1e-9, steady_seconds() - s0);
    const double fit = std::clamp(options.max_seconds / (per_sequence * world), 1.0, double(sequences));
    sequences = static_cast<int>(fit);
  }
  RoutingProbe probe;
  probe.workers = world;
  probe.layers = mc.num_layers;
  probe.experts = mc.num_experts;
  probe.tokens_per_worker = static_cast<long long>(sequences) * tc.seq_len;
  probe.rows.assign(static_cast<size_t>(world) * mc.num_layers * mc.num_experts, 0);
  for (int rank = 0; rank < world; ++rank) {
    BatchSampler sampler(train, tc.batch_size, tc.seq_len, tc.seed, rank, world);
    // The routing context of the worker's first step (DistributedTrainer's).
    net.set_routing_context(
        RoutingContext{true, tc.seed, sampler.position(), static_cast<int64_t>(rank) * tc.batch_size});
    sampler.next(&inputs, &targets);
    // Every expert in process, as one process has them; each Dispatch's
    // counts are the rows this worker's tokens send each expert.
    LocalExpertExchange<float> local(mc.num_experts);
    long long* rows = &probe.rows[static_cast<size_t>(rank) * mc.num_layers * mc.num_experts];
    const size_t experts = mc.num_experts;
    local.set_observer([rows, experts](const ExchangeTag& tag, const std::vector<float>&,
                                       const std::vector<int>& counts) {
      if (tag.phase != static_cast<int>(ExchangePhase::kDispatch)) return;
      XD_CHECK(counts.size() == experts);  // a Dispatch is one chunk's
      for (size_t e = 0; e < experts; ++e) rows[static_cast<size_t>(tag.layer) * experts + e] += counts[e];
    });
    net.forward(inputs.data(), targets.data(), sequences, tc.seq_len, &local);
  }
  probe.seconds = steady_seconds() - t0;
  return probe;
}

namespace {

// One layer's rows through the Dispatch hops of `topology`: `at` holds the
// rows of (worker, expert) its tokens send and ends holding those each
// worker's experts compute; `hop(l, out, in)` sees each level's rows sent
// and received per worker.
template <class Hop>
void dispatch_layer(const RoutingProbe& probe, const Topology& topology, int layer, std::vector<long long>* at,
                    Hop hop) {
  const int world = probe.workers, levels = topology.num_levels(), experts = probe.experts;
  const int per_worker = experts / world;
  XD_CHECK(topology.world_size() == world);
  XD_CHECK(per_worker > 0 && per_worker * world == experts);
  at->assign(static_cast<size_t>(world) * experts, 0);
  for (int m = 0; m < world; ++m)
    for (int e = 0; e < experts; ++e) (*at)[static_cast<size_t>(m) * experts + e] = probe.at(m, layer, e);
  std::vector<long long> next(at->size()), out(world), in(world);
  for (int l = 0; l < levels; ++l) {
    std::fill(next.begin(), next.end(), 0);
    std::fill(out.begin(), out.end(), 0);
    std::fill(in.begin(), in.end(), 0);
    for (int m = 0; m < world; ++m)
      for (int e = 0; e < experts; ++e) {
        const long long rows = (*at)[static_cast<size_t>(m) * experts + e];
        if (rows == 0) continue;
        const int to = topology.with_coordinate(m, l, topology.dispatch_coordinate(m, l, e / per_worker));
        next[static_cast<size_t>(to) * experts + e] += rows;
        if (to != m) out[m] += rows, in[to] += rows;
      }
    hop(l, out, in);
    at->swap(next);
  }
}

}  // namespace

std::vector<double> routed_a2a_imbalance(const RoutingProbe& probe, const Topology& topology) {
  const int levels = topology.num_levels();
  std::vector<double> peak(levels, 0.0), sent(levels, 0.0);
  std::vector<long long> at;
  for (int layer = 0; layer < probe.layers; ++layer)
    dispatch_layer(probe, topology, layer, &at,
                   [&](int l, const std::vector<long long>& out, const std::vector<long long>& in) {
                     for (size_t m = 0; m < out.size(); ++m) {
                       peak[l] += double(std::max(out[m], in[m]));
                       sent[l] += double(out[m]);
                     }
                   });
  std::vector<double> f(levels, 1.0);
  for (int l = 0; l < levels; ++l)
    if (sent[l] > 0) f[l] = std::max(1.0, peak[l] / sent[l]);
  return f;
}

ExpertLoad routed_expert_load(const RoutingProbe& probe, const Topology& topology) {
  double layers_busiest = 0, total = 0;
  std::vector<double> own(probe.workers, 0.0);  // each worker's rows, over layers
  std::vector<long long> at;
  for (int layer = 0; layer < probe.layers; ++layer) {
    dispatch_layer(probe, topology, layer, &at, [](int, const auto&, const auto&) {});
    long long most = 0, sum = 0;
    for (int m = 0; m < probe.workers; ++m) {
      long long rows = 0;
      for (int e = 0; e < probe.experts; ++e) rows += at[static_cast<size_t>(m) * probe.experts + e];
      most = std::max(most, rows);
      sum += rows;
      own[m] += double(rows);
    }
    layers_busiest += double(most);
    total += double(sum) / probe.workers;
  }
  if (!(total > 0)) return {};
  const double busiest_worker = std::max(1.0, *std::max_element(own.begin(), own.end()) / total);
  return {std::max(busiest_worker, layers_busiest / total), busiest_worker};
}

}  // namespace xd
