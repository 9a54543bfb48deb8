// Replanner: live re-planning. It keeps, per link class, what the workers
// measured over the last few complete steps -- the periods during which some
// of the class's bytes waited to leave a worker, each a sample of
// t = alpha + bytes * beta (TransportStats::class_bursts) -- and re-fits beta
// with the plan's alpha: beta = (seconds - bursts * alpha) / bytes. When a
// shaped class's fitted bandwidth leaves [assumed / far_factor, assumed *
// far_factor] (a throttle, or the link by itself), it re-plans every domain
// candidate with the fitted link and, when another plan predicts a step at
// least min_gain faster than the current one under the same links, switches
// to it from a step far enough ahead that every worker learns of it before
// gathering that step's experts. Either way the fitted link becomes the
// assumption, so a link that stays where it went does not re-plan again.
// Compute is re-fitted the same way: when every step of a window measured
// its compute (the slowest worker's) more than compute_tolerance away from
// the plan's, the same way, the compute model is scaled to the window's mean
// and the prediction follows it, with the domains and r as they are (a
// shared machine's speed drifts by tens of percent within minutes; experts
// move only when a link does). The measured compute holds the transport's
// CPU time, so the fitted model adds none on top. The routing's A2A
// imbalance per level (how much longer than the mean a hop lasts, the runs'
// LINK/moe_peak_raw over the raw token bytes) is re-fitted alike: measured
// in every step of a window more than compute_tolerance from the assumed
// (the routing probe's at start-up, else 1), the same way, and the
// prediction follows it. So are the coded traffic kinds' wire fractions per
// link class (the run's bytes on the wire over the fp32 bytes before the
// codec; the planner measured them at start-up on synthetic tensors, and a
// codec schedule changes them mid-run).
// The planner can be wrong: once the new plan has run a few steps, its
// measured step time is compared with the old plan's under the same link,
// and the old plan comes back if the new one is more than revert_margin
// slower (reported as a change of its own).
// Plain computation, no I/O; not thread-safe (the coordinator's thread).
#pragma once

#include <array>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "coordinator/planner.h"

namespace xd {

struct ReplanOptions {
  // Steps before this one are not fitted (the coordinator's: the run's
  // fourth, 4 or a resumed run's checkpoint step + 4). A run's
  // first steps are not its steady state: the SR codec's first all-gather
  // sends whole experts, the allocator and caches warm up. On the SR
  // benchmark's Table V job the worker link fitted at 145-155 Mbit/s over
  // steps 1-3, at 320-340 Mbit/s later.
  int first_fitted_step = 1;
  int window_steps = 3;        // complete steps per fit
  double far_factor = 2.0;     // how far the fitted bandwidth must move
  double min_gain = 0.05;      // the new plan's predicted step must be this much shorter
  // The switch's step: the furthest reported step + max(lead_steps, 2 +
  // lead_seconds / step time), so that the update reaches every worker
  // before it gathers that step's experts, however short the steps.
  int lead_steps = 3;
  double lead_seconds = 0.5;
  double min_bytes = 64e3;     // per fit and class, or no fit
  // Every step of a window's compute this far from the plan's, the same
  // way, and the compute model is re-fitted (0: never).
  double compute_tolerance = 0.05;
  // After a switch, the new plan's measured steps (window_steps of them, past
  // its first) against the old plan's under the same link: slower by more
  // than this, and the old plan comes back.
  double revert_margin = 0.10;
};

// What the workers run of a plan besides its domains: the pipeline degree
// per direction and when the replicas' weight gradients are computed.
struct RunSchedule {
  int pipeline_degree = 1, backward_pipeline_degree = 1;
  bool replica_weights_late = false;
  bool operator==(const RunSchedule&) const = default;
  // "2/1, late" (pipeline_degrees_text).
  std::string text() const;
};

// One step's codec fractions on one link class as the run measured them:
// per traffic kind, the bytes on the wire over the fp32 bytes before the
// codec (LinkCodecCost's *_fraction); 0 where the step sent none of it.
struct CodecFractions {
  double dispatch = 0, combine = 0, gather = 0, grad = 0;
};

// One re-plan: what was measured, what each plan predicts, what was done.
struct PlanChange {
  int64_t at_step = 0;         // the complete step whose measurements triggered it
  int64_t from_step = 0;       // the first step on the new plan; 0: the plan stayed
  std::string link;            // the re-fitted link class, or "compute" or "routing" (a re-fit)
  double assumed_bytes_per_s = 0, measured_bytes_per_s = 0;
  double assumed_compute_s = 0, measured_compute_s = 0;  // a compute re-fit: the step's compute
  std::vector<int> old_domains, new_domains;
  RunSchedule old_schedule, new_schedule;
  double old_predicted_s = 0;      // the current plan as predicted before
  double old_now_predicted_s = 0;  // the current plan under the fitted link
  double new_predicted_s = 0;      // the best plan under the fitted link
  std::string reason;
  // A switch back: the new plan measured slower than the one it replaced
  // (old_now_predicted_s and new_predicted_s then hold those measured steps).
  bool reverted = false;
  bool switched() const { return from_step > 0; }
  // An A2A imbalance re-fit: per level, F before and after (unchanged
  // where that level did not move).
  std::vector<double> assumed_a2a_imbalance, measured_a2a_imbalance;
  // A codec re-fit: per level, the fractions before and after (unchanged
  // where nothing coded crossed).
  std::vector<CodecFractions> assumed_codec_fractions, measured_codec_fractions;
  // A compute re-fit (the prediction only), whatever the link classes are called.
  bool compute_refit() const { return measured_compute_s > 0; }
  bool imbalance_refit() const { return !measured_a2a_imbalance.empty(); }
  bool codec_refit() const { return !measured_codec_fractions.empty(); }
  // Any of them: the prediction moves, the plan stays.
  bool model_refit() const { return compute_refit() || imbalance_refit() || codec_refit(); }
};

class Replanner {
 public:
  // `shaped[l]`: whether level l's link is measured -- shaped, or crossing a
  // real network -- (only those re-plan: a loopback "link" measures the CPU). `pipeline_degree`
  // and `backward_pipeline_degree` are the workers' current r per direction.
  Replanner(PlannerInputs inputs, Plan plan, std::vector<std::string> link_names, std::vector<bool> shaped,
            int pipeline_degree, int backward_pipeline_degree, ReplanOptions options = {});

  // A complete step's bursts per link class name, summed over workers.
  // `latest_step`: the furthest step any worker reported; `last_step`: the
  // job's train.steps; `step_s`: the step's time, `compute_s` its compute
  // (the slowest worker's; 0: unknown), `a2a_imbalance` per level the
  // step's measured A2A imbalance (0 or missing: none measured),
  // `codec_fractions` per level the step's measured codec fractions (missing:
  // none). Returns a change when it re-planned or re-fitted.
  std::optional<PlanChange> on_step(int64_t step, const std::map<std::string, std::array<double, 3>>& bursts,
                                    int64_t latest_step, int64_t last_step, double step_s = 0,
                                    double compute_s = 0, const std::vector<double>& a2a_imbalance = {},
                                    const std::vector<CodecFractions>& codec_fractions = {});

  const Plan& plan() const { return plan_; }
  // The degrees the workers run (the plan's candidate may have been priced
  // at others).
  int pipeline_degree() const { return schedule_.pipeline_degree; }
  int backward_pipeline_degree() const { return schedule_.backward_pipeline_degree; }
  // Whether they compute the replicas' weight gradients late (at first the
  // plan's choice; inputs' expert_parallel.replica_weight_gradients is what
  // a re-plan may choose from).
  bool replica_weights_late() const { return schedule_.replica_weights_late; }
  const PlannerInputs& inputs() const { return inputs_; }
  // Re-plans and switches back, not compute re-fits (those only move the
  // prediction; compute_refits() counts them).
  const std::vector<PlanChange>& history() const { return history_; }
  int compute_refits() const { return compute_refits_; }
  int imbalance_refits() const { return imbalance_refits_; }
  int codec_refits() const { return codec_refits_; }
  // The last fitted bandwidth per class name (bytes/s); absent before a full window.
  const std::map<std::string, double>& measured() const { return measured_; }

 private:
  PlannerInputs inputs_;
  Plan plan_;
  std::vector<std::string> names_;
  std::vector<bool> shaped_;
  RunSchedule schedule_;  // what the workers run
  ReplanOptions options_;
  std::vector<std::map<std::string, std::array<double, 3>>> window_;
  std::vector<double> compute_window_;  // the window's steps' compute
  std::vector<std::vector<double>> imbalance_window_;  // the window's steps' A2A imbalance per level
  std::vector<std::vector<CodecFractions>> codec_window_;  // the window's steps' codec fractions per level
  int compute_refits_ = 0, imbalance_refits_ = 0, codec_refits_ = 0;
  int64_t quiet_until_ = 0;  // no re-plan before this step (a switch in flight)
  std::map<std::string, double> measured_;
  std::vector<PlanChange> history_;
  // A switch in flight, to be judged against the plan it replaced.
  struct Switch {
    int64_t from_step = 0;
    Plan old_plan;
    RunSchedule old_schedule;
    double before_s = 0;  // the old plan's mean step under the fitted link
  };
  std::optional<Switch> switch_;
  std::map<int64_t, double> step_times_;  // step -> measured seconds
  double mean_step_s(int64_t first, int64_t last) const;
  int64_t lead_steps(double step_s) const;  // how far ahead a switch goes
  // The window's mean when it is full and each of its values lies more than
  // compute_tolerance from `assumed`, all on the same side; none otherwise.
  std::optional<double> drifted_mean(const std::vector<double>& window, double assumed) const;
  std::optional<PlanChange> refit_compute(int64_t step);
  std::optional<PlanChange> refit_imbalance(int64_t step);
  std::optional<PlanChange> refit_codecs(int64_t step);
  // The workers' domains and r predicted under `fitted`; none when those
  // domains are not among its candidates.
  std::optional<Plan> predict_current(PlannerInputs fitted) const;
  // A re-fit's model becomes the assumption: its plan and inputs; the
  // window it was fitted from starts over, and `refits` counts it.
  template <typename Window>
  void adopt_refit(Plan next, PlannerInputs inputs, Window* window, int* refits) {
    plan_ = std::move(next);
    inputs_ = std::move(inputs);
    window->clear();
    ++*refits;
  }
  // A re-fit's change: the current domains and r, predicted as `next` does.
  PlanChange refit_change(int64_t step, const char* what, const Plan& next) const;
  void clear_windows();
  std::optional<PlanChange> check_switch(int64_t step, int64_t latest_step, int64_t last_step, double step_s);
};

}  // namespace xd
