// Replay: the SimGrid actors of simulate_steps (simulation/simulator.h) --
// the platform, each worker's compute, comm-stream and egress-link actors,
// and the per-step figures they leave. One instance per simulation; build()
// before run(), result() after. SimGrid actors are cooperative, so the
// state below is touched by one actor at a time; not thread-safe.
#pragma once

#include <simgrid/s4u.hpp>

#include <cstdint>
#include <deque>
#include <memory>
#include <unordered_map>
#include <utility>
#include <vector>

#include "simulation/detail/step_traffic.h"
#include "simulation/simulator.h"
#include "simulation/step_schedule.h"

namespace xd::detail {

namespace sg4 = simgrid::s4u;


// One phase's messages queued on one egress link.
struct Batch {
  int worker = 0;
  int stream = 0;  // whose stream waits for it
  uint64_t key = 0;  // (communication sequence number, phase)
  CommPhase phase;
  bool sent = false;
};
using BatchPtr = std::shared_ptr<Batch>;

struct Arrivals {
  int got = 0;
  double due = 0;  // the latest arrival, latency included
};

struct Worker {
  // One mutex; a condition variable per actor, so that an event wakes only
  // the actor it concerns.
  sg4::MutexPtr mu;
  sg4::ConditionVariablePtr compute_cv, stream_cv[kNumCommStreams];
  std::vector<sg4::ConditionVariablePtr> link_cv;  // per level
  std::vector<char> done;                         // per communication sequence number
  std::deque<int> streams[kNumCommStreams];       // sequence numbers, first in first out
  std::unordered_map<int, BatchPtr> first_phase;  // sent when started (expert streams)
  std::vector<std::deque<BatchPtr>> links;        // per level
  std::unordered_map<uint64_t, Arrivals> arrivals;
  std::vector<double> compute_s, fwd_exposed_s, bwd_exposed_s, step_end_s;
  std::vector<std::vector<double>> link_bytes;  // [step][level]
};

struct Group {
  Arrivals arrivals;
  std::vector<std::pair<int, int>> waiters;  // (worker, stream)
  int consumed = 0;
};

inline uint64_t phase_key(int seq, int phase) { return (uint64_t(seq) << 24) | uint64_t(phase); }
// A phase's group: at most 2^16 workers (Topology) and 16 levels.
inline uint64_t group_key(const Batch& b) {
  return (b.key << 20) | (uint64_t(b.phase.level) << 16) | uint64_t(b.phase.group_root);
}


class Replay {
 public:
  Replay(const StepSchedule& s, const SimulationInputs& in, bool aggregate, int dcs)
      : s_(s), in_(in), traffic_(in, s), aggregate_(aggregate), dcs_(dcs) {
    workers_count_ = dcs * (traffic_.topology().world_size() / traffic_.topology().level_sizes()[0]);
  }

  void build();
  void run();
  SimulationResult result() const;

 private:
  int world() const { return workers_count_; }  // simulated: ranks 0.. of the first dcs_ groups
  // Of a phase's group, the members simulated (by symmetry the others act alike).
  int simulated_members(const CommPhase& p) const {
    if (p.level != 0 || dcs_ == traffic_.topology().level_sizes()[0]) return p.group_size;
    int n = 0;
    for (int i = 0; i < p.group_size && p.group_first + i * p.group_stride < dcs_; ++i) ++n;
    return n;
  }
  int levels() const { return traffic_.topology().num_levels(); }
  int comms() const { return static_cast<int>(s_.comms.size()); }

  void start(int m, int seq);
  BatchPtr queue_batch(int m, int seq, int p, CommPhase phase);
  void compute_actor(int m);
  void stream_actor(int m, int stream);
  void link_actor(int m, int level);
  void deliver(const Batch& b, double now);
  bool arrived(int m, const Batch& b);

  const StepSchedule& s_;
  const SimulationInputs& in_;
  detail::StepTraffic traffic_;
  bool aggregate_;
  int dcs_ = 1, workers_count_ = 1;
  std::vector<Worker> workers_;
  std::vector<std::vector<sg4::Host*>> nic_;  // [worker][level]
  std::vector<sg4::Host*> sink_;              // per level (aggregate flows)
  sg4::Host* machine_ = nullptr;              // machine_cores > 0: where every worker computes
  std::vector<double> uplink_bytes_;          // [step * groups + group], outgoing
  std::unordered_map<uint64_t, Group> groups_;
  int64_t flows_ = 0, actors_ = 0;
  int finished_ = 0;  // compute actors through every step

 public:
  bool all_finished() const { return finished_ == world(); }
};


}  // namespace xd::detail
