// simulate_steps: replays a job's training steps on SimGrid's flow-level
// network model (docs/simulation.md).
//
// The platform has one host per worker and level (its network interface for
// that level's link class) with an egress link of the level's bandwidth, an
// optional uplink per outermost group (a datacenter; one link each way) and
// an optional backbone that every inter-DC flow crosses. Ingress is not
// limited, as with the runtime's sender-side shaping. Each worker runs the
// StepSchedule recorded from the model (simulation/step_schedule.h): a
// compute actor sleeps through compute spans priced by the planner's
// Workload and starts and waits for communications; one actor per comm
// stream moves its communications first in, first out, phase by phase (the
// levels of a hierarchical A2A, AG or RS; the reduce-scatter and all-gather
// phases of a dense bucket, ring rounds from the Communicator's ring
// threshold); one actor per egress link sends a phase's messages first in,
// first out, like the runtime's per-class token bucket, with the level's
// latency added on arrival. Who sends to whom comes from Topology, so every
// level's traffic stays on its link class as in the runtime.
//
// Flows: kPairs sends one SimGrid flow per message (what the runtime sends);
// kAggregate sends one flow per worker and phase carrying all its messages,
// and a phase completes when every member of the group has sent. The two are
// the same while the bottleneck is a sender's egress or an uplink; kAggregate
// does not see a receiver's downlink and exists so that 1000 datacenters fit
// in a minute. kAuto takes kPairs up to kMaxPairFlows flows per exchange
// (SimGrid slows down with many thousands of concurrent flows).
//
// Symmetry: every datacenter runs the same schedule on the same links, so
// every one behaves alike. With simulated_dcs K below the number of
// datacenters only the first K are simulated (aggregate flows; a group
// completes when its simulated members have sent, the backbone is scaled
// to K / DCs of its rate). This is exact for the symmetric jobs xdmoe runs
// (a test compares it with the whole platform) and is what lets 1000
// datacenters fit in a minute; kAuto simulates every datacenter up to
// kMaxFullDcs (all of them with kPairs).
//
// SimGrid's engine is a process-wide singleton: simulate_steps runs at most
// once per process (a second call returns an error). Not thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"
#include "coordinator/planner.h"
#include "simulation/step_schedule.h"

namespace xd {

enum class FlowGranularity : int { kAuto = 0, kPairs = 1, kAggregate = 2 };
const char* flow_granularity_name(FlowGranularity f);  // "auto", "pairs", "aggregate"
Expected<FlowGranularity> parse_flow_granularity(const std::string& s);

struct SimulationInputs {
  Workload workload;                       // durations and bytes per worker (planner)
  std::vector<int> level_sizes;            // SF^0..
  std::vector<int> domain_sizes;           // S^0..
  std::vector<LinkModel> links;            // per level: latency, 1 / egress bandwidth
  std::vector<LinkCodecCost> link_codecs;  // per level, or empty: raw
  std::vector<double> dense_bucket_bytes;  // per bucket of the dense all-reduce (fp32)
  double uplink_bytes_per_s = 0;           // per outermost group and direction; 0: unlimited
  double backbone_bytes_per_s = 0;         // shared by all inter-group flows; 0: unlimited
  // Per level, or empty: 1. Routing is not uniform: at each hop of a token
  // A2A a worker sends or receives more rows than the mean, and the hop lasts
  // as long as its larger side. The factor (>= 1) is the mean over hops of
  // max(rows sent, rows received) / mean rows sent, as a run measures it
  // (`LINK/moe_peak_raw` over `LINK/moe_dispatch_raw + LINK/moe_combine_raw`
  // in its summary). Simulated A2A messages carry that many times the mean
  // bytes; the bound keeps the mean.
  std::vector<double> a2a_imbalance;
  // Per level, or empty: 0. What each hop of a collective on that level costs
  // beyond its bytes and latency: packing, copying and the wake-ups of the
  // threads that move it, which the network model does not see (it grows
  // with the workers sharing a core). Added to the arrival of every phase on
  // the level. A traced run measures it: a hop's span less its bytes' time
  // and the latency (docs/simulation.md, "Per-hop overhead").
  std::vector<double> hop_overhead_s;
  int steps = 1;
  FlowGranularity flows = FlowGranularity::kAuto;
  int simulated_dcs = 0;  // outermost groups simulated; 0: auto
  // > 0: every worker computes on one machine with this many cores (all the
  // workers on one host, as in a test on one machine): SimGrid shares the
  // cores among the compute spans that run at once. 0: each worker has its
  // own accelerator.
  int machine_cores = 0;
  static constexpr int kMaxFullDcs = 64, kAutoSimulatedDcs = 16;
  std::vector<std::string> simgrid_config;  // extra --cfg=key:value settings
  static constexpr int64_t kMaxPairFlows = 4096;

  Status validate(const StepSchedule& schedule) const;
};

struct SimulatedStep {
  double step_s = 0;
  double compute_s = 0;       // the busiest worker's compute
  double busiest_link_s = 0;  // transmit time of the busiest egress link, uplink or backbone
  double bound_s = 0;         // max(compute, busiest link)
  double fwd_exposed_s = 0, bwd_exposed_s = 0;  // mean over workers: compute waiting on communication
  double overlap_percent = 0;  // 1 - exposed / max(busiest link, exposed)
};

struct SimulationResult {
  std::vector<SimulatedStep> steps;
  FlowGranularity flows = FlowGranularity::kPairs;
  int simulated_dcs = 0;    // of the outermost level's groups
  int simulated_workers = 0;
  int64_t flow_count = 0;  // SimGrid flows created
  int64_t actors = 0;
  double wall_s = 0;        // the simulation's own run time
  double peak_rss_bytes = 0;
  double mean_step_s() const;  // after the first step when there are several
};

// The compute of one step of one worker: the sum of the schedule's compute
// spans as the simulator prices them (no SimGrid; callable any number of times).
double schedule_compute_seconds(const StepSchedule& schedule, const SimulationInputs& in);

Expected<SimulationResult> simulate_steps(const StepSchedule& schedule, const SimulationInputs& in);

}  // namespace xd
