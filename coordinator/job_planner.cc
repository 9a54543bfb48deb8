#include "coordinator/job_planner.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <thread>
#include <tuple>

#include "common/clock.h"
#include "common/rng.h"
#include "compression/codec.h"
#include "compression/expert_codec.h"
#include "compression/expert_stream_codec.h"

namespace xd {

namespace {

int this_machine_cores() { return static_cast<int>(std::max(1u, std::thread::hardware_concurrency())); }

// The share of a core each worker gets: 1 with a host list (a worker per
// slot), else min(1, cores / workers), since every worker runs on this
// machine. The probes measured a thread per core (the step probe's copies
// add the contention of cores running at once, not time-slicing).
double core_share(const JobConfig& job) {
  if (!job.cluster.hosts.empty()) return 1.0;
  return std::min(1.0, double(this_machine_cores()) / job.cluster.world_size());
}

// How many workers run on this machine's cores at once. One with a host
// list (the coordinator's machine is not theirs).
int workers_per_core_set(const JobConfig& job) {
  if (!job.cluster.hosts.empty()) return 1;
  return std::clamp(job.cluster.world_size(), 1, this_machine_cores());
}

// The step probe times that many copies together, at most
// kMaxStepProbeCopies: each holds its own cut-down model in the
// coordinator, and a few already contend for the memory bus as the workers do.
constexpr int kMaxStepProbeCopies = 8;

// Wire fraction and encode + decode seconds per raw byte of one pipeline on
// `rows` random rows of `width` (fastest of three): the token codecs.
std::pair<double, double> measure_codec(const CodecPipeline& codec, int rows, int width) {
  std::vector<float> x(static_cast<size_t>(rows) * width), y(x.size());
  Rng rng(12345);
  for (float& v : x) v = static_cast<float>(rng.normal());
  EncodedTensor e;
  double best = 1e300;
  for (int rep = 0; rep < 3; ++rep) {
    const double t0 = steady_seconds();
    if (!codec.encode(x.data(), {static_cast<uint64_t>(rows), static_cast<uint64_t>(width)}, &e).is_ok())
      return {1.0, 0.0};  // cannot happen for a parsed pipeline on finite data
    if (!decode_tensor(e.metadata, e.payload.data(), e.payload.size(), y.data(), y.size()).is_ok())
      return {1.0, 0.0};
    best = std::min(best, steady_seconds() - t0);
  }
  const double raw = double(x.size()) * sizeof(float);
  return {double(e.payload.size() + e.metadata.size()) / raw, best / raw};
}

// Wire fraction and encode + decode seconds per raw byte of one message of
// `rows` tensors of `width` through an expert codec as the runtime runs it
// (ExpertStreamCodec): the sender packs each row against the base and what
// the receivers hold (weights) or adds the error it carried (gradients),
// encodes, and with feedback decodes its own message; the receiver applies
// it. Weights are init_std-sized (the base, with sr:, `base_std`-sized: the
// mean of independently drawn experts), each message after the first moved
// by an AdamW-sized step (about half the peak learning rate, root mean
// square, as the default job's experts move); gradients are fresh each
// message. The first message is not timed: weights go whole then, and the
// state is built. `step` picks the pipeline of a scheduled spec. Fastest of
// three messages.
std::pair<double, double> measure_expert_stream(const ExpertCodecSpec& spec, ExpertStreamCodec::Traffic traffic,
                                                int rows, int width, double init_std, double base_std,
                                                double learning_rate, uint64_t step) {
  const bool weights = traffic == ExpertStreamCodec::Traffic::kWeights;
  ExpertStreamCodec sender(spec, traffic, width);
  ExpertStreamCodec receiver(spec, traffic, width);
  const size_t n = static_cast<size_t>(rows) * width;
  std::vector<float> x(n), got(n, 0.0f), base(n, 0.0f);
  Rng rng(12345);
  for (float& v : x) v = static_cast<float>((weights ? init_std : 1e-3) * rng.normal());
  if (spec.against_base)
    for (float& v : base) v = static_cast<float>(base_std * rng.normal());
  std::vector<ExpertTensorRef> mine(rows), theirs(rows);
  for (int i = 0; i < rows; ++i) {
    const float* b = spec.against_base ? base.data() + size_t(i) * width : nullptr;
    mine[i] = {static_cast<uint64_t>(i), x.data() + size_t(i) * width, b, 0};
    theirs[i] = {static_cast<uint64_t>(i), got.data() + size_t(i) * width, b, 0};
  }
  double best = 1e300, fraction = 1.0;
  for (int rep = 0; rep < 4; ++rep) {
    if (rep > 0)
      for (float& v : x) v = weights ? v + static_cast<float>(0.5 * learning_rate * rng.normal())
                                     : static_cast<float>(1e-3 * rng.normal());
    if (!weights) std::fill(got.begin(), got.end(), 0.0f);  // the receiver adds the decoded gradients
    std::vector<float> packed;
    EncodedTensor e;
    ReconstructionError err;
    const double t0 = steady_seconds();
    if (!sender.encode(mine, &packed, &e, &err, nullptr, step).is_ok()) return {1.0, 0.0};
    const Status received = receiver.receive(theirs, packed, e);
    const double dt = steady_seconds() - t0;
    if (!received.is_ok()) return {1.0, 0.0};  // cannot happen for a parsed spec on finite data
    if (rep == 0) continue;
    best = std::min(best, dt);
    fraction = e.payload.empty() ? 1.0 : double(e.payload.size() + e.metadata.size()) / (n * sizeof(float));
  }
  return {fraction, best / (n * sizeof(float))};
}

std::vector<LinkCodecCost> measure_link_codecs(const JobConfig& job, std::vector<LinkEstimate>* links) {
  const int width = job.train.model.hidden_size;
  const long long routed = static_cast<long long>(job.train.batch_size) * job.train.seq_len *
                          job.train.model.routed_rows_per_token();
  const int rows = static_cast<int>(std::clamp<long long>(routed, 1, 4096));
  const double slowdown = 1.0 / core_share(job);  // workers here share its cores, as for compute
  std::map<std::string, std::pair<double, double>> measured;
  auto cost = [&](const std::string& spec) -> std::pair<double, double> {
    auto p = CodecPipeline::parse(spec);
    if (!p || p->is_raw()) return {1.0, 0.0};
    if (!measured.count(spec)) measured[spec] = measure_codec(*p, rows, width);
    return measured[spec];
  };
  // Expert tensors: one expert's w1, w3, w2 as rows, through the codec as
  // the runtime runs it (measure_expert_stream).
  const ModelConfig& mc = job.train.model;
  const int expert_width = mc.expert_intermediate_size * mc.hidden_size;
  const double base_std = mc.init_std / std::sqrt(double(std::max(1, mc.num_experts)));
  using Traffic = ExpertStreamCodec::Traffic;
  std::map<std::tuple<std::string, Traffic, uint64_t>, std::pair<double, double>> measured_experts;
  auto stream_cost = [&](const ExpertCodecSpec& e, Traffic traffic, uint64_t step) -> std::pair<double, double> {
    if (e.is_raw()) return {1.0, 0.0};
    const auto key = std::make_tuple(e.spec(), traffic, step);
    if (!measured_experts.count(key))
      measured_experts[key] = measure_expert_stream(e, traffic, 3, expert_width, mc.init_std, base_std,
                                                    job.train.optimizer.learning_rate, step);
    return measured_experts[key];
  };
  // A scheduled spec (pipelines by training step) is priced as its mean over
  // the job's steps.
  auto expert_cost = [&](const std::string& spec, Traffic traffic) -> std::pair<double, double> {
    auto e = ExpertCodecSpec::parse(spec);
    if (!e) return {1.0, 0.0};
    if (e->bit_delta) return stream_cost(*e, traffic, 0);
    const double steps = std::max(1.0, double(job.train.steps));
    std::pair<double, double> mean{0.0, 0.0};
    // Segment i runs from the i-th switch (step 0 first) to the next one.
    for (size_t i = 0; i <= e->later.size(); ++i) {
      const uint64_t first = i == 0 ? 0 : e->later[i - 1].from_step;
      const double from = double(first);
      const double to = i == e->later.size() ? steps : std::min(steps, double(e->later[i].from_step));
      if (to <= from) continue;
      if (e->pipeline_at(first).is_raw()) {  // a raw segment sends the floats: no codec time
        mean.first += (to - from) / steps;
        continue;
      }
      const auto [f, s] = stream_cost(*e, traffic, first);
      mean.first += f * (to - from) / steps;
      mean.second += s * (to - from) / steps;
    }
    return mean;
  };
  std::vector<LinkCodecCost> out;
  for (size_t l = 0; l < job.cluster.levels.size(); ++l) {
    const LinkCodecs& c = job.cluster.levels[l].link.codecs;
    const auto [df, ds] = cost(c.dispatch);
    const auto [cf, cs] = cost(c.combine);
    const auto [gf, gs] = expert_cost(c.expert_gather, Traffic::kWeights);
    const auto [rf, rs] = expert_cost(c.expert_grad, Traffic::kGradients);
    LinkCodecCost cc{df, cf, ds * slowdown, cs * slowdown};
    cc.gather_fraction = gf;
    cc.gather_s_per_byte = gs * slowdown;
    cc.grad_fraction = rf;
    cc.grad_s_per_byte = rs * slowdown;
    cc.dense_fraction = c.dense_grad == "bf16" ? 0.5 : 1.0;
    auto gather = ExpertCodecSpec::parse(c.expert_gather);
    cc.gather_against_base = gather && gather->against_base;
    cc.gather_delta = gather && gather->bit_delta;
    out.push_back(cc);
    (*links)[l].codecs = c;
    (*links)[l].codec_cost = out.back();
  }
  return out;
}

// The step probe's timings come in windows spread over the start-up (one
// before the link probes, one after each of the first two classes, the
// rest at the end): the machine's speed moves over seconds, and a run's
// mean step sees all of it, so the median window stands for it. A window
// that took longer than kOneStepProbeWindowS (a large model: building its
// copies and one step already span seconds) is the only one.
constexpr int kStepProbeWindows = 3;
constexpr double kOneStepProbeWindowS = 2.0;

Expected<StepProbe> probe_step_window(const JobConfig& job) {
  StepProbeOptions po;
  po.copies = std::min(workers_per_core_set(job), kMaxStepProbeCopies);
  po.max_seconds /= kStepProbeWindows;
  return probe_model_step(job.train.model, job.train.seq_len,
                          static_cast<long long>(job.train.batch_size) * job.train.seq_len, po);
}

// The compute model from the GEMM probe and the step probe's windows (the
// median one's figures; GEMMs only when every window failed).
ComputeModel fit_compute_model(const JobConfig& job, std::vector<StepProbe> windows, const std::string& failure,
                               JobPlan* out) {
  ComputeModel compute;
  if (out->gemm_fit.beta > 0) {
    compute.flops_per_s = 1.0 / out->gemm_fit.beta;
    compute.gemm_overhead_s = std::max(0.0, out->gemm_fit.alpha);
  }
  if (!windows.empty()) {
    std::sort(windows.begin(), windows.end(),
              [](const StepProbe& a, const StepProbe& b) { return a.seconds < b.seconds; });
    const StepProbe& median = windows[windows.size() / 2];
    compute = calibrated_compute_model(compute, median);
    out->step_probe = median;
    out->step_probe_windows.clear();
    for (const StepProbe& w : windows) out->step_probe_windows.push_back(w.seconds);
  } else {
    out->compute_note = "model step probe failed (" + failure + "); compute counts GEMMs only";
  }
  compute.flops_per_s *= core_share(job);
  return compute;
}

}  // namespace

Expected<JobPlan> plan_job(const JobConfig& job, const JobPlanOptions& options) {
  XD_RETURN_IF_ERROR(job.validate());
  JobPlan out;
  if (options.progress) options.progress("timing GEMMs and steps of the model");
  out.gemm_fit = probe_gemm();
  std::vector<StepProbe> step_windows;
  std::string step_failure;
  int step_attempts = 0;
  double first_window_s = 0;
  auto step_window = [&] {
    if (++step_attempts > 1 && first_window_s > kOneStepProbeWindowS) return;
    const double t0 = steady_seconds();
    auto w = probe_step_window(job);
    if (step_attempts == 1) first_window_s = steady_seconds() - t0;
    if (w) step_windows.push_back(*w);
    else step_failure = w.status().message();
  };
  step_window();

  const std::vector<LinkModel> spec = spec_link_models(job.cluster);
  std::vector<LinkModel> models;
  for (size_t l = 0; l < job.cluster.levels.size(); ++l) {
    const LevelSpec& level = job.cluster.levels[l];
    LinkEstimate e{level.name, spec[l], spec[l], "spec", "", 0, {}, {}};
    if (options.probe_links && !level.link.shape) {
      e.note = "not shaped here; a loopback probe says nothing of the real link";
    } else if (options.probe_links) {
      if (options.progress) options.progress("probing link class '" + level.name + "'");
      LinkProbeOptions po;
      po.time_budget_s = options.link_probe_budget_s;
      auto fit = probe_link(LinkShaping{level.link.bandwidth_bytes_per_s, level.link.latency_s}, po);
      if (!fit || fit->beta <= 0) {
        e.note = "probe failed (" + (fit ? std::string("no bandwidth measured") : fit.status().message()) + ")";
      } else {
        e.model = {std::max(0.0, fit->alpha), fit->beta};
        e.source = "probe";
        e.r2 = fit->r2;
        e.cpu_s_per_byte = fit->cpu_s_per_byte;
        e.cpu_s_per_message = fit->cpu_s_per_message;
      }
    }
    models.push_back(e.model);
    out.links.push_back(e);
    if (static_cast<int>(l) + 1 < kStepProbeWindows) step_window();
  }
  while (step_attempts < kStepProbeWindows) step_window();
  out.compute = fit_compute_model(job, std::move(step_windows), step_failure, &out);
  // The most a probe measured per byte and per message, in wall time at each
  // worker's share of a core. Not overlapped, it is the compute thread's
  // wait wherever the transport's threads run; overlapped, it dilates
  // compute only where the workers fill this machine's cores, so the
  // transport threads run on the cores the compute needs.
  for (const LinkEstimate& e : out.links) {
    out.compute.exchange_cpu_s_per_byte =
        std::max(out.compute.exchange_cpu_s_per_byte, e.cpu_s_per_byte / core_share(job));
    out.compute.exchange_cpu_s_per_message =
        std::max(out.compute.exchange_cpu_s_per_message, e.cpu_s_per_message / core_share(job));
  }
  if (workers_per_core_set(job) >= this_machine_cores()) {
    out.compute.transport_cpu_s_per_byte = out.compute.exchange_cpu_s_per_byte;
    out.compute.transport_cpu_s_per_message = out.compute.exchange_cpu_s_per_message;
    out.compute.codecs_share_compute_cores = true;
  }
  out.inputs = planner_inputs_for(job, models, out.compute);
  out.inputs.link_codecs = measure_link_codecs(job, &out.links);
  if (!options.skip_routing_probe.empty()) {
    out.routing_note = options.skip_routing_probe;  // F stays 1 until the run measures it
  } else {
    if (options.progress) options.progress("routing each worker's first batch through the initial weights");
    if (auto routing = probe_routing(job)) {
      out.routing = std::move(*routing);
      const std::vector<int> levels = job.cluster.level_sizes();
      for (const std::vector<int>& domains : domain_candidates(levels)) {
        const Topology topology(levels, domains);
        out.inputs.routed_a2a_imbalance[domains] = routed_a2a_imbalance(out.routing, topology);
        out.inputs.routed_expert_load[domains] = routed_expert_load(out.routing, topology);
      }
    } else {
      out.routing_note = routing.status().message();
    }
  }
  XD_RETURN_IF_ERROR(out.inputs.validate());
  out.plan = plan_iteration(out.inputs);
  return out;
}

}  // namespace xd
