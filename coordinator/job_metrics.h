// JobMetrics: the coordinator's view of a run's figures. Workers report one
// StepMetrics per step; a step is complete when every worker reported it.
// Renders Prometheus text exposition and JSON. Not thread-safe: the
// coordinator loop owns it (the HTTP thread reads a rendered snapshot).
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cluster/protocol.h"

namespace xd {

struct StepSummary {
  int64_t step = 0;
  int reporters = 0;
  bool skipped = false;                        // the non-finite guard skipped it (every worker does alike)
  double loss = 0, ce_loss = 0, aux_loss = 0;  // mean over workers
  double tokens_per_s = 0;                     // sum over workers
  double step_s = 0, compute_s = 0, comm_s = 0, exposed_comm_s = 0;  // max over workers
  double compute_min_s = 0;  // the fastest worker's compute
  // The slowest worker's compute minus the fastest's: the part of the
  // others' exposed time that is waiting for a more loaded peer (routing
  // skew, a busier core), which no overlap can hide.
  double compute_spread_s() const { return compute_s - compute_min_s; }
  double link_busy_s = 0;                      // max over workers
  // Per direction (StepMetrics): link busy time and compute's wait, max over workers.
  double fwd_comm_s = 0, fwd_exposed_s = 0, bwd_comm_s = 0, bwd_exposed_s = 0;
  // Per direction: the pass's compute less its waits, max over workers.
  double fwd_compute_s = 0, bwd_compute_s = 0;
  // The same waits of the slowest worker (the one with the most compute), the
  // step's critical path: step = its compute + its waits. The other workers'
  // waits also hold the spread (waiting out its compute), which no schedule
  // hides; its own are the communication the schedule left exposed.
  double critical_fwd_exposed_s = 0, critical_bwd_exposed_s = 0;
  // The slowest worker's waits by what it waited for (StepMetrics::waits_s):
  // where its exposed time, the step's critical path beside its compute, goes.
  std::map<std::string, double> critical_waits_s;
  double codec_s = 0;                          // max over workers
  // max(compute, busiest link's transmit time): no schedule can beat it.
  double bound_s() const { return std::max(compute_s, link_busy_s); }
  // Each phase's own max(compute, link), summed (StepMetrics::phase_floor_s),
  // max over workers: at least the bound, above it when a phase's traffic
  // outlasts its compute while the other phase's link idles.
  double phase_floor_s = 0;
  // The workers' CPU time on their busiest machine over the CPUs they may run
  // on there together (each worker's StepMetrics::cpu_s, summed by machine;
  // the union of their CPUs): the step cannot be shorter on those cores,
  // however it overlaps. Above the bound when more threads share a
  // host's cores than it has: then the workers' compute waits for a core, and
  // the cores, not the schedule, set the step. 0 when no worker reported it.
  double cpu_floor_s = 0;
  double predicted_step_s = 0;
  double peak_rss_bytes = 0;                   // max
  std::map<std::string, double> bytes;         // sum
  std::map<std::string, double> nmse;          // max over workers (mean() averages steps)
  std::map<std::string, double> codec_seconds;  // per "link class/traffic", max over workers
  // Its two parts, each max over workers (so they need not sum to it).
  std::map<std::string, double> codec_encode_seconds, codec_decode_seconds;
  std::vector<double> gather_wait_s;           // per layer, max over workers
  // Per link class: {bursts, bytes, seconds} summed over workers (StepMetrics::link_bursts).
  std::map<std::string, std::array<double, 3>> link_bursts;
  double overlap_percent() const { return overlap(exposed_comm_s, comm_s); }
  double fwd_overlap_percent() const { return overlap(fwd_exposed_s, fwd_comm_s); }
  double bwd_overlap_percent() const { return overlap(bwd_exposed_s, bwd_comm_s); }
  double critical_fwd_overlap_percent() const { return overlap(critical_fwd_exposed_s, fwd_comm_s); }
  double critical_bwd_overlap_percent() const { return overlap(critical_bwd_exposed_s, bwd_comm_s); }
  // What users feel: 1.0 is the physical limit.
  double step_over_bound() const { return bound_s() > 0 ? step_s / bound_s() : 0.0; }
  // How far the schedule is from what each phase's own traffic and compute
  // allow: 1.0 leaves nothing to overlap better.
  double step_over_phase_floor() const { return phase_floor_s > 0 ? step_s / phase_floor_s : 0.0; }
  // How much of its hosts' cores the step left idle: 1.0 kept the busiest
  // host's every core busy with the job's work.
  double step_over_cpu_floor() const { return cpu_floor_s > 0 ? step_s / cpu_floor_s : 0.0; }
  // The routing's A2A imbalance on a link class: its token hops' larger
  // sides over their mean, `link`/moe_peak_raw over the raw rows sent (>= 1);
  // 0 when no token row crossed it this step.
  double a2a_imbalance(const std::string& link) const;
  static double overlap(double exposed, double total) {
    return total > 0 ? std::max(0.0, 100.0 * (1.0 - exposed / total)) : 0.0;
  }
};

// StepSummary::critical_waits_s as one line, in milliseconds:
// "forward: expert all gather 3.1; backward: dense all reduce 5.0, gradient
// norm 9.8". Waits under 0.05 ms are left out; "" when none is left.
std::string waits_text(const std::map<std::string, double>& waits_s);

class JobMetrics {
 public:
  explicit JobMetrics(int world_size) : world_(world_size) {}
  // `host`: the host the worker registered from, its machine for the CPU
  // floor when the report names none (StepSummary::cpu_floor_s).
  void record(int rank, const StepMetrics& m, const std::string& host = "");
  // Steps every worker has reported, in order.
  const std::vector<StepSummary>& complete_steps() const { return complete_; }
  const StepSummary* last_complete() const { return complete_.empty() ? nullptr : &complete_.back(); }
  // The furthest step any worker has reported (0: none).
  int64_t latest_step() const;
  // From `from_step` on, a step's predicted time is `seconds` (the plan the
  // coordinator holds now) instead of what the workers were told at start.
  void set_predicted_step(int64_t from_step, double seconds) { predicted_from_[from_step] = seconds; }
  // Means over the complete steps after the first `skip` (warm-up).
  StepSummary mean(int skip) const;
  nlohmann::json to_json() const;
  std::string prometheus(const std::string& job, const std::vector<std::string>& worker_states) const;

 private:
  int world_;
  std::map<int64_t, StepSummary> pending_;
  std::map<int64_t, std::vector<std::array<double, 3>>> pending_losses_;  // by rank: loss, ce, aux
  // By step, per machine: the workers' CPU seconds and the CPUs they may run on.
  std::map<int64_t, std::map<std::string, std::pair<double, std::set<int>>>> pending_host_cpu_;
  std::vector<StepSummary> complete_;
  std::map<int, StepMetrics> last_by_rank_;
  std::map<int64_t, double> predicted_from_;  // step -> the prediction from it on
};

}  // namespace xd
