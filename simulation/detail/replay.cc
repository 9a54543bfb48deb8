#include "simulation/detail/replay.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "common/check.h"

namespace xd::detail {

void Replay::build() {
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
      std::string name = "w";  // appended, not "w" + ...: GCC 12 misreads that as an overlapping copy
      name += std::to_string(m);
      name += "-l";
      name += std::to_string(l);
      sg4::Host* h = zone->create_host(name, 1e9)->seal();
      // Latency is added on arrival (Replay::deliver), so that messages
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

BatchPtr Replay::queue_batch(int m, int seq, int p, CommPhase phase) {
  auto b = std::make_shared<Batch>();
  b->worker = m;
  b->stream = s_.comms[seq % comms()].stream;
  b->key = phase_key(seq, p);
  const int step = seq / comms();
  workers_[m].link_bytes[step][phase.level] += phase.mean_bytes;
  if (phase.level == 0 && (in_.uplink_bytes_per_s > 0 || in_.backbone_bytes_per_s > 0))
    uplink_bytes_[size_t(step) * dcs_ + traffic_.topology().coordinate(m, 0)] +=
        phase.mean_bytes;
  b->phase = std::move(phase);
  workers_[m].links[b->phase.level].push_back(b);
  workers_[m].link_cv[b->phase.level]->notify_one();
  return b;
}

// A started communication joins its stream. The expert all-gathers and
// replica gradients send their first level at once, from the runtime's
// sender thread, not behind the stream's earlier receives.
void Replay::start(int m, int seq) {
  const ScheduledComm& c = s_.comms[seq % comms()];
  if (c.kind == CommKind::kExpertGather || c.kind == CommKind::kReplicaGradients) {
    std::vector<CommPhase> phases = traffic_.phases(c, m);
    if (!phases.empty()) workers_[m].first_phase[seq] = queue_batch(m, seq, 0, std::move(phases[0]));
  }
  workers_[m].streams[c.stream].push_back(seq);
  workers_[m].stream_cv[c.stream]->notify_one();
}

void Replay::compute_actor(int m) {
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
  ++finished_;
}

bool Replay::arrived(int m, const Batch& b) {
  if (aggregate_) {
    Group& g = groups_[group_key(b)];
    return g.arrivals.got >= simulated_members(b.phase);
  }
  auto it = workers_[m].arrivals.find(b.key);
  return it != workers_[m].arrivals.end() && it->second.got >= (int)b.phase.sends.size();
}

void Replay::stream_actor(int m, int stream) {
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

void Replay::deliver(const Batch& b, double now) {
  const int stream = b.stream;
  const int level = b.phase.level;
  const double overhead = level < (int)in_.hop_overhead_s.size() ? in_.hop_overhead_s[level] : 0.0;
  const double due = now + in_.links[level].alpha_s + overhead;
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

void Replay::link_actor(int m, int level) {
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

void Replay::run() { sg4::Engine::get_instance()->run(); }

SimulationResult Replay::result() const {
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
    double inter_dc_bytes = 0;
    for (int g = 0; g < dcs; ++g) inter_dc_bytes += uplink_bytes_[size_t(step) * dcs + g];
    if (in_.uplink_bytes_per_s > 0)
      for (int g = 0; g < dcs; ++g)
        st.busiest_link_s = std::max(st.busiest_link_s, uplink_bytes_[size_t(step) * dcs + g] / in_.uplink_bytes_per_s);
    // The backbone carries the simulated DCs' share of it at their share of its rate.
    if (in_.backbone_bytes_per_s > 0)
      st.busiest_link_s = std::max(
          st.busiest_link_s,
          inter_dc_bytes / (in_.backbone_bytes_per_s * double(dcs_) / traffic_.topology().level_sizes()[0]));
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


}  // namespace xd::detail
