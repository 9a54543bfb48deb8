#include "coordinator/job_metrics.h"

#include <algorithm>
#include <iterator>
#include <string_view>
#include <cstdio>
#include <sstream>

namespace xd {

void JobMetrics::record(int rank, const StepMetrics& m, const std::string& host) {
  last_by_rank_[rank] = m;
  StepSummary& s = pending_[m.step];
  s.step = m.step;
  s.reporters++;
  s.skipped = s.skipped || m.skipped;
  // Summed in rank order once every rank reported, so that the mean does not
  // depend on the order the reports arrived in.
  auto& losses = pending_losses_[m.step];
  losses.resize(world_);
  losses[rank] = {m.loss, m.ce_loss, m.aux_loss};
  s.tokens_per_s += m.tokens_per_s;
  s.step_s = std::max(s.step_s, m.step_s);
  if (s.reporters == 1 || m.compute_s > s.compute_s) {  // the slowest worker so far
    s.critical_fwd_exposed_s = m.fwd_exposed_s;
    s.critical_bwd_exposed_s = m.bwd_exposed_s;
    s.critical_waits_s = m.waits_s;
  }
  s.compute_s = std::max(s.compute_s, m.compute_s);
  s.compute_min_s = s.reporters == 1 ? m.compute_s : std::min(s.compute_min_s, m.compute_s);
  s.comm_s = std::max(s.comm_s, m.comm_s);
  s.exposed_comm_s = std::max(s.exposed_comm_s, m.exposed_comm_s);
  s.link_busy_s = std::max(s.link_busy_s, m.link_busy_s);
  s.phase_floor_s = std::max(s.phase_floor_s, m.phase_floor_s);
  s.fwd_comm_s = std::max(s.fwd_comm_s, m.fwd_comm_s);
  s.fwd_exposed_s = std::max(s.fwd_exposed_s, m.fwd_exposed_s);
  s.bwd_comm_s = std::max(s.bwd_comm_s, m.bwd_comm_s);
  s.bwd_exposed_s = std::max(s.bwd_exposed_s, m.bwd_exposed_s);
  s.fwd_compute_s = std::max(s.fwd_compute_s, m.fwd_compute_s);
  s.bwd_compute_s = std::max(s.bwd_compute_s, m.bwd_compute_s);
  s.codec_s = std::max(s.codec_s, m.codec_s);
  if (!m.cpus.empty()) {
    auto& [cpu, cpus] = pending_host_cpu_[m.step][m.machine.empty() ? host : m.machine];
    cpu += m.cpu_s;
    cpus.insert(m.cpus.begin(), m.cpus.end());
  }
  s.predicted_step_s = std::max(s.predicted_step_s, m.predicted_step_s);
  s.peak_rss_bytes = std::max(s.peak_rss_bytes, m.peak_rss_bytes);
  for (const auto& [k, v] : m.bytes) s.bytes[k] += v;
  for (const auto& [k, v] : m.nmse) s.nmse[k] = std::max(s.nmse[k], v);
  // Per key, the busiest worker's total, and each part's busiest worker.
  std::map<std::string, double> codec_total;
  for (const auto* part : {&m.codec_encode_seconds, &m.codec_decode_seconds})
    for (const auto& [k, v] : *part) codec_total[k] += v;
  for (const auto& [k, v] : codec_total) s.codec_seconds[k] = std::max(s.codec_seconds[k], v);
  for (const auto& [k, v] : m.codec_encode_seconds) s.codec_encode_seconds[k] = std::max(s.codec_encode_seconds[k], v);
  for (const auto& [k, v] : m.codec_decode_seconds) s.codec_decode_seconds[k] = std::max(s.codec_decode_seconds[k], v);
  for (const auto& [k, v] : m.link_bursts)
    for (size_t i = 0; i < 3 && i < v.size(); ++i) s.link_bursts[k][i] += v[i];
  if (s.gather_wait_s.size() < m.gather_wait_s.size()) s.gather_wait_s.resize(m.gather_wait_s.size(), 0.0);
  for (size_t l = 0; l < m.gather_wait_s.size(); ++l) s.gather_wait_s[l] = std::max(s.gather_wait_s[l], m.gather_wait_s[l]);
  if (s.reporters == world_) {
    if (auto it = predicted_from_.upper_bound(s.step); it != predicted_from_.begin())
      s.predicted_step_s = std::prev(it)->second;
    for (const auto& [loss, ce, aux] : losses) {
      s.loss += loss / world_;
      s.ce_loss += ce / world_;
      s.aux_loss += aux / world_;
    }
    for (const auto& [machine, cpu] : pending_host_cpu_[m.step])
      s.cpu_floor_s = std::max(s.cpu_floor_s, cpu.first / double(cpu.second.size()));
    complete_.push_back(s);
    pending_.erase(m.step);
    pending_losses_.erase(m.step);
    pending_host_cpu_.erase(m.step);
  }
}

double StepSummary::a2a_imbalance(const std::string& link) const {
  auto get = [&](const char* op) {
    auto it = bytes.find(link + op);
    return it == bytes.end() ? 0.0 : it->second;
  };
  const double raw = get("/moe_dispatch_raw") + get("/moe_combine_raw"), peak = get("/moe_peak_raw");
  return raw > 0 && peak > 0 ? std::max(1.0, peak / raw) : 0.0;
}

std::string waits_text(const std::map<std::string, double>& waits_s) {
  std::string out;
  for (const char* pass : {"forward", "backward"}) {
    std::string parts;
    for (const auto& [key, v] : waits_s) {
      const auto slash = key.find('/');
      if (key.compare(0, slash, pass) != 0 || v < 0.5e-4) continue;
      std::string what = slash == std::string::npos ? key : key.substr(slash + 1);
      std::replace(what.begin(), what.end(), '_', ' ');
      char ms[32];
      std::snprintf(ms, sizeof ms, " %.1f", v * 1e3);
      if (!parts.empty()) parts += ", ";
      parts += what;
      parts += ms;
    }
    if (parts.empty()) continue;
    if (!out.empty()) out += "; ";
    out += pass;
    out += ": ";
    out += parts;
  }
  return out;
}

int64_t JobMetrics::latest_step() const {
  int64_t latest = 0;
  for (const auto& [rank, m] : last_by_rank_) latest = std::max(latest, m.step);
  return latest;
}

StepSummary JobMetrics::mean(int skip) const {
  std::map<std::string, int> nmse_steps;
  int cpu_steps = 0;
  StepSummary out;
  int n = 0;
  for (size_t i = std::min<size_t>(skip, complete_.size() ? complete_.size() - 1 : 0); i < complete_.size(); ++i) {
    const StepSummary& s = complete_[i];
    ++n;
    out.loss += s.loss;
    out.ce_loss += s.ce_loss;
    out.aux_loss += s.aux_loss;
    out.tokens_per_s += s.tokens_per_s;
    out.step_s += s.step_s;
    out.compute_s += s.compute_s;
    out.compute_min_s += s.compute_min_s;
    out.comm_s += s.comm_s;
    out.exposed_comm_s += s.exposed_comm_s;
    out.link_busy_s += s.link_busy_s;
    out.phase_floor_s += s.phase_floor_s;
    out.cpu_floor_s += s.cpu_floor_s;
    cpu_steps += s.cpu_floor_s > 0;
    out.fwd_comm_s += s.fwd_comm_s;
    out.fwd_exposed_s += s.fwd_exposed_s;
    out.bwd_comm_s += s.bwd_comm_s;
    out.bwd_exposed_s += s.bwd_exposed_s;
    out.fwd_compute_s += s.fwd_compute_s;
    out.bwd_compute_s += s.bwd_compute_s;
    out.critical_fwd_exposed_s += s.critical_fwd_exposed_s;
    out.critical_bwd_exposed_s += s.critical_bwd_exposed_s;
    for (const auto& [k, v] : s.critical_waits_s) out.critical_waits_s[k] += v;
    out.codec_s += s.codec_s;
    out.predicted_step_s += s.predicted_step_s;
    out.peak_rss_bytes = std::max(out.peak_rss_bytes, s.peak_rss_bytes);
    for (const auto& [k, v] : s.bytes) out.bytes[k] += v;
    for (const auto& [k, v] : s.codec_seconds) out.codec_seconds[k] += v;
    for (const auto& [k, v] : s.codec_encode_seconds) out.codec_encode_seconds[k] += v;
    for (const auto& [k, v] : s.codec_decode_seconds) out.codec_decode_seconds[k] += v;
    for (const auto& [k, v] : s.nmse) {
      out.nmse[k] += v;
      nmse_steps[k]++;
    }
    if (out.gather_wait_s.size() < s.gather_wait_s.size()) out.gather_wait_s.resize(s.gather_wait_s.size(), 0.0);
    for (size_t l = 0; l < s.gather_wait_s.size(); ++l) out.gather_wait_s[l] += s.gather_wait_s[l];
  }
  if (n == 0) return out;
  out.loss /= n;
  out.ce_loss /= n;
  out.aux_loss /= n;
  out.tokens_per_s /= n;
  out.step_s /= n;
  out.compute_s /= n;
  out.compute_min_s /= n;
  out.comm_s /= n;
  out.exposed_comm_s /= n;
  out.link_busy_s /= n;
  out.phase_floor_s /= n;
  if (cpu_steps > 0) out.cpu_floor_s /= cpu_steps;  // over the steps that reported it
  out.fwd_comm_s /= n;
  out.fwd_exposed_s /= n;
  out.bwd_comm_s /= n;
  out.bwd_exposed_s /= n;
  out.fwd_compute_s /= n;
  out.bwd_compute_s /= n;
  out.critical_fwd_exposed_s /= n;
  out.critical_bwd_exposed_s /= n;
  out.codec_s /= n;
  out.predicted_step_s /= n;
  for (auto& [k, v] : out.bytes) v /= n;
  for (auto& [k, v] : out.nmse) v /= nmse_steps[k];  // over the steps that reported it
  // A step without the key spent 0 on it.
  for (auto* codec : {&out.codec_seconds, &out.codec_encode_seconds, &out.codec_decode_seconds})
    for (auto& [k, v] : *codec) v /= n;
  for (double& w : out.gather_wait_s) w /= n;
  for (auto& [k, v] : out.critical_waits_s) v /= n;  // a step without the key waited 0 for it
  out.step = complete_.back().step;
  out.reporters = n;
  return out;
}

namespace {
// A Prometheus label value as the text format wants it: backslash, double
// quote and newline escaped (link class names come from the job config).
std::string label_value(const std::string& v) {
  std::string out;
  for (char c : v) {
    if (c == '\\' || c == '"') out += '\\';
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    out += c;
  }
  return out;
}

nlohmann::json summary_json(const StepSummary& s) {
  return {{"step", s.step},
          {"loss", s.loss},
          {"ce_loss", s.ce_loss},
          {"aux_loss", s.aux_loss},
          {"tokens_per_s", s.tokens_per_s},
          {"step_s", s.step_s},
          {"compute_s", s.compute_s},
          {"compute_spread_s", s.compute_spread_s()},
          {"comm_s", s.comm_s},
          {"exposed_comm_s", s.exposed_comm_s},
          {"overlap_percent", s.overlap_percent()},
          {"link_busy_s", s.link_busy_s},
          {"fwd_compute_s", s.fwd_compute_s},
          {"fwd_comm_s", s.fwd_comm_s},
          {"fwd_exposed_s", s.fwd_exposed_s},
          {"fwd_overlap_percent", s.fwd_overlap_percent()},
          {"bwd_compute_s", s.bwd_compute_s},
          {"bwd_comm_s", s.bwd_comm_s},
          {"bwd_exposed_s", s.bwd_exposed_s},
          {"bwd_overlap_percent", s.bwd_overlap_percent()},
          {"critical_fwd_exposed_s", s.critical_fwd_exposed_s},
          {"critical_fwd_overlap_percent", s.critical_fwd_overlap_percent()},
          {"critical_bwd_exposed_s", s.critical_bwd_exposed_s},
          {"critical_bwd_overlap_percent", s.critical_bwd_overlap_percent()},
          {"critical_waits_s", s.critical_waits_s},
          {"codec_s", s.codec_s},
          {"bound_s", s.bound_s()},
          {"step_over_bound", s.step_over_bound()},
          {"phase_floor_s", s.phase_floor_s},
          {"step_over_phase_floor", s.step_over_phase_floor()},
          {"cpu_floor_s", s.cpu_floor_s},
          {"step_over_cpu_floor", s.step_over_cpu_floor()},
          {"predicted_step_s", s.predicted_step_s},
          {"peak_rss_bytes", s.peak_rss_bytes},
          {"bytes", s.bytes},
          {"nmse", s.nmse},
          {"codec_seconds", s.codec_seconds},
          {"codec_encode_seconds", s.codec_encode_seconds},
          {"codec_decode_seconds", s.codec_decode_seconds},
          {"gather_wait_s", s.gather_wait_s}};
}
}  // namespace

nlohmann::json JobMetrics::to_json() const {
  nlohmann::json j;
  j["steps_complete"] = complete_.size();
  if (!complete_.empty()) j["last_step"] = summary_json(complete_.back());
  nlohmann::json per_rank = nlohmann::json::object();
  for (const auto& [rank, m] : last_by_rank_) {
    nlohmann::json w = xd::to_json(m);
    w.erase("op");
    per_rank[std::to_string(rank)] = w;
  }
  j["workers"] = per_rank;
  return j;
}

std::string JobMetrics::prometheus(const std::string& job, const std::vector<std::string>& states) const {
  std::ostringstream o;
  auto gauge = [&](const char* name, const char* help) {
    o << "# HELP xdmoe_" << name << " " << help << "\n# TYPE xdmoe_" << name << " gauge\n";
  };
  const std::string label = "job=\"" + label_value(job) + "\"";
  // Values keyed "a/b": one gauge labelled `first`="a", `second`="b".
  auto split_key_gauge = [&](const char* name, const char* help, const std::map<std::string, double>& values,
                             const char* first, const char* second) {
    if (values.empty()) return;
    gauge(name, help);
    for (const auto& [key, v] : values) {
      const auto slash = key.find('/');
      o << "xdmoe_" << name << "{" << label << "," << first << "=\"" << label_value(key.substr(0, slash)) << "\","
        << second << "=\"" << label_value(slash == std::string::npos ? "" : key.substr(slash + 1)) << "\"} " << v
        << "\n";
    }
  };
  gauge("workers", "Workers of the job by state.");
  std::map<std::string, int> by_state;
  for (const auto& s : states) by_state[s]++;
  for (const char* s : {"registered", "running", "lost", "done", "failed", "missing"})
    o << "xdmoe_workers{" << label << ",state=\"" << s << "\"} " << by_state[s] << "\n";
  gauge("steps_complete", "Steps reported by every worker.");
  o << "xdmoe_steps_complete{" << label << "} " << complete_.size() << "\n";
  const StepSummary* s = last_complete();
  if (s) {
    struct Field { const char* name; const char* help; double value; };
    const Field fields[] = {
        {"loss", "Mean training loss of the last complete step.", s->loss},
        {"tokens_per_second", "Sum over workers of tokens per second.", s->tokens_per_s},
        {"step_seconds", "Slowest worker's step time.", s->step_s},
        {"compute_seconds", "Compute time of the step.", s->compute_s},
        {"compute_spread_seconds", "Slowest worker's compute minus the fastest's: waiting for a more loaded peer.",
         s->compute_spread_s()},
        {"comm_seconds", "Communication time of the step (both passes; the busiest link class's transmit time).",
         s->comm_s},
        {"exposed_comm_seconds", "Communication time not hidden behind compute.", s->exposed_comm_s},
        {"overlap_percent", "1 - exposed / total communication, in percent.", s->overlap_percent()},
        {"link_busy_seconds", "Busiest shaped link class's transmit time in the step.", s->link_busy_s},
        {"bound_seconds", "The step's bound: max(compute, busiest link's transmit time).", s->bound_s()},
        {"step_over_bound", "Step time / bound; 1 is the physical limit.", s->step_over_bound()},
        {"phase_floor_seconds",
         "Each phase's own max(compute, busiest link's transmit time), summed: a phase's traffic cannot use the "
         "other's idle link.", s->phase_floor_s},
        {"step_over_phase_floor", "Step time / phase floor; 1 leaves nothing for a schedule to overlap better.",
         s->step_over_phase_floor()},
        {"cpu_floor_seconds",
         "The workers' CPU time on their busiest machine over the cores they share: the step cannot be shorter on them.",
         s->cpu_floor_s},
        {"step_over_cpu_floor", "Step time / CPU floor; 1 kept every core of the busiest machine busy with the job.",
         s->step_over_cpu_floor()},
        {"codec_seconds",
         "CPU time a worker spent in the codecs (token rows, expert tensors, bf16 casts) in the step, busiest worker.",
         s->codec_s},
        {"predicted_step_seconds", "The planner's prediction for the step.", s->predicted_step_s},
        {"peak_rss_bytes", "Largest peak resident set size of a worker.", s->peak_rss_bytes},
    };
    for (const Field& f : fields) {
      gauge(f.name, f.help);
      o << "xdmoe_" << f.name << "{" << label << "} " << f.value << "\n";
    }
    // Per direction: forward is the forward pass, backward the rest of the step.
    // One value per per_direction field below, in its order.
    struct Direction { const char* name; double values[6]; };
    const Direction directions[] = {
        {"forward", {s->fwd_comm_s, s->fwd_exposed_s, s->fwd_overlap_percent(), s->critical_fwd_exposed_s,
                     s->critical_fwd_overlap_percent(), s->fwd_compute_s}},
        {"backward", {s->bwd_comm_s, s->bwd_exposed_s, s->bwd_overlap_percent(), s->critical_bwd_exposed_s,
                      s->critical_bwd_overlap_percent(), s->bwd_compute_s}}};
    const Field per_direction[] = {
        {"direction_comm_seconds", "Busiest link class's transmit time while the pass ran (at least the exposed time).", 0},
        {"direction_exposed_comm_seconds", "Time compute waited for communication in the pass, most-waiting worker.", 0},
        {"direction_overlap_percent", "1 - exposed / total communication of the pass, in percent, most-waiting worker.", 0},
        {"direction_critical_exposed_comm_seconds",
         "Time the slowest worker's compute (the critical path) waited for communication in the pass.", 0},
        {"direction_critical_overlap_percent",
         "1 - the slowest worker's exposed / total communication of the pass, in percent.", 0},
        {"direction_compute_seconds",
         "The pass's compute less its waits, max over workers; beside direction_comm_seconds it says whether "
         "the pass's link or its compute bounds it.", 0}};
    constexpr size_t kFields = sizeof(per_direction) / sizeof(per_direction[0]);
    static_assert(kFields == sizeof(Direction::values) / sizeof(double), "a value per field and direction");
    for (size_t f = 0; f < kFields; ++f) {
      gauge(per_direction[f].name, per_direction[f].help);
      for (const Direction& d : directions)
        o << "xdmoe_" << per_direction[f].name << "{" << label << ",direction=\"" << d.name << "\"} "
          << d.values[f] << "\n";
    }
    split_key_gauge("critical_wait_seconds",
                    "Time the slowest worker's compute (the critical path) waited in the step, by pass and by what "
                    "for.",
                    s->critical_waits_s, "direction", "wait");
    if (!s->gather_wait_s.empty()) {
      gauge("gather_wait_seconds",
            "Time the forward waited for a layer's gathered experts (HybridEP), the most-waiting worker.");
      for (size_t layer = 0; layer < s->gather_wait_s.size(); ++layer)
        o << "xdmoe_gather_wait_seconds{" << label << ",layer=\"" << layer << "\"} " << s->gather_wait_s[layer]
          << "\n";
    }
    // Keys are "link/op" (bytes on the wire) and "link/op_raw" (the fp32
    // bytes before any codec): two metrics with the same labels.
    constexpr std::string_view kRaw = "_raw";
    for (const bool raw : {false, true}) {
      const std::string metric = raw ? "xdmoe_step_raw_bytes" : "xdmoe_step_bytes";
      o << "# HELP " << metric
        << (raw ? " Bytes before any codec (token rows, expert tensors, dense gradients), in the last complete "
                  "step, per link class and operation; op moe_peak sums each token A2A hop's larger side, sent or "
                  "received.\n"
                : " Bytes sent in the last complete step per link class and operation.\n")
        << "# TYPE " << metric << " gauge\n";
      for (const auto& [key, v] : s->bytes) {
        const bool is_raw = key.size() > kRaw.size() && key.compare(key.size() - kRaw.size(), kRaw.size(), kRaw) == 0;
        if (is_raw != raw) continue;
        const auto slash = key.find('/');
        const std::string link = key.substr(0, slash);
        std::string opname = slash == std::string::npos ? "" : key.substr(slash + 1);
        if (raw) opname.resize(opname.size() - kRaw.size());
        o << metric << "{" << label << ",link=\"" << label_value(link) << "\",op=\"" << label_value(opname) << "\"} "
          << v << "\n";
      }
    }
  }
  if (s) {
    // Per link class and traffic kind, the busiest (or worst) worker's.
    const struct {
      const char* name;
      const char* help;
      const std::map<std::string, double>& values;
    } per_traffic[] = {
        {"codec_nmse",
         "Reconstruction error ||x - rebuilt||^2 / ||x||^2 of a lossy codec, worst worker (token rows: the first "
         "message of each peer and direction; bf16 dense gradients: the rounding of what is sent).",
         s->nmse},
        {"codec_traffic_seconds",
         "CPU time a worker spent encoding and decoding in the step, per link class and traffic kind, the busiest "
         "worker.",
         s->codec_seconds},
        {"codec_encode_seconds",
         "CPU time a worker spent encoding what it sent in the step (packing inside the optimizer step included), per "
         "link class and traffic kind, the busiest encoder.",
         s->codec_encode_seconds},
        {"codec_decode_seconds",
         "CPU time a worker spent decoding what it received in the step, per link class and traffic kind, the "
         "busiest decoder.",
         s->codec_decode_seconds},
    };
    for (const auto& g : per_traffic) split_key_gauge(g.name, g.help, g.values, "link", "traffic");
  }
  gauge("worker_step", "Last step each worker reported.");
  for (const auto& [rank, m] : last_by_rank_)
    o << "xdmoe_worker_step{" << label << ",rank=\"" << rank << "\"} " << m.step << "\n";
  gauge("worker_loss", "Last loss each worker reported.");
  for (const auto& [rank, m] : last_by_rank_)
    o << "xdmoe_worker_loss{" << label << ",rank=\"" << rank << "\"} " << m.loss << "\n";
  return o.str();
}

}  // namespace xd
