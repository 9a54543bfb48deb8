// Model-step probe: times one forward and backward of the job's model in this
// process (random weights and tokens, every expert local, one OpenBLAS thread)
// so the planner's compute model can be calibrated. The planner counts GEMM
// flops only; norms, softmax, the router, RoPE and the element-wise parts of
// the experts are left out, and at small hidden sizes they cost more than the
// GEMMs themselves. calibrated_compute_model() scales the GEMM-only model by
// measured / predicted for the same single-process workload. The probe keeps
// at most a few layers and experts, so the coordinator never has to hold a
// model that only fits sharded; the factor is a ratio per layer, which that
// does not change much. Sets OpenBLAS's
// thread count for its duration (not thread-safe against other GEMMs of this
// process running meanwhile). With copies > 1 it runs that many copies at
// once on their own threads and joins them before it returns; a copy whose
// thread cannot start is left out (StepProbe::copies counts those that ran).
#pragma once

#include "common/status.h"
#include "coordinator/planner.h"
#include "model/model_config.h"

namespace xd {

struct StepProbeOptions {
  long long max_tokens = 2048;  // the probe's batch: min(this, the job's tokens per worker)
  int max_layers = 2;           // the probe's model: the job's, cut to these many layers
  int max_experts = 8;          // ... and routed experts (top_k is kept, capped by it)
  int repetitions = 5;          // timed steps after one warm-up; their median counts
  double max_seconds = 2.0;     // fewer repetitions when a step is slow
  int threads = 1;              // as every worker runs
  // Copies timed at once, each on its own thread: as many as workers will
  // share this machine's cores, so that the memory bus and the shared cache
  // are contended as in the run. The figures are the copies' mean.
  int copies = 1;
};

struct StepProbe {
  ModelConfig model;     // what was timed
  long long tokens = 0;  // tokens of the timed batch
  int seq_len = 0;
  double seconds = 0;    // forward + backward, the repetitions' median
  // The median AdamW update of the probe's parameters (the clipping norm
  // included), per parameter: the planner adds it once per step for the
  // parameters a worker updates.
  double optimizer_s_per_param = 0;
  int copies = 1;  // timed at once (StepProbeOptions::copies, less any whose thread did not start)
};

Expected<StepProbe> probe_model_step(const ModelConfig& model, int seq_len, long long tokens,
                                     const StepProbeOptions& options = {});

// `gemm_only` with non_gemm_factor = probe.seconds / (its compute prediction
// for the probe's model and batch in one process), at least 1, and the
// probe's optimizer time per parameter.
ComputeModel calibrated_compute_model(const ComputeModel& gemm_only, const StepProbe& probe);

}  // namespace xd
