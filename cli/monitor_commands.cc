// xdmoe status / top / metrics / stop / throttle: talk to a running
// coordinator's CLI socket. Every table has a --json form.
#include <array>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "cli/commands.h"
#include "cluster/protocol.h"
#include "coordinator/job_metrics.h"
#include "coordinator/planner.h"
#include "transport/control_channel.h"
#include "common/units.h"

namespace xd::cli {

std::string coordinator_cli_endpoint(const std::string& flag) {
  if (!flag.empty()) return flag;
  if (const char* env = std::getenv("XDMOE_COORDINATOR")) return env;
  return "tcp://127.0.0.1:7370";
}

namespace {

struct MonitorFlags {
  std::string coordinator;
  std::string key_file, coordinator_key;  // CURVE (docs/operations.md)
  bool json = false;
  int iterations = 0;     // top: 0 = until interrupted
  double interval = 1.0;  // top
  std::string link, bandwidth, latency;
  int rank = -1;  // throttle: one worker only
};

Expected<nlohmann::json> ask(const MonitorFlags& f, const nlohmann::json& request) {
  const std::string ep = coordinator_cli_endpoint(f.coordinator);
  SocketSecurity security;
  if (!f.key_file.empty() || !f.coordinator_key.empty()) {
    auto own = read_secret_key_file(f.key_file);
    if (!own) return own.status().with_context("--key");
    auto server = read_public_key(f.coordinator_key);
    if (!server) return server.status().with_context("--coordinator-key");
    security = {true, *own, *server, ""};
  }
  auto reply = control_request(ep, request, std::chrono::milliseconds(2000), security);
  if (!reply)
    return Status::unavailable("no coordinator reachable at " + ep +
                               " (is a job running? pass --coordinator or set XDMOE_COORDINATOR)");
  if (!reply->is_object() || !reply->value("ok", false)) {
    std::string error = "the coordinator refused the request";
    if (reply->is_object() && reply->contains("error") && (*reply)["error"].is_string())
      error = (*reply)["error"].get<std::string>();
    return Status::invalid_argument(error);
  }
  return reply;
}

int fail(const char* cmd, const Status& st) {
  std::fprintf(stderr, "xdmoe %s: %s\n", cmd, st.message().c_str());
  return st.code() == Status::Code::kUnavailable ? 3 : 1;
}

std::string num(const nlohmann::json& j, const char* key, const char* fmt, double scale = 1.0) {
  if (!j.contains(key) || !j[key].is_number()) return "-";
  char buf[64];
  std::snprintf(buf, sizeof buf, fmt, j[key].get<double>() * scale);
  return buf;
}

std::string human_rate(double bytes_per_s) {
  char buf[32];
  if (bytes_per_s <= 0) return "unlimited";
  const double bits = bytes_per_s * 8;
  if (bits >= 1e9) std::snprintf(buf, sizeof buf, "%.3g Gbit/s", bits / 1e9);
  else if (bits >= 1e6) std::snprintf(buf, sizeof buf, "%.3g Mbit/s", bits / 1e6);
  else std::snprintf(buf, sizeof buf, "%.3g kbit/s", bits / 1e3);
  return buf;
}

// Cuts `s` to `width` characters, marking the cut with '~'.
std::string fit(const std::string& s, size_t width) {
  return s.size() <= width ? s : s.substr(0, width - 1) + "~";
}

std::string list_of(const nlohmann::json& s, const char* key) {
  return s.contains(key) ? s[key].dump() : "?";
}

// One pass's communication (the busiest link's transmit time while it ran),
// the exposed part of it and the overlap, for the most-waiting worker, and
// the slowest worker's overlap (the critical path).
void print_direction(const nlohmann::json& l, const char* name, const char* prefix) {
  const std::string p(prefix);
  std::printf("  %-9s comm %s ms, exposed %s ms, overlap %s%% (slowest %s%%)\n", (std::string(name) + ":").c_str(),
              num(l, (p + "_comm_s").c_str(), "%.1f", 1e3).c_str(),
              num(l, (p + "_exposed_s").c_str(), "%.1f", 1e3).c_str(),
              num(l, (p + "_overlap_percent").c_str(), "%.0f").c_str(),
              num(l, ("critical_" + p + "_overlap_percent").c_str(), "%.0f").c_str());
}

// `line` then `pieces`, a space before each, wrapped at 80 columns onto
// lines indented by three.
void print_wrapped(std::string line, const std::vector<std::string>& pieces) {
  for (const std::string& piece : pieces) {
    if (line.size() + 1 + piece.size() > 80 && line.size() > 4) {
      std::printf("%s\n", line.c_str());
      line = "   ";
    }
    line += ' ';
    line += piece;
  }
  std::printf("%s\n", line.c_str());
}

// Each number of the object `j[key]` as "KEY VALUE", the value printed with
// `fmt` after scaling, a comma after every one but the last: pieces for
// print_wrapped.
std::vector<std::string> keyed_pieces(const nlohmann::json& j, const char* key, const char* fmt, double scale) {
  std::vector<std::string> pieces;
  const nlohmann::json object = j.value(key, nlohmann::json::object());
  for (auto it = object.begin(); it != object.end(); ++it)
    if (it.value().is_number()) {
      char v[32];
      std::snprintf(v, sizeof v, fmt, scale * it.value().get<double>());
      pieces.push_back(it.key() + " " + v + ",");
    }
  if (!pieces.empty()) pieces.back().pop_back();
  return pieces;
}

// The time `key` (link class/traffic) spent encoding and decoding in
// `summary` (a step or a run's mean), in ms: {total, encode, decode}.
std::array<double, 3> codec_ms(const nlohmann::json& summary, const std::string& key) {
  auto at = [&](const char* field) {
    const auto m = summary.find(field);
    if (m == summary.end() || !m->is_object()) return 0.0;
    const auto it = m->find(key);
    return it != m->end() && it->is_number() ? it->get<double>() * 1e3 : 0.0;
  };
  return {at("codec_seconds"), at("codec_encode_seconds"), at("codec_decode_seconds")};
}

// The codecs' share of the step: encoding and decoding, on the worker that
// spent the most on them (nothing when every link is raw), then by link
// class and traffic kind, each split into encoding (the busiest encoder) and
// decoding (the busiest decoder), and the lossy codecs' reconstruction NMSE.
// The coding threads' CPU time: a wait for a core, where workers share
// cores, is not counted.
void print_codec_time(const nlohmann::json& last_step) {
  if (last_step.value("codec_s", 0.0) <= 0) return;
  std::vector<std::string> seconds;
  const nlohmann::json keys = last_step.value("codec_seconds", nlohmann::json::object());
  for (auto it = keys.begin(); it != keys.end(); ++it) {
    const std::array<double, 3> ms = codec_ms(last_step, it.key());
    char v[96];
    std::snprintf(v, sizeof v, " %.1f (%.1f encode + %.1f decode),", ms[0], ms[1], ms[2]);
    seconds.push_back(it.key() + v);
  }
  if (!seconds.empty()) seconds.back().pop_back();
  print_wrapped("  codecs: " + num(last_step, "codec_s", "%.1f", 1e3) + " ms encoding and decoding (busiest worker)" +
                    (seconds.empty() ? "" : ";"),
                seconds);
  const std::vector<std::string> nmse = keyed_pieces(last_step, "nmse", "%.1e", 1.0);
  if (!nmse.empty()) print_wrapped("  codec NMSE:", nmse);
}

// How long the forward waited for each layer's gathered experts (HybridEP;
// the most-waiting worker's); nothing without them.
void print_gather_waits(const nlohmann::json& l) {
  const auto it = l.find("gather_wait_s");
  if (it == l.end() || !it->is_array() || it->empty()) return;
  std::vector<std::string> waits;
  for (const auto& w : *it) {
    char v[32];
    std::snprintf(v, sizeof v, "%.1f", w.is_number() ? w.get<double>() * 1e3 : 0.0);
    waits.push_back(v);
  }
  print_wrapped("  wait for gathered experts by layer (ms):", waits);
}

// The slowest worker's waits by what for (docs/overlap.md), broken after a
// comma or semicolon.
void print_waits(const nlohmann::json& last_step) {
  const auto it = last_step.find("critical_waits_s");
  if (it == last_step.end() || !it->is_object()) return;
  std::map<std::string, double> waits;
  for (auto w = it->begin(); w != it->end(); ++w)
    if (w.value().is_number()) waits[w.key()] = w.value().get<double>();
  const std::string text = waits_text(waits);
  if (text.empty()) return;
  std::vector<std::string> pieces;
  for (size_t at = 0; at < text.size();) {
    size_t end = text.find_first_of(",;", at);
    end = end == std::string::npos ? text.size() : end + 1;
    std::string piece = text.substr(at, end - at);
    if (piece[0] == ' ') piece.erase(0, 1);
    pieces.push_back(piece);
    at = end;
  }
  print_wrapped("  the slowest worker waited for (ms):", pieces);
}

// Every line fits 80 columns: long names are cut with "~".
void print_status(const nlohmann::json& s) {
  std::printf("job %s (id %s): %s, %s workers\n", fit(s.value("job", "?"), 16).c_str(), list_of(s, "job_id").c_str(),
              s.value("state", "?").c_str(), list_of(s, "world").c_str());
  const int r = s.value("pipeline_degree", 0);
  const std::string degrees = pipeline_degrees_text(r, s.value("backward_pipeline_degree", r),
                                                    s.value("replica_weight_gradients", std::string()) == "late");
  std::printf("mode %s, domains %s, r %s%s, predicted %s ms/step, up %s s\n", s.value("mode", "?").c_str(),
              fit(list_of(s, "domain_sizes"), 16).c_str(), degrees.c_str(),
              s.value("tokens_once_per_worker", false) ? ", tokens once" : "",
              num(s, "predicted_step_s", "%.1f", 1e3).c_str(), num(s, "uptime_s", "%.0f").c_str());
  // The last re-plan: why the plan is what it is.
  const nlohmann::json changes = s.value("plan_changes", nlohmann::json::array());
  if (!changes.empty()) {
    const auto& c = changes.back();
    if (c.value("reverted", false))
      std::printf("switched back after step %s: %s -> %s from step %s (measured %s -> %s ms)\n",
                  c["after_step"].dump().c_str(), list_of(c, "old_domain_sizes").c_str(),
                  list_of(c, "new_domain_sizes").c_str(), c["from_step"].dump().c_str(),
                  num(c, "old_now_predicted_s", "%.0f", 1e3).c_str(), num(c, "new_predicted_s", "%.0f", 1e3).c_str());
    else if (c.value("switched", false))
      std::printf("re-planned after step %s: %s -> %s from step %s (predicted %s -> %s ms)\n",
                  c["after_step"].dump().c_str(), list_of(c, "old_domain_sizes").c_str(),
                  list_of(c, "new_domain_sizes").c_str(), c["from_step"].dump().c_str(),
                  num(c, "old_now_predicted_s", "%.0f", 1e3).c_str(), num(c, "new_predicted_s", "%.0f", 1e3).c_str());
    else
      std::printf("re-checked after step %s: the plan stays\n", c["after_step"].dump().c_str());
    std::printf("  why: %s\n", fit(c.value("reason", "?"), 73).c_str());
  }
  if (s.contains("error")) std::printf("error: %s\n", s["error"].get<std::string>().c_str());
  // Links, checkpoints and who was turned away (docs/operations.md).
  if (s.contains("security")) {
    const auto& sec = s["security"];
    const auto refused = sec.value("refused", nlohmann::json::array());
    std::printf("links: %s; %zu connection(s) refused\n", sec.value("curve", false) ? "CURVE" : "plaintext",
                refused.size());
    for (size_t i = refused.size() > 5 ? refused.size() - 5 : 0; i < refused.size(); ++i)
      std::printf("  refused key %s from %s (%s)\n", refused[i].value("key", "?").c_str(),
                  refused[i].value("address", "?").c_str(), refused[i].value("domain", "?").c_str());
  }
  if (s.contains("last_checkpoint"))
    std::printf("last checkpoint: step %s in %s\n", s["last_checkpoint"]["step"].dump().c_str(),
                s["last_checkpoint"].value("dir", "?").c_str());
  if (s.contains("resumed_from"))
    std::printf("resumed from %s (step %s)\n", s["resumed_from"].value("dir", "?").c_str(),
                s["resumed_from"]["step"].dump().c_str());
  std::printf("%-4s %-9s %-14s %-7s %6s %6s %8s %7s %8s\n", "rank", "state", "host", "pid", "seen",
              "step", "loss", "tok/s", "step ms");
  for (const auto& w : s.value("workers", nlohmann::json::array())) {
    std::printf("%-4s %-9s %-14s %-7s %6s %6s %8s %7s %8s\n", w["rank"].dump().c_str(),
                fit(w.value("state", "?"), 9).c_str(), fit(w.value("host", "-"), 14).c_str(),
                w.contains("pid") ? w["pid"].dump().c_str() : "-",
                w.contains("last_seen_s_ago") ? (num(w, "last_seen_s_ago", "%.1f") + "s").c_str() : "-",
                w.contains("step") ? w["step"].dump().c_str() : "-", num(w, "loss", "%.4f").c_str(),
                num(w, "tokens_per_s", "%.0f").c_str(), num(w, "step_s", "%.1f", 1e3).c_str());
  }
  if (s.contains("last_step")) {
    const auto& l = s["last_step"];
    std::printf("last complete step %s: loss %s, %s tok/s\n", l["step"].dump().c_str(),
                num(l, "loss", "%.4f").c_str(), num(l, "tokens_per_s", "%.0f").c_str());
    std::printf("  step %s ms = compute %s + exposed comm %s ms (overlap %s%%)\n",
                num(l, "step_s", "%.1f", 1e3).c_str(), num(l, "compute_s", "%.1f", 1e3).c_str(),
                num(l, "exposed_comm_s", "%.1f", 1e3).c_str(), num(l, "overlap_percent", "%.0f").c_str());
    std::printf("  bound %s ms, step / bound %s (phase floor %s ms: %s)\n", num(l, "bound_s", "%.1f", 1e3).c_str(),
                num(l, "step_over_bound", "%.2f").c_str(), num(l, "phase_floor_s", "%.1f", 1e3).c_str(),
                num(l, "step_over_phase_floor", "%.2f").c_str());
    std::printf("  CPU floor %s ms, step / CPU floor %s; compute spread %s ms\n",
                num(l, "cpu_floor_s", "%.1f", 1e3).c_str(), num(l, "step_over_cpu_floor", "%.2f").c_str(),
                num(l, "compute_spread_s", "%.1f", 1e3).c_str());
    print_direction(l, "forward", "fwd");
    print_direction(l, "backward", "bwd");
    print_gather_waits(l);
    print_waits(l);
    print_codec_time(l);
  }
}

// Per link class: its shaping, the bytes of the last step, how much the
// codecs shrank the token rows, the expert tensors and the dense gradients
// (raw / wire; "-" without such traffic or codec), and the worst
// reconstruction NMSE of its lossy codecs. 80 columns.
void print_links(const nlohmann::json& s, const nlohmann::json& last) {
  std::printf("%-12s %-10s %-9s %-5s %10s %6s %7s %6s %7s\n", "link class", "bandwidth", "latency", "shape",
              "bytes/step", "tokens", "experts", "dense", "NMSE");
  const nlohmann::json bytes = last.value("bytes", nlohmann::json::object());
  const nlohmann::json nmse = last.value("nmse", nlohmann::json::object());
  auto get = [&](const std::string& key) { return bytes.contains(key) ? bytes[key].get<double>() : 0.0; };
  auto ratio = [](double raw, double wire) {
    char out[16] = "-";
    if (wire > 0 && raw > 0) std::snprintf(out, sizeof out, "%.1fx", raw / wire);
    return std::string(out);
  };
  for (const auto& l : s.value("links", nlohmann::json::array())) {
    const std::string name = l.value("name", "?");
    const std::string tokens = ratio(get(name + "/moe_dispatch_raw") + get(name + "/moe_combine_raw"),
                                     get(name + "/moe_dispatch") + get(name + "/moe_combine"));
    const std::string experts = ratio(get(name + "/expert_gather_raw") + get(name + "/expert_grad_raw"),
                                      get(name + "/expert_gather") + get(name + "/expert_grad"));
    const std::string dense = ratio(get(name + "/all_reduce_raw") + get(name + "/reduce_scatter_raw"),
                                    get(name + "/all_reduce") + get(name + "/reduce_scatter"));
    double worst = -1;
    for (const char* kind : {"/dispatch", "/combine", "/expert_gather", "/expert_grad", "/expert_base", "/dense_grad"})
      if (nmse.contains(name + kind)) worst = std::max(worst, nmse[name + kind].get<double>());
    char error[16] = "-";
    if (worst >= 0) std::snprintf(error, sizeof error, "%.1e", worst);
    std::printf("%-12s %-10s %-9s %-5s %10.0f %6s %7s %6s %7s\n", fit(name, 12).c_str(),
                fit(human_rate(l.value("bandwidth_bytes_per_s", 0.0)), 10).c_str(),
                fit(num(l, "latency_s", "%.2f", 1e3) + " ms", 9).c_str(), l.value("shaped", false) ? "yes" : "no",
                get(name + "/total"), tokens.c_str(), experts.c_str(), dense.c_str(), error);
  }
}

int run_status(const MonitorFlags& f) {
  auto s = ask(f, to_json(StatusRequest{}));
  if (!s) return fail("status", s.status());
  s->erase("ok");
  if (f.json) std::printf("%s\n", s->dump(2).c_str());
  else print_status(*s);
  return 0;
}

volatile std::sig_atomic_t g_interrupted = 0;

int run_top(const MonitorFlags& f) {
  std::signal(SIGINT, [](int) { g_interrupted = 1; });
  for (int i = 0; (f.iterations == 0 || i < f.iterations) && !g_interrupted; ++i) {
    auto s = ask(f, to_json(StatusRequest{}));
    if (!s) return fail("top", s.status());
    s->erase("ok");
    if (f.json) {
      std::printf("%s\n", s->dump().c_str());
    } else {
      std::printf("\033[H\033[2J");  // home + clear
      print_status(*s);
      std::printf("\n");
      print_links(*s, s->value("last_step", nlohmann::json::object()));
      std::printf("\n(refreshing every %.1f s; Ctrl-C to quit)\n", f.interval);
    }
    std::fflush(stdout);
    if (s->value("state", "") == "done" || s->value("state", "") == "failed") break;
    std::this_thread::sleep_for(std::chrono::duration<double>(f.interval));
  }
  return 0;
}

int run_metrics(const MonitorFlags& f) {
  auto m = ask(f, to_json(MetricsRequest{}));
  if (!m) return fail("metrics", m.status());
  m->erase("ok");
  if (f.json) {
    std::printf("%s\n", m->dump(2).c_str());
    return 0;
  }
  std::printf("steps complete: %s\n", (*m)["steps_complete"].dump().c_str());
  if (m->contains("last_step")) {
    const auto& l = (*m)["last_step"];
    std::printf("last step %s: loss %s, %s tok/s, step %s ms (predicted %s ms)\n", l["step"].dump().c_str(),
                num(l, "loss", "%.4f").c_str(), num(l, "tokens_per_s", "%.0f").c_str(),
                num(l, "step_s", "%.1f", 1e3).c_str(), num(l, "predicted_step_s", "%.1f", 1e3).c_str());
    std::printf("  compute %s ms, comm %s ms, exposed %s ms, overlap %s%%\n", num(l, "compute_s", "%.1f", 1e3).c_str(),
                num(l, "comm_s", "%.1f", 1e3).c_str(), num(l, "exposed_comm_s", "%.1f", 1e3).c_str(),
                num(l, "overlap_percent", "%.0f").c_str());
    for (const char* d : {"fwd", "bwd"}) {
      const std::string p = d;
      std::printf("  %s compute %s ms, comm %s ms, exposed %s ms, overlap %s%% (the slowest worker's: exposed %s "
                  "ms, overlap %s%%)\n",
                  p == "fwd" ? "forward: " : "backward:", num(l, (p + "_compute_s").c_str(), "%.1f", 1e3).c_str(),
                  num(l, (p + "_comm_s").c_str(), "%.1f", 1e3).c_str(),
                  num(l, (p + "_exposed_s").c_str(), "%.1f", 1e3).c_str(),
                  num(l, (p + "_overlap_percent").c_str(), "%.0f").c_str(),
                  num(l, ("critical_" + p + "_exposed_s").c_str(), "%.1f", 1e3).c_str(),
                  num(l, ("critical_" + p + "_overlap_percent").c_str(), "%.0f").c_str());
    }
    std::printf("  bound %s ms, step / bound %s; phase floor %s ms, step / phase floor %s; CPU floor %s ms, step / "
                "CPU floor %s\n",
                num(l, "bound_s", "%.1f", 1e3).c_str(), num(l, "step_over_bound", "%.2f").c_str(),
                num(l, "phase_floor_s", "%.1f", 1e3).c_str(), num(l, "step_over_phase_floor", "%.2f").c_str(),
                num(l, "cpu_floor_s", "%.1f", 1e3).c_str(), num(l, "step_over_cpu_floor", "%.2f").c_str());
    std::printf("  compute spread %s ms (slowest worker's compute minus the fastest's: exposed time no overlap hides)\n",
                num(l, "compute_spread_s", "%.1f", 1e3).c_str());
    print_waits(l);
    print_codec_time(l);
    // Each object of numbers as a table under its heading; an empty one
    // only `always` (the bytes, as ever).
    auto table = [&](const char* key, const char* heading, const char* unit, const char* fmt, double scale,
                     bool always = false) {
      const nlohmann::json values = l.value(key, nlohmann::json::object());
      if (values.empty() && !always) return;
      std::printf("%-32s %14s\n", heading, unit);
      for (auto it = values.begin(); it != values.end(); ++it) {
        char v[32];
        std::snprintf(v, sizeof v, fmt, scale * it.value().get<double>());
        std::printf("%-32s %14s\n", it.key().c_str(), v);
      }
    };
    table("bytes", "link class / operation", "bytes", "%.0f", 1.0, /*always=*/true);
    table("nmse", "link class / lossy codec", "NMSE", "%.4g", 1.0);
    const nlohmann::json codecs = l.value("codec_seconds", nlohmann::json::object());
    if (!codecs.empty()) {
      std::printf("%-32s %14s %14s %14s\n", "link class / codec", "ms", "encode ms", "decode ms");
      for (auto it = codecs.begin(); it != codecs.end(); ++it) {
        const std::array<double, 3> ms = codec_ms(l, it.key());
        std::printf("%-32s %14.2f %14.2f %14.2f\n", it.key().c_str(), ms[0], ms[1], ms[2]);
      }
    }
  }
  return 0;
}

int run_stop(const MonitorFlags& f) {
  auto r = ask(f, to_json(StopOrder{"stopped by request from the CLI"}));
  if (!r) return fail("stop", r.status());
  std::printf("stop sent; job is %s\n", r->value("state", "?").c_str());
  return 0;
}

int run_throttle(const MonitorFlags& f) {
  auto bw = parse_bandwidth(f.bandwidth);
  if (!bw) return fail("throttle", bw.status());
  ThrottleRequest req{f.link, *bw, -1, f.rank};
  if (!f.latency.empty()) {
    auto lat = parse_duration(f.latency);
    if (!lat) return fail("throttle", lat.status());
    req.latency_s = *lat;
  }
  auto r = ask(f, to_json(req));
  if (!r) return fail("throttle", r.status());
  std::printf("link class %s%s: %s%s\n", f.link.c_str(),
              f.rank >= 0 ? (" from worker " + std::to_string(f.rank)).c_str() : "", human_rate(*bw).c_str(),
              f.latency.empty() ? "" : (", latency " + f.latency).c_str());
  return 0;
}

}  // namespace

void add_monitor_commands(CLI::App& app, int* exit_code) {
  auto f = std::make_shared<MonitorFlags>();
  auto common = [f](CLI::App* cmd, bool json) {
    cmd->add_option("--coordinator", f->coordinator,
                    "Coordinator CLI endpoint (default $XDMOE_COORDINATOR or tcp://127.0.0.1:7370)");
    if (const char* k = std::getenv("XDMOE_KEY")) f->key_file = k;
    if (const char* k = std::getenv("XDMOE_COORDINATOR_KEY")) f->coordinator_key = k;
    cmd->add_option("--key", f->key_file, "Your CURVE secret key file, for a job with keys (default $XDMOE_KEY)");
    cmd->add_option("--coordinator-key", f->coordinator_key,
                    "The coordinator's public key: .pub file or Z85 (default $XDMOE_COORDINATOR_KEY)");
    if (json) cmd->add_flag("--json", f->json, "Print JSON instead of a table");
  };
  CLI::App* status = app.add_subcommand("status", "Show the job, its workers, their liveness and the last step");
  common(status, true);
  status->callback([f, exit_code] { *exit_code = run_status(*f); });

  CLI::App* top = app.add_subcommand("top", "Live table per worker and per link class");
  common(top, true);
  top->add_option("--interval", f->interval, "Seconds between refreshes")->capture_default_str();
  top->add_option("--iterations", f->iterations, "Stop after this many refreshes (0: until Ctrl-C)");
  top->callback([f, exit_code] { *exit_code = run_top(*f); });

  CLI::App* metrics = app.add_subcommand("metrics", "Aggregated metrics of the last complete step");
  common(metrics, true);
  metrics->callback([f, exit_code] { *exit_code = run_metrics(*f); });

  CLI::App* stop = app.add_subcommand("stop", "Stop the job");
  common(stop, false);
  stop->callback([f, exit_code] { *exit_code = run_stop(*f); });

  CLI::App* throttle = app.add_subcommand("throttle", "Change a link class's bandwidth (and latency) while running");
  common(throttle, false);
  throttle->add_option("--link", f->link, "Link class (level) name, e.g. dc")->required();
  throttle->add_option("--bandwidth", f->bandwidth, "e.g. 50mbit, 1gbit, 10MB/s")->required();
  throttle->add_option("--latency", f->latency, "e.g. 5ms");
  throttle->add_option("--rank", f->rank,
                       "Only this worker's sends on the class (the others keep theirs); default: every worker");
  throttle->callback([f, exit_code] { *exit_code = run_throttle(*f); });
}

}  // namespace xd::cli
