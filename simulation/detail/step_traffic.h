// What one worker's step costs in the simulator: the seconds of each compute
// span and, for each scheduled communication, its phases -- which link class,
// to whom and how many bytes -- from the planner's Workload and the
// HybridEP Topology (the same pair rule the runtime's exchanges follow).
// Pure functions; thread-safe.
#pragma once

#include <array>
#include <cstdint>
#include <utility>
#include <vector>

#include "cluster/topology.h"
#include "coordinator/planner.h"
#include "simulation/simulator.h"
#include "simulation/step_schedule.h"

namespace xd::detail {

// One step of a communication: this worker's messages on one level, all
// sent at once; the phase is done when they have left and every message
// addressed to this worker in the same phase has arrived.
struct CommPhase {
  int level = 0;
  std::vector<std::pair<int, double>> sends;  // (peer rank, bytes)
  double bytes = 0;                           // their sum
  double mean_bytes = 0;  // the sum at uniform routing: what the bound counts
  // The peers that exchange in this phase, as one group: its lowest rank
  // and its size (this worker included); aggregate flows complete by group.
  // Along the phase's level the members' coordinates are
  // group_first + i * group_stride, i < group_size.
  int group_root = 0, group_size = 1;
  int group_first = 0, group_stride = 1;
};

class StepTraffic {
 public:
  StepTraffic(const SimulationInputs& in, const StepSchedule& schedule);

  double compute_seconds(ComputeKind kind) const;
  // Phases of `comm` for worker `rank`, in order; empty: nothing to send
  // (for example an A2A in a domain that spans the whole level).
  std::vector<CommPhase> phases(const ScheduledComm& comm, int rank) const;
  const Topology& topology() const { return topo_; }
  // Experts a worker computes per layer, its own and gathered.
  double held_experts() const { return held_; }

 private:
  void a2a_phases(int rank, double bytes, bool outer_first, bool dispatch_codec, std::vector<CommPhase>* out) const;
  void expert_phases(int rank, bool gather, std::vector<CommPhase>* out) const;
  void dense_phases(int rank, double bytes, std::vector<CommPhase>* out) const;
  void norm_phases(int rank, std::vector<CommPhase>* out) const;
  double fraction(int level, CommKind kind) const;

  const SimulationInputs& in_;
  Topology topo_;
  int r_ = 1;
  double held_ = 1;
  // The token bytes each hop carries over one row per expert: {toward the
  // experts, back to the sources} (grouped_row_share; {1, 1} a row per expert).
  std::array<double, 2> token_share_{1.0, 1.0};
  double gathered_ = 1;        // experts held per owned one (the domain sizes' product)
  bool defers_owned_ = false;  // owned experts' weight gradients at the end (StepSchedule)
  bool defers_replicas_ = false;  // the replicas' too, before them
  bool defers_first_layer_ = false;  // without replicas, layer 0's alone (StepSchedule)
};

}  // namespace xd::detail
