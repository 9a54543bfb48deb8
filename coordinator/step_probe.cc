#include "coordinator/step_probe.h"

#include <algorithm>
#include <limits>
#include <vector>

#include <cblas.h>

#include "common/clock.h"
#include "common/rng.h"
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

  ParamLayout layout(model);
  MoeTransformer<float> net(layout);
  net.init(0x5eed);
  std::vector<int32_t> inputs(size_t(batch) * seq_len), targets(inputs.size());
  Rng rng(7);
  for (size_t i = 0; i < inputs.size(); ++i) {
    inputs[i] = static_cast<int32_t>(rng.next_u64() % model.vocab_size);
    targets[i] = static_cast<int32_t>(rng.next_u64() % model.vocab_size);
  }

  const int saved_threads = openblas_get_num_threads();
  if (options.threads > 0) openblas_set_num_threads(options.threads);
  auto one_step = [&] {
    const double t0 = steady_seconds();
    net.zero_grad();
    net.forward(inputs.data(), targets.data(), batch, seq_len);
    net.backward();
    return steady_seconds() - t0;
  };
  const double warm = one_step();  // first touch of activations and gradients
  // Fastest of the repetitions: other load on the machine only slows a step.
  double best = std::numeric_limits<double>::infinity();
  const double start = steady_seconds();
  for (int r = 0; r < std::max(1, options.repetitions); ++r) {
    best = std::min(best, one_step());
    if (steady_seconds() - start + warm > options.max_seconds) break;
  }
  // The update after it, on the gradients backward left.
  AdamW<float> optimizer(net.params().size(), AdamWConfig{});
  double best_update = std::numeric_limits<double>::infinity();
  for (int r = 0; r < std::max(1, options.repetitions); ++r) {
    const double t0 = steady_seconds();
    optimizer.step(net.params().data(), net.grads().data(), 1e-6);
    best_update = std::min(best_update, steady_seconds() - t0);
  }
  if (options.threads > 0) openblas_set_num_threads(saved_threads);
  StepProbe probe{model, static_cast<long long>(batch) * seq_len, seq_len, best};
  probe.optimizer_s_per_param = best_update / double(std::max<size_t>(1, net.params().size()));
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
