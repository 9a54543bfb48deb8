// Routing probe: how unevenly a job's token all-to-alls load their hops when
// training starts. Token-choice routing at initial weights already sends
// some experts more rows than others, so at a hop one worker sends more rows
// than it receives and its peer the reverse; the hop holds the link as long
// as its larger side. probe_routing() builds the job's whole model at its
// seed's initial weights (what every worker starts from), runs the forward
// of each worker's first batch (the rows its sampler draws first, routed as
// in training) and counts the rows each worker sends to each routed expert
// of each layer. routed_a2a_imbalance() walks those rows through one
// topology's Dispatch hops (Topology::dispatch_coordinate, the rule
// HybridExpertExchange follows) and gives, per level, the planner's A2A
// imbalance F: the sum over workers and layers of max(rows sent, rows
// received) over the rows sent; routed_expert_load() the rows each
// worker's experts compute. A run measures the same A2A quantity
// (LINK/moe_peak_raw over its raw token bytes); at one chunk a hop, with
// each worker's whole batch probed, step 1 measures exactly this. Training moves the routing, so the coordinator
// re-fits F from what the run measures (coordinator/replanner.h).
// Costs one forward of min(max_tokens, every worker's batch) tokens, fewer
// where that would take more than about max_seconds, and the whole model's
// parameters and gradients (twice its size) in this process. Plain
// computation; not thread-safe against other GEMMs of this process.
#pragma once

#include <vector>

#include "cluster/job_config.h"
#include "cluster/topology.h"
#include "common/status.h"
#include "coordinator/planner.h"

namespace xd {

struct RoutingProbeOptions {
  long long max_tokens = 16384;        // over all workers: fewer sequences from each when the batches hold more
  // The whole model's fp32 parameters (held with their gradients); a
  // larger model is not probed.
  double max_param_bytes = 1024.0e6;
  // About this long in all (one sequence is timed first): fewer sequences
  // from each worker when the model is slow; at least one each. 0: no limit.
  double max_seconds = 2.0;
};

struct RoutingProbe {
  int workers = 0, layers = 0, experts = 0;
  long long tokens_per_worker = 0;  // routed of each worker's first batch
  double seconds = 0;               // the probe's wall time
  std::vector<long long> rows;      // (workers, layers, experts): rows each worker's tokens send each expert
  long long at(int worker, int layer, int expert) const {
    return rows[(static_cast<size_t>(worker) * layers + layer) * experts + expert];
  }
};

// Errors: the job's training data cannot be read here (a corpus only the
// workers' hosts have), or the model exceeds options.max_param_bytes.
Expected<RoutingProbe> probe_routing(const JobConfig& job, const RoutingProbeOptions& options = {});

// Per level of `topology` (whose world size is probe.workers), F >= 1; 1 at
// a level no row crosses. Each worker owns experts / workers consecutive
// experts of every layer.
std::vector<double> routed_a2a_imbalance(const RoutingProbe& probe, const Topology& topology);

// The rows the routed experts of `topology`'s workers compute (those a
// worker holds after Dispatch) over the mean worker's, summed over layers:
// each layer's most (every layer's exchanges wait for its busiest worker)
// and the busiest worker's own sum. 1 and 1 where every worker computes its
// own rows (every expert gathered everywhere).
ExpertLoad routed_expert_load(const RoutingProbe& probe, const Topology& topology);

}  // namespace xd
