#include "coordinator/job_planner.h"

#include <algorithm>
#include <thread>

namespace xd {

namespace {

ComputeModel fit_compute_model(const JobConfig& job, JobPlan* out) {
  ComputeModel compute;
  out->gemm_fit = probe_gemm();
  if (out->gemm_fit.beta > 0) {
    compute.flops_per_s = 1.0 / out->gemm_fit.beta;
    compute.gemm_overhead_s = std::max(0.0, out->gemm_fit.alpha);
  }
  auto probe = probe_model_step(job.train.model, job.train.seq_len,
                                static_cast<long long>(job.train.batch_size) * job.train.seq_len);
  if (probe) {
    compute = calibrated_compute_model(compute, *probe);
    out->step_probe = *probe;
  } else {
    out->compute_note = "model step probe failed (" + probe.status().message() + "); compute counts GEMMs only";
  }
  // Without a host list every worker runs on this machine: they share its
  // cores (the probes measured one thread).
  if (job.cluster.hosts.empty()) {
    const double cores = std::max(1u, std::thread::hardware_concurrency());
    compute.flops_per_s *= std::min(1.0, cores / job.cluster.world_size());
  }
  return compute;
}

}  // namespace

Expected<JobPlan> plan_job(const JobConfig& job, const JobPlanOptions& options) {
  XD_RETURN_IF_ERROR(job.validate());
  JobPlan out;
  if (options.progress) options.progress("timing GEMMs and one step of the model");
  out.compute = fit_compute_model(job, &out);

  const std::vector<LinkModel> spec = spec_link_models(job.cluster);
  std::vector<LinkModel> models;
  for (size_t l = 0; l < job.cluster.levels.size(); ++l) {
    const LevelSpec& level = job.cluster.levels[l];
    LinkEstimate e{level.name, spec[l], spec[l], "spec", "", 0};
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
      }
    }
    models.push_back(e.model);
    out.links.push_back(e);
  }
  out.inputs = planner_inputs_for(job, models, out.compute);
  XD_RETURN_IF_ERROR(out.inputs.validate());
  out.plan = plan_iteration(out.inputs);
  return out;
}

}  // namespace xd
