#include "coordinator/step_probe.h"

#include <algorithm>
#include <barrier>
#include <limits>
#include <memory>
#include <system_error>
#include <thread>
#include <vector>

#include <cblas.h>

#include "common/clock.h"
#include "common/rng.h"
#include "coordinator/link_probe.h"
#include "model/adamw.h"
#include "model/moe_transformer.h"
#include "model/param_layout.h"

namespace xd {

Expected<StepProbe> probe_model_step(const ModelConfig& job_model, int seq_len, long long tokens,
                                     const StepProbeOptions& options) {
  XD_RETURN_IF_ERROR(job_model.validate());
  if (seq_len <= 0 || seq_len > job_model.max_seq_len)
    return Status::invalid_argument("step probe: seq_len must be in 1..max_seq_len");
  ModelConfig model = job_model;
  model.num_layers = std::min(model.num_layers, std::max(1, options.max_layers));
  if (!model.connectivity.empty()) model.connectivity.resize(model.num_layers);
  model.num_experts = std::min(model.num_experts, std::max(1, options.max_experts));
  model.top_k = std::min(model.top_k, model.num_experts);
  XD_RETURN_IF_ERROR(model.validate().with_context("the step probe's cut-down model"));
  const long long want = std::max<long long>(seq_len, std::min(tokens, options.max_tokens));
  const int batch = static_cast<int>(want / seq_len);

  // One copy: its own model, batch and optimizer, as one worker has.
  struct Copy {
    explicit Copy(const ParamLayout& layout) : net(layout), optimizer(net.params().size(), AdamWConfig{}) {}
    MoeTransformer<float> net;
    AdamW<float> optimizer;
    std::vector<int32_t> inputs, targets;
    std::vector<double> steps, updates;  // the timed repetitions' seconds
  };
  ParamLayout layout(model);
  const int copies = std::max(1, options.copies);
  std::vector<std::unique_ptr<Copy>> runs;
  for (int i = 0; i < copies; ++i) {
    runs.push_back(std::make_unique<Copy>(layout));
    Copy& c = *runs.back();
    c.net.init(0x5eed);
    c.inputs.resize(size_t(batch) * seq_len);
    c.targets.resize(c.inputs.size());
    Rng rng(7 + i);
    for (size_t j = 0; j < c.inputs.size(); ++j) {
      c.inputs[j] = static_cast<int32_t>(rng.next_u64() % model.vocab_size);
      c.targets[j] = static_cast<int32_t>(rng.next_u64() % model.vocab_size);
    }
  }

  const int saved_threads = openblas_get_num_threads();
  if (options.threads > 0) openblas_set_num_threads(options.threads);
  // The copies start every timed step and update together, so each is timed
  // while the others contend for the memory bus and the shared cache.
  std::barrier together(copies);
  int repetitions = std::max(1, options.repetitions);
  auto run = [&](int i) {
    Copy& c = *runs[i];
    auto one_step = [&] {
      const double t0 = steady_seconds();
      c.net.zero_grad();
      c.net.forward(c.inputs.data(), c.targets.data(), batch, seq_len);
      c.net.backward();
      return steady_seconds() - t0;
    };
    // The first step touches activations and gradients first; copy 0's
    // sets the repetitions, fewer when a step is slow.
    const double warm = one_step();
    if (i == 0)
      repetitions = std::clamp(static_cast<int>(options.max_seconds / std::max(1e-9, warm)) - 1, 1, repetitions);
    together.arrive_and_wait();
    // The median of the repetitions, not the fastest: the planner predicts
    // a run's mean step, which the machine's other load slows as it slows
    // any step, and the fastest of a few is a quiet moment's.
    for (int r = 0; r < repetitions; ++r) {
      together.arrive_and_wait();
      c.steps.push_back(one_step());
    }
    // The update after it, on the gradients backward left.
    for (int r = 0; r < repetitions; ++r) {
      together.arrive_and_wait();
      const double t0 = steady_seconds();
      c.optimizer.step(c.net.params().data(), c.net.grads().data(), 1e-6);
      c.updates.push_back(steady_seconds() - t0);
    }
  };
  std::vector<std::thread> others;
  int timed = 1;  // copies that run: a thread that cannot start leaves the barrier to the others
  for (int i = 1; i < copies; ++i) {
    try {
      others.emplace_back(run, i);
      ++timed;
    } catch (const std::system_error&) {
      together.arrive_and_drop();
    }
  }
  run(0);
  for (std::thread& t : others) t.join();
  if (options.threads > 0) openblas_set_num_threads(saved_threads);
  double step_s = 0, update_s = 0;
  for (auto& c : runs)
    if (!c->steps.empty()) {  // it ran
      step_s += upper_median(c->steps) / timed;
      update_s += upper_median(c->updates) / timed;
    }
  StepProbe probe{model, static_cast<long long>(batch) * seq_len, seq_len, step_s};
  probe.copies = timed;
  probe.optimizer_s_per_param = update_s / double(std::max<size_t>(1, runs[0]->net.params().size()));
  return probe;
}

ComputeModel calibrated_compute_model(const ComputeModel& gemm_only, const StepProbe& probe) {
  ComputeModel out = gemm_only;
  out.non_gemm_factor = 1;
  out.optimizer_s_per_param = 0;  // the probe's step has no update: predict it without one
  if (probe.seconds <= 0 || probe.tokens <= 0) {
    out.optimizer_s_per_param = probe.optimizer_s_per_param;
    return out;
  }
  // The probe's step is one process holding every expert: one level of size 1.
  PlannerInputs in;
  in.model = probe.model;
  in.tokens_per_worker = probe.tokens;
  in.seq_len = probe.seq_len;
  in.level_sizes = {1};
  in.links = {LinkModel{}};
  in.compute = out;
  const Workload w = workload_of(in);
  const double predicted =
      evaluate_candidate(w, in.level_sizes, in.links, {1}, std::numeric_limits<double>::infinity())
          .compute_s;
  if (predicted > 0) out.non_gemm_factor = std::max(1.0, probe.seconds / predicted);
  out.optimizer_s_per_param = probe.optimizer_s_per_param;
  return out;
}

}  // namespace xd
