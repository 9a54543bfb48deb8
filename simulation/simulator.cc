#include "simulation/simulator.h"

#include <simgrid/s4u.hpp>
#include <xbt/log.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>

#include "common/check.h"
#include "simulation/detail/replay.h"
#include "simulation/detail/step_traffic.h"

namespace sg4 = simgrid::s4u;

namespace xd {

const char* flow_granularity_name(FlowGranularity f) {
  switch (f) {
    case FlowGranularity::kAuto: return "auto";
    case FlowGranularity::kPairs: return "pairs";
    case FlowGranularity::kAggregate: return "aggregate";
  }
  return "?";
}

Expected<FlowGranularity> parse_flow_granularity(const std::string& s) {
  if (s == "auto") return FlowGranularity::kAuto;
  if (s == "pairs") return FlowGranularity::kPairs;
  if (s == "aggregate") return FlowGranularity::kAggregate;
  return Status::invalid_argument("flows: expected auto, pairs or aggregate, got '" + s + "'");
}

Status SimulationInputs::validate(const StepSchedule& schedule) const {
  auto bad = [](const std::string& why) { return Status::invalid_argument("simulate: " + why); };
  XD_RETURN_IF_ERROR(Topology::check(level_sizes, domain_sizes).with_context("simulate"));
  if (links.size() != level_sizes.size()) return bad("need one link per level");
  if (!link_codecs.empty() && link_codecs.size() != level_sizes.size()) return bad("need one codec cost per level");
  for (const LinkModel& l : links)
    if (!(l.alpha_s >= 0) || !(l.beta_s_per_byte > 0) || !std::isfinite(l.alpha_s) || !std::isfinite(l.beta_s_per_byte))
      return bad("link latency must be >= 0 and bandwidth positive and finite");
  if (!(uplink_bytes_per_s >= 0) || !(backbone_bytes_per_s >= 0)) return bad("uplink and backbone rates must be >= 0");
  if (!a2a_imbalance.empty() && a2a_imbalance.size() != level_sizes.size())
    return bad("need one A2A imbalance per level");
  for (double f : a2a_imbalance)
    if (!a2a_imbalance_in_range(f)) return bad(kA2aImbalanceRange);
  if (!hop_overhead_s.empty() && hop_overhead_s.size() != level_sizes.size())
    return bad("need one hop overhead per level");
  for (double h : hop_overhead_s)
    if (!(h >= 0) || !std::isfinite(h)) return bad("a hop overhead must be finite and >= 0");
  if (steps < 1) return bad("steps must be >= 1");
  if (machine_cores < 0) return bad("machine cores must be >= 0");
  if (simulated_dcs < 0 || (!level_sizes.empty() && simulated_dcs > level_sizes[0]))
    return bad("simulated datacenters must be between 1 and the outermost level's size (0: auto)");
  if (flows == FlowGranularity::kPairs && simulated_dcs > 0 && !level_sizes.empty() && simulated_dcs < level_sizes[0])
    return bad("flows: pairs needs every datacenter simulated (a message to one not simulated has nowhere to go)");
  for (const ScheduledComm& c : schedule.comms)
    if (c.kind == CommKind::kDenseBucket && (c.chunk < 0 || c.chunk >= (int)dense_bucket_bytes.size()))
      return bad("the schedule has dense bucket " + std::to_string(c.chunk) + " but its bytes were not given");
  return Status::ok();
}

double SimulationResult::mean_step_s() const {
  if (steps.empty()) return 0;
  const size_t first = steps.size() > 1 ? 1 : 0;
  double sum = 0;
  for (size_t i = first; i < steps.size(); ++i) sum += steps[i].step_s;
  return sum / double(steps.size() - first);
}


namespace {

double peak_rss() {
  FILE* f = std::fopen("/proc/self/status", "r");
  if (!f) return 0;
  char line[256];
  double kb = 0;
  while (std::fgets(line, sizeof line, f))
    if (std::sscanf(line, "VmHWM: %lf kB", &kb) == 1) break;
  std::fclose(f);
  return kb * 1024;
}


}  // namespace

double schedule_compute_seconds(const StepSchedule& schedule, const SimulationInputs& in) {
  const detail::StepTraffic traffic(in, schedule);
  double total = 0;
  for (const StepOp& op : schedule.ops)
    if (op.type == StepOp::Type::kCompute) total += traffic.compute_seconds(op.compute);
  return total;
}

Expected<SimulationResult> simulate_steps(const StepSchedule& schedule, const SimulationInputs& in) {
  static bool ran = false;
  if (ran) return Status::internal("simulate: SimGrid runs once per process");
  XD_RETURN_IF_ERROR(in.validate(schedule));
  ran = true;
  const auto t0 = std::chrono::steady_clock::now();
  int argc = 1;
  char name[] = "xdmoe-simulate";
  char* argv[] = {name, nullptr};
  sg4::Engine engine(&argc, argv);
  xbt_log_control_set("root.thresh:warning");
  // A fluid max-min network: every link carries exactly its bandwidth, as
  // the runtime's shaped links do (SimGrid's TCP calibration can be asked
  // for with simgrid_config, for example network/model:LV08).
  sg4::Engine::set_config("network/model:CM02");
  sg4::Engine::set_config("network/latency-factor:1");
  sg4::Engine::set_config("network/bandwidth-factor:1");
  sg4::Engine::set_config("network/crosstraffic:0");
  // Many small actors: small stacks, and no guard pages (each costs a memory
  // mapping; Linux allows 65536 by default).
  sg4::Engine::set_config("contexts/stack-size:32");
  sg4::Engine::set_config("contexts/guard-size:0");
  for (const std::string& c : in.simgrid_config) {
    try {
      sg4::Engine::set_config(c);
    } catch (const std::exception& e) {
      return Status::invalid_argument("simulate: SimGrid setting '" + c + "': " + e.what());
    }
  }

  const Topology topo(in.level_sizes, in.domain_sizes);
  const int all_dcs = topo.level_sizes()[0];
  // Flows per message need every datacenter.
  const int dcs = in.simulated_dcs > 0 ? in.simulated_dcs
                  : all_dcs <= SimulationInputs::kMaxFullDcs || in.flows == FlowGranularity::kPairs
                      ? all_dcs
                      : SimulationInputs::kAutoSimulatedDcs;
  // One flow per message unless an exchange would need too many, or some
  // datacenters are left to symmetry.
  bool aggregate = in.flows == FlowGranularity::kAggregate || dcs < all_dcs;
  if (in.flows == FlowGranularity::kAuto && !aggregate) {
    int64_t widest = 0;
    for (int l = 0; l < topo.num_levels(); ++l) widest = std::max<int64_t>(widest, topo.level_sizes()[l] - 1);
    aggregate = int64_t(topo.world_size()) * widest > SimulationInputs::kMaxPairFlows;
  }
  detail::Replay sim(schedule, in, aggregate, dcs);
  sim.build();
  sim.run();
  if (!sim.all_finished()) return Status::internal("simulate: the simulation stopped before every worker finished");
  SimulationResult r = sim.result();
  r.wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  r.peak_rss_bytes = peak_rss();
  return r;
}

}  // namespace xd
