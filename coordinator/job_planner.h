// plan_job: the one path from a job's configuration to its plan, shared by the
// coordinator and `xdmoe plan`, so that `xdmoe plan` shows exactly what a
// launch will pick from the same measurements. It
//   1. fits the compute model: a one-thread GEMM probe, calibrated by timed
//      steps of the job's model (coordinator/step_probe.h) in three windows
//      spread over the link probes (the median window's), and shared among
//      the workers when they all run on this machine (no host list);
//   2. fits each shaped link class's alpha/beta with a short loopback probe
//      (coordinator/link_probe.h), or takes the spec's figures (unshaped
//      classes always do: a loopback probe says nothing of a real link; a
//      failed probe falls back too, and says why);
//   3. measures each configured token codec on a sample of rows of the
//      model's width: the fraction of the bytes it leaves and its encode +
//      decode time (per core, shared like compute when every worker runs
//      here); raw costs nothing and is not measured;
//   4. routes each worker's first batch through the job's initial weights
//      (coordinator/routing_probe.h) for each candidate's A2A imbalance F
//      and the busiest worker's share of the routed experts' rows;
//      where it cannot (the data is not here, the model is too large) or
//      the caller says why not (a resumed run, flat EP), F is 1 until the
//      run measures it, and routing_note says why;
//   5. plans every expert-domain candidate (coordinator/planner.h).
// Takes about 1-5 s. Not thread-safe against other GEMMs of this process
// (the probes set OpenBLAS's thread count).
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "cluster/job_config.h"
#include "common/status.h"
#include "coordinator/link_probe.h"
#include "coordinator/planner.h"
#include "coordinator/routing_probe.h"
#include "coordinator/step_probe.h"

namespace xd {

struct JobPlanOptions {
  bool probe_links = true;
  // Empty: probe the routing. Otherwise why not (a resumed run routes with
  // its checkpoint's weights, flat EP's hops are not the levels'): F is
  // then 1 until the run measures it, and routing_note says this.
  std::string skip_routing_probe;
  double link_probe_budget_s = 1.5;  // per shaped link class
  // Told before each probe starts ("probing link class 'dc'"); may be empty.
  std::function<void(const std::string&)> progress;
};

// Where a link class's model came from.
struct LinkEstimate {
  std::string name;
  LinkModel model;       // what the planner used
  LinkModel configured;  // the spec's figures
  std::string source;    // "probe" or "spec"
  std::string note;      // why the spec's figures were used, if not asked for
  double r2 = 0;         // of the probe's fit
  LinkCodecs codecs;     // the token codecs of this link class
  LinkCodecCost codec_cost;  // as measured (raw: 1 and 0)
  double cpu_s_per_byte = 0;     // the probe's transport CPU time per byte (0: not probed)
  double cpu_s_per_message = 0;  // ... and per message
};

struct JobPlan {
  PlannerInputs inputs;
  Plan plan;
  std::vector<LinkEstimate> links;  // one per level
  ComputeModel compute;
  LinearFit gemm_fit;
  StepProbe step_probe;  // the median window's; tokens == 0 when the step probe failed
  std::vector<double> step_probe_windows;  // each window's step seconds, in increasing order
  std::string compute_note;  // why the compute model counts GEMMs only, if it does
  RoutingProbe routing;      // workers == 0 when not probed
  std::string routing_note;  // why not
};

// Errors: the inputs do not validate (for example a bad domain size).
Expected<JobPlan> plan_job(const JobConfig& job, const JobPlanOptions& options = {});

}  // namespace xd
