#include "coordinator/replanner.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "common/check.h"

namespace xd {

std::string RunSchedule::text() const {
  return pipeline_degrees_text(pipeline_degree, backward_pipeline_degree, replica_weights_late);
}

Replanner::Replanner(PlannerInputs inputs, Plan plan, std::vector<std::string> link_names, std::vector<bool> shaped,
                     int pipeline_degree, int backward_pipeline_degree, ReplanOptions options)
    : inputs_(std::move(inputs)),
      plan_(std::move(plan)),
      names_(std::move(link_names)),
      shaped_(std::move(shaped)),
      schedule_{pipeline_degree, backward_pipeline_degree, plan_.choice().replica_weights_late},
      options_(options) {
  // A plan update does not switch the rows' layout: the start's choice stays.
  inputs_.expert_parallel.tokens_once_per_worker = tokens_once_per_worker_of(plan_.choice().tokens_once_per_worker);
}

std::optional<PlanChange> Replanner::on_step(int64_t step, const std::map<std::string, std::array<double, 3>>& bursts,
                                             int64_t latest_step, int64_t last_step, double step_s,
                                             double compute_s, const std::vector<double>& a2a_imbalance,
                                             const std::vector<CodecFractions>& codec_fractions) {
  if (step_s > 0) step_times_[step] = step_s;
  step_times_.erase(step_times_.begin(), step_times_.lower_bound(step - 64));  // a few windows back suffice
  if (auto back = check_switch(step, latest_step, last_step, step_s)) return back;
  if (step < quiet_until_ || step < options_.first_fitted_step) return std::nullopt;
  auto keep_last = [this](auto* window, auto value) {
    window->push_back(std::move(value));
    if (static_cast<int>(window->size()) > options_.window_steps) window->erase(window->begin());
  };
  keep_last(&window_, bursts);
  keep_last(&compute_window_, compute_s);
  keep_last(&imbalance_window_, a2a_imbalance);
  keep_last(&codec_window_, codec_fractions);
  if (static_cast<int>(window_.size()) < options_.window_steps) return std::nullopt;

  // beta from {bursts, bytes, seconds} with the plan's alpha; 0: too few bytes.
  auto fit = [this](double n, double bytes, double seconds, const LinkModel& assumed) {
    if (bytes < options_.min_bytes / options_.window_steps || seconds <= 0) return 0.0;
    const double beta = (seconds - n * assumed.alpha_s) / bytes;
    return beta > 0 ? beta : seconds / bytes;  // the latency was overestimated: bytes / time
  };
  // The class whose fitted bandwidth moved furthest, if any moved far -- in
  // every step of the window, the same way, so that a window straddling a
  // change is not taken for the new level.
  int far_level = -1;
  double far_ratio = 1, far_beta = 0;
  for (size_t l = 0; l < names_.size() && l < inputs_.links.size(); ++l) {
    const LinkModel& assumed = inputs_.links[l];
    double n = 0, bytes = 0, seconds = 0;
    int slower = 0, faster = 0, sampled = 0;
    const double far = std::log(options_.far_factor);
    for (const auto& w : window_)
      if (auto it = w.find(names_[l]); it != w.end()) {
        n += it->second[0];
        bytes += it->second[1];
        seconds += it->second[2];
        const double b = fit(it->second[0], it->second[1], it->second[2], assumed);
        if (b > 0 && assumed.beta_s_per_byte > 0) {
          ++sampled;
          slower += std::log(b / assumed.beta_s_per_byte) > far;
          faster += std::log(b / assumed.beta_s_per_byte) < -far;
        }
      }
    const double beta = bytes >= options_.min_bytes ? fit(n, bytes, seconds, assumed) : 0.0;
    if (!(beta > 0)) continue;
    measured_[names_[l]] = 1.0 / beta;
    if (l >= shaped_.size() || !shaped_[l] || !(assumed.beta_s_per_byte > 0)) continue;
    // Every step that closed a burst of the class (a busy link can carry one
    // burst across a step boundary), at least two of them.
    if (sampled < 2 || (slower < sampled && faster < sampled)) continue;
    const double ratio = beta / assumed.beta_s_per_byte;  // > 1: slower than assumed
    const double distance = std::abs(std::log(ratio));
    if (distance > far && distance > std::abs(std::log(far_ratio))) {
      far_level = static_cast<int>(l);
      far_ratio = ratio;
      far_beta = beta;
    }
  }
  if (far_level < 0) {
    if (auto c = refit_compute(step)) return c;
    if (auto c = refit_imbalance(step)) return c;
    return refit_codecs(step);
  }

  PlanChange c;
  c.at_step = step;
  c.link = names_[far_level];
  c.assumed_bytes_per_s = 1.0 / inputs_.links[far_level].beta_s_per_byte;
  c.measured_bytes_per_s = 1.0 / far_beta;
  c.old_domains = plan_.choice().domain_sizes;
  c.old_schedule = schedule_;
  c.old_predicted_s = plan_.choice().iteration_s;
  PlannerInputs fitted = inputs_;
  fitted.links[far_level].beta_s_per_byte = far_beta;
  Plan next = plan_iteration(fitted);
  const PlanCandidate& best = next.choice();
  // The running plan under the fitted link: its domains at the degrees the
  // workers run (the fitted plan may prefer others for the same domains).
  const std::optional<Plan> now = predict_current(fitted);
  c.old_now_predicted_s = now ? now->choice().iteration_s : best.iteration_s;
  c.new_domains = best.domain_sizes;
  // A fixed pipeline degree stays; auto takes the planner's r for the domains.
  const int fixed_r = inputs_.expert_parallel.pipeline_degree;
  c.new_schedule = {fixed_r > 0 ? fixed_r : std::max(1, best.pipeline_degree),
                    std::max(1, best.backward_pipeline_degree), best.replica_weights_late};
  // The planner's pair, or the r it was given.
  XD_CHECK(c.new_schedule.pipeline_degree % c.new_schedule.backward_pipeline_degree == 0);
  c.new_predicted_s = best.iteration_s;
  char what[200];
  std::snprintf(what, sizeof what, "link class '%s' measured %.3g Mbit/s, the plan assumed %.3g Mbit/s",
                c.link.c_str(), c.measured_bytes_per_s * 8 / 1e6, c.assumed_bytes_per_s * 8 / 1e6);
  const bool better = (c.new_domains != c.old_domains || c.new_schedule != c.old_schedule) &&
                      c.new_predicted_s < (1.0 - options_.min_gain) * c.old_now_predicted_s;
  const int64_t from = latest_step + lead_steps(step_s);
  if (better && from <= last_step) {
    c.from_step = from;
    c.reason = std::string(what) + "; re-planned";
    // To compare once the new plan has run: the old plan's measured steps
    // under the fitted link (this window) and the old plan itself.
    Switch sw;
    sw.from_step = from;
    sw.old_plan = plan_;
    if (now) sw.old_plan = *now;  // the old domains and degrees, predicted under the fitted link
    sw.old_schedule = schedule_;
    sw.before_s = mean_step_s(step - options_.window_steps + 1, step);
    switch_ = sw;
    plan_ = next;
    schedule_ = c.new_schedule;
    quiet_until_ = from + 1;  // measurements of the old plan's steps would mislead the next fit
  } else {
    c.new_domains = c.old_domains;
    c.new_schedule = c.old_schedule;
    c.new_predicted_s = c.old_now_predicted_s;
    c.reason = std::string(what) + (better ? "; too close to the end to switch" : "; the current plan is still the best");
    // The same domains and degrees, predicted under the fitted link.
    plan_ = now ? *now : next;
  }
  inputs_ = fitted;
  clear_windows();
  history_.push_back(c);
  return c;
}

void Replanner::clear_windows() {
  window_.clear();
  compute_window_.clear();
  imbalance_window_.clear();
  codec_window_.clear();
}

namespace {

// The compute model of a machine `factor` times slower (every compute term
// of workload_of() scales by it).
ComputeModel slower_by(ComputeModel c, double factor) {
  c.flops_per_s /= factor;
  c.gemm_overhead_s *= factor;
  c.optimizer_s_per_param *= factor;
  return c;
}

}  // namespace

std::optional<double> Replanner::drifted_mean(const std::vector<double>& window, double assumed) const {
  if (!(options_.compute_tolerance > 0) || static_cast<int>(window.size()) < options_.window_steps ||
      !(assumed > 0))
    return std::nullopt;
  const double far = std::log1p(options_.compute_tolerance);
  int above = 0, below = 0;
  double sum = 0;
  for (double v : window) {
    if (!(v > 0) || !std::isfinite(v)) return std::nullopt;
    sum += v;
    above += std::log(v / assumed) > far;
    below += std::log(v / assumed) < -far;
  }
  const int n = static_cast<int>(window.size());
  if (above < n && below < n) return std::nullopt;
  return sum / n;
}

std::optional<PlanChange> Replanner::refit_compute(int64_t step) {
  // The plan's compute as the run measures it (PlanCandidate::run_compute_s):
  // without the transport's and codecs' stretch, which the measured compute
  // holds already, and without the wait for each layer's busiest worker,
  // which the run counts as exposed time.
  const PlanCandidate& now = plan_.choice();
  const double assumed = now.run_compute_s();
  const std::optional<double> drifted = drifted_mean(compute_window_, assumed);
  if (!drifted) return std::nullopt;
  const double measured = *drifted;
  // The measured compute holds the transport's CPU time already: the
  // fitted model counts none on top.
  PlannerInputs fitted = inputs_;
  fitted.compute = slower_by(inputs_.compute, measured / assumed);
  drop_core_sharing(&fitted.compute);
  std::optional<Plan> next = predict_current(fitted);
  if (!next) return std::nullopt;
  PlanChange c = refit_change(step, "compute", *next);
  c.assumed_compute_s = assumed;
  c.measured_compute_s = measured;
  char what[200];
  std::snprintf(what, sizeof what, "compute measured %.1f ms a step, the plan assumed %.1f ms; the prediction follows",
                measured * 1e3, assumed * 1e3);
  c.reason = what;
  adopt_refit(std::move(*next), std::move(fitted), &compute_window_, &compute_refits_);
  return c;
}

std::optional<PlanChange> Replanner::refit_imbalance(int64_t step) {
  const size_t levels = inputs_.level_sizes.size();
  std::vector<double> assumed = inputs_.a2a_imbalance_for(plan_.choice().domain_sizes);
  if (assumed.empty()) assumed.assign(levels, 1.0);
  std::vector<double> fitted = assumed;
  bool moved = false;
  for (size_t l = 0; l < levels; ++l) {
    // The level's F in each step of the window; a step that measured none
    // (no token crossed the level) leaves it as assumed.
    std::vector<double> level;
    for (const std::vector<double>& w : imbalance_window_)
      if (l < w.size() && w[l] >= 1) level.push_back(w[l]);
    if (level.size() < imbalance_window_.size()) continue;
    if (const std::optional<double> f = drifted_mean(level, assumed[l])) {
      fitted[l] = *f;
      moved = true;
    }
  }
  if (!moved) return std::nullopt;
  PlannerInputs next_inputs = inputs_;
  next_inputs.a2a_imbalance = fitted;
  std::optional<Plan> next = predict_current(next_inputs);
  if (!next) return std::nullopt;
  PlanChange c = refit_change(step, "routing", *next);
  c.assumed_a2a_imbalance = assumed;
  c.measured_a2a_imbalance = fitted;
  std::string what = "A2A imbalance measured";
  for (size_t l = 0; l < levels; ++l) {
    char one[96];
    std::snprintf(one, sizeof one, "%s %s %.2f (assumed %.2f)", l ? "," : "",
                  l < names_.size() ? names_[l].c_str() : std::to_string(l).c_str(), fitted[l], assumed[l]);
    what += one;
  }
  c.reason = what + "; the prediction follows";
  adopt_refit(std::move(*next), std::move(next_inputs), &imbalance_window_, &imbalance_refits_);
  return c;
}

namespace {

// A traffic kind's fraction in a measured sample and in the planner's cost,
// and its codec time there (with the fraction: whether it is coded at all).
struct CodecKind {
  const char* name;
  double CodecFractions::*measured;
  double LinkCodecCost::*fraction;
  double LinkCodecCost::*s_per_byte;
};
constexpr CodecKind kCodecKinds[] = {
    {"dispatch", &CodecFractions::dispatch, &LinkCodecCost::dispatch_fraction, &LinkCodecCost::dispatch_s_per_byte},
    {"combine", &CodecFractions::combine, &LinkCodecCost::combine_fraction, &LinkCodecCost::combine_s_per_byte},
    {"expert_gather", &CodecFractions::gather, &LinkCodecCost::gather_fraction, &LinkCodecCost::gather_s_per_byte},
    {"expert_grad", &CodecFractions::grad, &LinkCodecCost::grad_fraction, &LinkCodecCost::grad_s_per_byte},
};

}  // namespace

std::optional<PlanChange> Replanner::refit_codecs(int64_t step) {
  const size_t levels = inputs_.link_codecs.size();
  std::vector<CodecFractions> assumed(levels), fitted(levels);
  std::string what = "codec bytes measured";
  bool moved = false;  // some kind's fraction, and with it `what`
  for (size_t l = 0; l < levels; ++l) {
    const LinkCodecCost& cost = inputs_.link_codecs[l];
    for (const CodecKind& k : kCodecKinds) {
      assumed[l].*k.measured = fitted[l].*k.measured = cost.*k.fraction;
      // Raw traffic is not fitted: its bytes on the wire are the tensors'.
      if (cost.*k.fraction == 1 && cost.*k.s_per_byte == 0) continue;
      // The kind's fraction in each step of the window; a step that sent
      // none of it leaves it as assumed.
      std::vector<double> kind;
      for (const std::vector<CodecFractions>& w : codec_window_)
        if (l < w.size() && w[l].*k.measured > 0) kind.push_back(w[l].*k.measured);
      if (kind.size() < codec_window_.size()) continue;
      const std::optional<double> f = drifted_mean(kind, cost.*k.fraction);
      if (!f) continue;
      char one[128];
      std::snprintf(one, sizeof one, "%s %s %s %.3g (assumed %.3g)", moved ? "," : "",
                    l < names_.size() ? names_[l].c_str() : std::to_string(l).c_str(), k.name, *f,
                    cost.*k.fraction);
      what += one;
      fitted[l].*k.measured = *f;
      moved = true;
    }
  }
  if (!moved) return std::nullopt;
  PlannerInputs next_inputs = inputs_;
  for (size_t l = 0; l < levels; ++l)
    for (const CodecKind& k : kCodecKinds) next_inputs.link_codecs[l].*k.fraction = fitted[l].*k.measured;
  std::optional<Plan> next = predict_current(next_inputs);
  if (!next) return std::nullopt;
  PlanChange c = refit_change(step, "codecs", *next);
  c.assumed_codec_fractions = assumed;
  c.measured_codec_fractions = fitted;
  c.reason = what + " of the fp32 bytes; the prediction follows";
  adopt_refit(std::move(*next), std::move(next_inputs), &codec_window_, &codec_refits_);
  return c;
}

PlanChange Replanner::refit_change(int64_t step, const char* what, const Plan& next) const {
  PlanChange c;
  c.at_step = step;
  c.link = what;
  c.old_domains = c.new_domains = plan_.choice().domain_sizes;
  c.old_schedule = c.new_schedule = schedule_;
  c.old_predicted_s = plan_.choice().iteration_s;
  c.old_now_predicted_s = c.new_predicted_s = next.choice().iteration_s;
  return c;
}

std::optional<Plan> Replanner::predict_current(PlannerInputs fitted) const {
  fitted.expert_parallel.pipeline_degree = schedule_.pipeline_degree;
  fitted.expert_parallel.backward_pipeline_degree = schedule_.backward_pipeline_degree;
  fitted.expert_parallel.replica_weight_gradients = replica_weight_gradients_of(schedule_.replica_weights_late);
  Plan next = plan_iteration(fitted);
  for (size_t i = 0; i < next.candidates.size(); ++i)
    if (next.candidates[i].domain_sizes == plan_.choice().domain_sizes) {
      next.chosen = static_cast<int>(i);
      return next;
    }
  return std::nullopt;
}

int64_t Replanner::lead_steps(double step_s) const {
  int64_t lead = options_.lead_steps;
  if (step_s > 0) lead = std::max<int64_t>(lead, 2 + static_cast<int64_t>(std::ceil(options_.lead_seconds / step_s)));
  return lead;
}

double Replanner::mean_step_s(int64_t first, int64_t last) const {
  double sum = 0;
  int n = 0;
  for (int64_t s = first; s <= last; ++s)
    if (auto it = step_times_.find(s); it != step_times_.end()) {
      sum += it->second;
      ++n;
    }
  return n > 0 ? sum / n : 0.0;
}

std::optional<PlanChange> Replanner::check_switch(int64_t step, int64_t latest_step, int64_t last_step,
                                                  double step_s) {
  // The new plan's first step also rebuilds the exchange and gathers anew:
  // judge it on the window_steps after that one.
  if (!switch_ || step < switch_->from_step + options_.window_steps) return std::nullopt;
  const Switch sw = *switch_;
  switch_.reset();
  const double after = mean_step_s(sw.from_step + 1, sw.from_step + options_.window_steps);
  // The old plan's last steps before the switch, under the same link (the
  // fit's window if those are missing).
  double before = mean_step_s(sw.from_step - options_.window_steps, sw.from_step - 1);
  if (!(before > 0)) before = sw.before_s;
  if (!(before > 0) || !(after > (1.0 + options_.revert_margin) * before)) return std::nullopt;
  const int64_t from = latest_step + lead_steps(step_s);
  PlanChange c;
  c.at_step = step;
  c.old_domains = plan_.choice().domain_sizes;
  c.old_schedule = schedule_;
  c.old_predicted_s = plan_.choice().iteration_s;
  c.old_now_predicted_s = after;
  c.new_domains = sw.old_plan.choice().domain_sizes;
  c.new_schedule = sw.old_schedule;
  c.new_predicted_s = before;
  char why[240];
  std::snprintf(why, sizeof why, "the new plan measured %.1f ms per step against %.1f ms for the one it replaced; %s",
                after * 1e3, before * 1e3, from <= last_step ? "back to that one" : "too close to the end to go back");
  c.reason = why;
  if (from > last_step) {  // said, not done
    c.new_domains = c.old_domains;
    c.new_schedule = c.old_schedule;
    history_.push_back(c);
    return c;
  }
  c.from_step = from;
  c.reverted = true;
  plan_ = sw.old_plan;
  schedule_ = sw.old_schedule;
  quiet_until_ = from + 1;
  clear_windows();
  history_.push_back(c);
  return c;
}

}  // namespace xd
