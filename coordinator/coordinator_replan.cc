// The coordinator's live re-planning (coordinator/detail/coordinator_impl.h):
// each complete step's measurements go to the replanner, and a new plan goes
// to the workers.
#include <cstdio>

#include "common/log.h"
#include "cluster/protocol.h"
#include "coordinator/detail/coordinator_impl.h"

namespace xd {

namespace {
std::string domains_text(const std::vector<int>& d) {
  std::string s = "[";
  for (size_t i = 0; i < d.size(); ++i) {
    if (i) s += ',';
    s += std::to_string(d[i]);
  }
  return s + "]";
}
}  // namespace

std::vector<CodecFractions> Coordinator::Impl::codec_fractions(const StepSummary& s) const {
  // Bytes on the wire over the fp32 bytes before any codec, summed over the
  // workers (docs/compression.md, "What the metrics show").
  auto fraction = [&](const std::string& wire, const std::string& raw) {
    const auto w = s.bytes.find(wire), r = s.bytes.find(raw);
    return w != s.bytes.end() && r != s.bytes.end() && r->second > 0 ? w->second / r->second : 0.0;
  };
  std::vector<CodecFractions> out;
  for (const LevelSpec& l : job.cluster.levels) {
    const std::string& n = l.link.name;
    out.push_back({fraction(n + "/moe_dispatch", n + "/moe_dispatch_raw"),
                   fraction(n + "/moe_combine", n + "/moe_combine_raw"),
                   fraction(n + "/expert_gather", n + "/expert_gather_raw"),
                   fraction(n + "/expert_grad", n + "/expert_grad_raw")});
  }
  return out;
}

void Coordinator::Impl::consider_replan() {
  const StepSummary* s = metrics.last_complete();
  if (!replanner || !s || s->step <= last_replan_step || state != JobState::kRunning) return;
  last_replan_step = s->step;
  std::vector<double> imbalance;  // per level; 0 where no token crossed it
  for (const LevelSpec& l : job.cluster.levels) imbalance.push_back(s->a2a_imbalance(l.link.name));
  auto c = replanner->on_step(s->step, s->link_bursts, metrics.latest_step(), job.train.steps, s->step_s,
                              s->compute_s, imbalance, codec_fractions(*s));
  if (!c) return;
  plan = replanner->plan();
  plan_inputs = replanner->inputs();
  metrics.set_predicted_step(c->switched() ? c->from_step : c->at_step + 1, plan.choice().iteration_s);
  if (c->model_refit()) {  // the progress lines' "predicted" moves; the console stays quiet
    XD_LOG_INFO("coordinator", "re-fit after step %lld: %s: %.1f ms a step (%.1f ms before)", (long long)c->at_step,
                c->reason.c_str(), c->new_predicted_s * 1e3, c->old_predicted_s * 1e3);
    return;
  }
  progress.clear();
  const std::string old_schedule = c->old_schedule.text(), new_schedule = c->new_schedule.text();
  if (!c->switched()) {
    std::printf("re-plan after step %lld: %s: %s r=%s stays (predicted %.1f ms, %.1f ms before)\n",
                (long long)c->at_step, c->reason.c_str(), domains_text(c->old_domains).c_str(), old_schedule.c_str(),
                c->old_now_predicted_s * 1e3, c->old_predicted_s * 1e3);
    std::fflush(stdout);
    return;
  }
  if (c->reverted)
    std::printf("re-plan after step %lld: %s: %s r=%s from step %lld\n", (long long)c->at_step, c->reason.c_str(),
                domains_text(c->new_domains).c_str(), new_schedule.c_str(), (long long)c->from_step);
  else
    std::printf("re-plan after step %lld: %s: domains %s r=%s (predicted %.1f ms before, %.1f ms now) -> %s r=%s "
                "(predicted %.1f ms) from step %lld\n",
                (long long)c->at_step, c->reason.c_str(), domains_text(c->old_domains).c_str(), old_schedule.c_str(),
                c->old_predicted_s * 1e3, c->old_now_predicted_s * 1e3, domains_text(c->new_domains).c_str(),
                new_schedule.c_str(), c->new_predicted_s * 1e3, (long long)c->from_step);
  std::fflush(stdout);
  const PlanUpdate update{c->from_step, c->new_domains, c->new_schedule.pipeline_degree,
                          c->new_schedule.backward_pipeline_degree, c->new_predicted_s, c->reason,
                          c->new_schedule.replica_weights_late};
  for (const auto& e : registry.workers())
    if (e && e->state == WorkerState::kRunning) workers->send(e->peer_id, MessageKind::kControl, to_json(update));
}

nlohmann::json Coordinator::Impl::plan_changes_json() const {
  nlohmann::json changes = nlohmann::json::array();
  if (!replanner) return changes;
  for (const PlanChange& c : replanner->history())
    changes.push_back({{"after_step", c.at_step}, {"from_step", c.from_step}, {"switched", c.switched()},
                       {"link", c.link}, {"assumed_bytes_per_s", c.assumed_bytes_per_s},
                       {"measured_bytes_per_s", c.measured_bytes_per_s}, {"old_domain_sizes", c.old_domains},
                       {"new_domain_sizes", c.new_domains}, {"old_pipeline_degree", c.old_schedule.pipeline_degree},
                       {"new_pipeline_degree", c.new_schedule.pipeline_degree},
                       {"old_backward_pipeline_degree", c.old_schedule.backward_pipeline_degree},
                       {"new_backward_pipeline_degree", c.new_schedule.backward_pipeline_degree},
                       {"old_replica_weights_late", c.old_schedule.replica_weights_late},
                       {"new_replica_weights_late", c.new_schedule.replica_weights_late}, {"reverted", c.reverted},
                       {"old_predicted_s", c.old_predicted_s},
                       {"old_now_predicted_s", c.old_now_predicted_s}, {"new_predicted_s", c.new_predicted_s},
                       {"reason", c.reason}});
  return changes;
}

}  // namespace xd
