#include "simulation/simulator.h"

#include <simgrid/s4u.hpp>
#include <xbt/log.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <deque>
#include <memory>
#include <unordered_map>

#include "common/check.h"
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

using detail::CommPhase;

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

uint64_t phase_key(int seq, int phase) { return (uint64_t(seq) << 24) | uint64_t(phase); }
// A phase's group: at most 2^16 workers (Topology) and 16 levels.
uint64_t group_key(const Batch& b) {
  return (b.key << 20) | (uint64_t(b.phase.level) << 16) | uint64_t(b.phase.group_root);
}

class Simulation {
 public:
  Simulation(const StepSchedule& s, const SimulationInputs& in, bool aggregate, int dcs)
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
};

void Simulation::build() {
  const Topology& topo = traffic_.topology();
  sg4::NetZone* zone = sg4::create_star_zone("world");
  // Down routes are empty: ingress is not limited.
  const int dcs = dcs_;
  std::vector<sg4::Link*> up(dcs, nullptr), down(dcs, nullptr);
  if (in_.uplink_bytes_per_s > 0)
    for (int g = 0; g < dcs; ++g) {
      up[g] = zone->create_link("uplink-" + std::to_string(g), in_.uplink_bytes_per_s)->seal();
      down[g] = zone->create_link("downlink-" + std::to_string(g), in_.uplink_bytes_per_s)->seal();
    }
  const double backbone_share = double(dcs_) / topo.level_sizes()[0];
  sg4::Link* backbone = in_.backbone_bytes_per_s > 0
                            ? zone->create_link("backbone", in_.backbone_bytes_per_s * backbone_share)->seal()
                            : nullptr;
  nic_.assign(world(), std::vector<sg4::Host*>(levels(), nullptr));
  for (int m = 0; m < world(); ++m)
    for (int l = 0; l < levels(); ++l) {
      const std::string name = "w" + std::to_string(m) + "-l" + std::to_string(l);
      sg4::Host* h = zone->create_host(name, 1e9)->seal();
      // Latency is added on arrival (Simulation::deliver), so that messages
      // queued behind each other pay it once, as behind a token bucket.
      sg4::Link* egress = zone->create_link("egress-" + name, 1.0 / in_.links[l].beta_s_per_byte)->seal();
      std::vector<sg4::LinkInRoute> out{sg4::LinkInRoute(egress)}, in;
      const int dc = topo.coordinate(m, 0);
      if (l == 0 && up[dc]) {
        out.emplace_back(up[dc]);
        in.emplace_back(down[dc]);
      }
      if (l == 0 && backbone) out.emplace_back(backbone);
      zone->add_route(h->get_netpoint(), nullptr, nullptr, nullptr, out, false);
      zone->add_route(nullptr, h->get_netpoint(), nullptr, nullptr, in, false);
      nic_[m][l] = h;
    }
  for (int l = 0; l < levels(); ++l) {
    sg4::Host* h = zone->create_host("sink-l" + std::to_string(l), 1e9)->seal();
    zone->add_route(h->get_netpoint(), nullptr, nullptr, nullptr, {}, false);
    zone->add_route(nullptr, h->get_netpoint(), nullptr, nullptr, {}, false);
    sink_.push_back(h);
  }
  if (in_.machine_cores > 0) machine_ = zone->create_host("machine", 1.0)->set_core_count(in_.machine_cores)->seal();
  zone->seal();

  workers_.resize(world());
  uplink_bytes_.assign(size_t(in_.steps) * dcs, 0.0);
  for (int m = 0; m < world(); ++m) {
    Worker& w = workers_[m];
    w.mu = sg4::Mutex::create();
    w.compute_cv = sg4::ConditionVariable::create();
    for (auto& cv : w.stream_cv) cv = sg4::ConditionVariable::create();
    for (int l = 0; l < levels(); ++l) w.link_cv.push_back(sg4::ConditionVariable::create());
    w.done.assign(size_t(in_.steps) * comms(), 0);
    w.links.resize(levels());
    w.compute_s.assign(in_.steps, 0);
    w.fwd_exposed_s.assign(in_.steps, 0);
    w.bwd_exposed_s.assign(in_.steps, 0);
    w.step_end_s.assign(in_.steps, 0);
    w.link_bytes.assign(in_.steps, std::vector<double>(levels(), 0.0));
    sg4::Actor::create("compute-" + std::to_string(m), nic_[m][0], [this, m] { compute_actor(m); });
    for (int k = 0; k < kNumCommStreams; ++k)
      sg4::Actor::create("stream", nic_[m][0], [this, m, k] { stream_actor(m, k); })->daemonize();
    for (int l = 0; l < levels(); ++l)
      sg4::Actor::create("link", nic_[m][l], [this, m, l] { link_actor(m, l); })->daemonize();
    actors_ += 1 + kNumCommStreams + levels();
  }
}

BatchPtr Simulation::queue_batch(int m, int seq, int p, CommPhase phase) {
  auto b = std::make_shared<Batch>();
  b->worker = m;
  b->stream = s_.comms[seq % comms()].stream;
  b->key = phase_key(seq, p);
  const int step = seq / comms();
  workers_[m].link_bytes[step][phase.level] += phase.bytes;
  if (phase.level == 0 && in_.uplink_bytes_per_s > 0)
    uplink_bytes_[size_t(step) * dcs_ + traffic_.topology().coordinate(m, 0)] +=
        phase.bytes;
  b->phase = std::move(phase);
  workers_[m].links[b->phase.level].push_back(b);
  workers_[m].link_cv[b->phase.level]->notify_one();
  return b;
}

// A started communication joins its stream. The expert all-gathers and
// replica gradients send their first level at once, from the runtime's
// sender thread, not behind the stream's earlier receives.
void Simulation::start(int m, int seq) {
  const ScheduledComm& c = s_.comms[seq % comms()];
  if (c.kind == CommKind::kExpertGather || c.kind == CommKind::kReplicaGradients) {
    std::vector<CommPhase> phases = traffic_.phases(c, m);
    if (!phases.empty()) workers_[m].first_phase[seq] = queue_batch(m, seq, 0, std::move(phases[0]));
  }
  workers_[m].streams[c.stream].push_back(seq);
  workers_[m].stream_cv[c.stream]->notify_one();
}

void Simulation::compute_actor(int m) {
  Worker& w = workers_[m];
  for (int step = 0; step < in_.steps; ++step) {
    bool backward = false;
    for (const StepOp& op : s_.ops) {
      if (op.type == StepOp::Type::kCompute) {
        // On a shared machine a span takes longer while others compute too.
        const double d = traffic_.compute_seconds(op.compute), t0 = sg4::Engine::get_clock();
        if (d > 0 && machine_) sg4::Exec::init()->set_flops_amount(d)->set_host(machine_)->start()->wait();
        else if (d > 0) sg4::this_actor::sleep_for(d);
        w.compute_s[step] += sg4::Engine::get_clock() - t0;
        if (op.compute == ComputeKind::kHead) backward = true;
      } else if (op.type == StepOp::Type::kStart) {
        start(m, step * comms() + op.comm);
      } else {
        const int seq = step * comms() + op.comm;
        const double t0 = sg4::Engine::get_clock();
        std::unique_lock<sg4::Mutex> lock(*w.mu);
        while (!w.done[seq]) w.compute_cv->wait(lock);
        (backward ? w.bwd_exposed_s : w.fwd_exposed_s)[step] += sg4::Engine::get_clock() - t0;
      }
    }
    w.step_end_s[step] = sg4::Engine::get_clock();
  }
}

bool Simulation::arrived(int m, const Batch& b) {
  if (aggregate_) {
    Group& g = groups_[group_key(b)];
    return g.arrivals.got >= simulated_members(b.phase);
  }
  auto it = workers_[m].arrivals.find(b.key);
  return it != workers_[m].arrivals.end() && it->second.got >= (int)b.phase.sends.size();
}

void Simulation::stream_actor(int m, int stream) {
  Worker& w = workers_[m];
  std::unique_lock<sg4::Mutex> lock(*w.mu);
  for (;;) {
    while (w.streams[stream].empty()) w.stream_cv[stream]->wait(lock);
    const int seq = w.streams[stream].front();
    w.streams[stream].pop_front();
    std::vector<CommPhase> phases = traffic_.phases(s_.comms[seq % comms()], m);
    for (int p = 0; p < (int)phases.size(); ++p) {
      BatchPtr b;
      if (p == 0 && w.first_phase.count(seq)) {
        b = w.first_phase[seq];
        w.first_phase.erase(seq);
      } else {
        b = queue_batch(m, seq, p, phases[p]);
      }
      uint64_t gk = 0;
      if (aggregate_) {
        gk = group_key(*b);
        groups_[gk].waiters.emplace_back(m, stream);
      }
      while (!b->sent || !arrived(m, *b)) w.stream_cv[stream]->wait(lock);
      double due;
      if (aggregate_) {
        Group& g = groups_[gk];
        due = g.arrivals.due;
        if (++g.consumed == simulated_members(b->phase)) groups_.erase(gk);
      } else {
        due = w.arrivals[b->key].due;
        w.arrivals.erase(b->key);
      }
      if (due > sg4::Engine::get_clock()) {
        lock.unlock();
        sg4::this_actor::sleep_until(due);
        lock.lock();
      }
    }
    w.done[seq] = 1;
    w.compute_cv->notify_one();
  }
}

void Simulation::deliver(const Batch& b, double now) {
  const int stream = b.stream;
  const double due = now + in_.links[b.phase.level].alpha_s;
  if (aggregate_) {
    Group& g = groups_[group_key(b)];
    g.arrivals.got++;
    g.arrivals.due = std::max(g.arrivals.due, due);
    if (g.arrivals.got >= simulated_members(b.phase))
      for (auto [worker, stream] : g.waiters) workers_[worker].stream_cv[stream]->notify_one();
    return;
  }
  for (const auto& [peer, bytes] : b.phase.sends) {
    Arrivals& a = workers_[peer].arrivals[b.key];
    a.got++;
    a.due = std::max(a.due, due);
    workers_[peer].stream_cv[stream]->notify_one();
  }
}

void Simulation::link_actor(int m, int level) {
  Worker& w = workers_[m];
  std::unique_lock<sg4::Mutex> lock(*w.mu);
  for (;;) {
    while (w.links[level].empty()) w.link_cv[level]->wait(lock);
    BatchPtr b = w.links[level].front();
    w.links[level].pop_front();
    lock.unlock();
    std::vector<sg4::CommPtr> flows;
    auto bytes_of = [](double x) { return static_cast<uint64_t>(std::max(1.0, std::ceil(x))); };
    if (aggregate_) {
      flows.push_back(sg4::Comm::sendto_async(nic_[m][level], sink_[level], bytes_of(b->phase.bytes)));
    } else {
      for (const auto& [peer, bytes] : b->phase.sends)
        flows.push_back(sg4::Comm::sendto_async(nic_[m][level], nic_[peer][level], bytes_of(bytes)));
    }
    flows_ += static_cast<int64_t>(flows.size());
    sg4::Comm::wait_all(flows);
    lock.lock();
    deliver(*b, sg4::Engine::get_clock());
    b->sent = true;
    w.stream_cv[b->stream]->notify_one();
  }
}

void Simulation::run() { sg4::Engine::get_instance()->run(); }

SimulationResult Simulation::result() const {
  SimulationResult r;
  r.flows = aggregate_ ? FlowGranularity::kAggregate : FlowGranularity::kPairs;
  r.flow_count = flows_;
  r.actors = actors_;
  r.simulated_dcs = dcs_;
  r.simulated_workers = world();
  const int dcs = dcs_;
  double last_end = 0;
  for (int step = 0; step < in_.steps; ++step) {
    SimulatedStep st;
    double end = 0;
    for (const Worker& w : workers_) {
      end = std::max(end, w.step_end_s[step]);
      st.compute_s = std::max(st.compute_s, w.compute_s[step]);
      st.fwd_exposed_s += w.fwd_exposed_s[step] / world();
      st.bwd_exposed_s += w.bwd_exposed_s[step] / world();
      for (int l = 0; l < levels(); ++l)
        st.busiest_link_s = std::max(st.busiest_link_s, w.link_bytes[step][l] * in_.links[l].beta_s_per_byte);
    }
    if (in_.uplink_bytes_per_s > 0)
      for (int g = 0; g < dcs; ++g)
        st.busiest_link_s = std::max(st.busiest_link_s, uplink_bytes_[size_t(step) * dcs + g] / in_.uplink_bytes_per_s);
    st.step_s = end - last_end;
    last_end = end;
    st.bound_s = std::max(st.compute_s, st.busiest_link_s);
    const double exposed = st.fwd_exposed_s + st.bwd_exposed_s;
    const double comm = std::max(st.busiest_link_s, exposed);
    st.overlap_percent = comm > 0 ? 100.0 * (1.0 - exposed / comm) : 0.0;
    r.steps.push_back(st);
  }
  return r;
}

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
  for (const std::string& c : in.simgrid_config) sg4::Engine::set_config(c);

  const Topology topo(in.level_sizes, in.domain_sizes);
  const int all_dcs = topo.level_sizes()[0];
  const int dcs = in.simulated_dcs > 0 ? in.simulated_dcs
                  : all_dcs <= SimulationInputs::kMaxFullDcs ? all_dcs
                                                              : SimulationInputs::kAutoSimulatedDcs;
  // One flow per message unless an exchange would need too many, or some
  // datacenters are left to symmetry.
  bool aggregate = in.flows == FlowGranularity::kAggregate || dcs < all_dcs;
  if (in.flows == FlowGranularity::kAuto && !aggregate) {
    int64_t widest = 0;
    for (int l = 0; l < topo.num_levels(); ++l) widest = std::max<int64_t>(widest, topo.level_sizes()[l] - 1);
    aggregate = int64_t(topo.world_size()) * widest > SimulationInputs::kMaxPairFlows;
  }
  Simulation sim(schedule, in, aggregate, dcs);
  sim.build();
  sim.run();
  SimulationResult r = sim.result();
  r.wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  r.peak_rss_bytes = peak_rss();
  return r;
}

}  // namespace xd
