#include "cluster/job_config.h"

#include <algorithm>
#include <cmath>

#include "cluster/detail/json_fields.h"
#include "common/atomic_file.h"
#include "compression/expert_codec.h"
#include "model/hf_config.h"

namespace xd {

using nlohmann::json;
using detail::JsonFields;

Status JobConfig::validate() const {
  XD_RETURN_IF_ERROR(train.validate());
  XD_RETURN_IF_ERROR(cluster.validate());
  const int g = cluster.world_size();
  if (train.model.num_experts % g != 0)
    return Status::invalid_argument("model.num_experts (" + std::to_string(train.model.num_experts) +
                                    ") must be a multiple of the world size (" + std::to_string(g) +
                                    " workers from cluster.levels), so that every worker owns "
                                    "the same number of experts");
  if (cluster.expert_parallel.tokens_once_per_worker == TokensOncePerWorker::kOn)
    XD_RETURN_IF_ERROR(can_send_tokens_once_per_worker().with_context("cluster.expert_parallel.tokens_once_per_worker"));
  return Status::ok();
}

Status JobConfig::can_send_tokens_once_per_worker() const {
  if (train.model.gating == Gating::kSoftMoe)
    return Status::invalid_argument("needs a router that sends tokens; soft_moe sends slot inputs");
  // Grouped rows carry expert ids and combine weights beside the token.
  for (const LevelSpec& l : cluster.levels)
    for (const std::string* spec : {&l.link.codecs.dispatch, &l.link.codecs.combine}) {
      auto p = CodecPipeline::parse(*spec);
      if (p && !p->is_lossless())
        return Status::invalid_argument("needs lossless token codecs (raw or zstd); level " + l.name +
                                        " codes tokens with " + *spec);
    }
  return Status::ok();
}

JobConfig default_job_config() {
  JobConfig job{default_train_config(), default_cluster_spec()};
  // The distributed demo: more tokens per worker and slimmer experts than the
  // one-process default, the regime HybridEP targets (tokens outweigh experts
  // on the slow inter-DC link). examples/2dc.yaml spells out a similar job.
  job.train.batch_size = 16;
  job.train.model.expert_intermediate_size = 128;
  job.train.model.shared_intermediate_size = 128;
  return job;
}

Expected<JobConfig> parse_job_config(const std::string& text, const std::string& source) {
  auto train = parse_train_config(text, source, {"cluster"});
  if (!train) return train.status();
  auto cluster = parse_cluster_spec(text, source);
  if (!cluster) return cluster.status();
  JobConfig job{std::move(*train), std::move(*cluster)};
  if (Status st = job.validate(); !st.is_ok()) return Status::invalid_argument(source + ": " + st.message());
  return job;
}

Expected<JobConfig> load_job_config(const std::string& path) {
  auto text = read_file(path);
  if (!text) return text.status().with_context("cannot read config");
  return parse_job_config(*text, path);
}

nlohmann::json link_codecs_to_json(const LinkCodecs& c) {
  nlohmann::json out = nlohmann::json::object();
  for (auto [kind, spec] : c.by_kind()) out[kind] = *spec;
  return out;
}

namespace {

json cluster_to_json(const ClusterSpec& c) {
  json levels = json::array(), hosts = json::array();
  for (const LevelSpec& l : c.levels)
    levels.push_back({{"name", l.name},
                      {"size", l.size},
                      {"link", {{"name", l.link.name},
                                {"bandwidth_bytes_per_s", l.link.bandwidth_bytes_per_s},
                                {"latency_s", l.link.latency_s},
                                {"shape", l.link.shape},
                                {"codecs", link_codecs_to_json(l.link.codecs)}}}});
  for (const HostSpec& h : c.hosts) hosts.push_back({{"host", h.host}, {"dc", h.dc}, {"slots", h.slots}});
  const ExpertParallelSpec& ep = c.expert_parallel;
  const SecuritySpec& s = c.security;
  return {{"levels", levels},
          {"hosts", hosts},
          {"security", {{"configured", s.configured}, {"insecure", s.insecure}, {"coordinator_key", s.coordinator_key},
                        {"coordinator_public_key", s.coordinator_public_key}, {"worker_key", s.worker_key},
                        {"allowed_keys", s.allowed_keys}, {"read_only_any_key", s.read_only_any_key}}},
          {"expert_parallel", {{"mode", ep_mode_name(ep.mode)},
                               {"domain_sizes", ep.domain_sizes},
                               {"base_sync_every", ep.base_sync_every},
                               {"base_codec", ep.base_codec},
                               {"fused_encode", ep.fused_encode},
                               {"tokens_once_per_worker", tokens_once_per_worker_name(ep.tokens_once_per_worker)},
                               {"pipeline_degree", ep.pipeline_degree},
                               {"backward_pipeline_degree", ep.backward_pipeline_degree},
                               {"replica_weight_gradients",
                                replica_weight_gradients_name(ep.replica_weight_gradients)},
                               // JSON has no infinity: null means no cap.
                               {"memory_cap_bytes", std::isinf(ep.memory_cap_bytes)
                                                        ? json(nullptr) : json(ep.memory_cap_bytes)}}}};
}

template <typename T, typename F>
void read_list(JsonFields& f, const char* key, std::vector<T>* out, F read_one) {
  const json* list = f.object(key);
  if (!list) return;
  if (!list->is_array()) return f.fail(f.name(key), "must be a list");
  out->clear();
  for (size_t i = 0; i < list->size() && f.ok(); ++i) {
    JsonFields item((*list)[i], f.name(key) + "[" + std::to_string(i) + "]");
    T value;
    read_one(item, &value);
    f.fail(item.finish());
    out->push_back(value);
  }
}

// An enum written by its name: `parse` turns the string into *out.
template <typename T>
void get_named(JsonFields& f, const char* key, Expected<T> (*parse)(const std::string&), T* out) {
  std::string name;
  f.get(key, &name);
  if (!f.ok()) return;
  Expected<T> value = parse(name);
  if (!value) return f.fail(f.name(key), value.status().message());
  *out = *value;
}

void cluster_from_json(JsonFields& f, ClusterSpec* c) {
  read_list(f, "levels", &c->levels, [](JsonFields& lf, LevelSpec* l) {
    lf.get("name", &l->name);
    lf.get("size", &l->size);
    const json* link = lf.object("link");
    if (!link) return;
    JsonFields k(*link, lf.name("link"));
    k.get("name", &l->link.name);
    k.get("bandwidth_bytes_per_s", &l->link.bandwidth_bytes_per_s);
    k.get("latency_s", &l->link.latency_s);
    k.get("shape", &l->link.shape);
    if (const json* codecs = k.object("codecs")) {
      JsonFields c(*codecs, k.name("codecs"));
      for (auto [kind, spec] : l->link.codecs.by_kind()) c.get(kind, spec);
      k.fail(c.finish());
    }
    lf.fail(k.finish());
  });
  read_list(f, "hosts", &c->hosts, [](JsonFields& hf, HostSpec* h) {
    hf.get("host", &h->host);
    hf.get("dc", &h->dc);
    hf.get("slots", &h->slots);
  });
  if (const json* sec = f.object("security")) {
    JsonFields s(*sec, f.name("security"));
    s.get("configured", &c->security.configured);
    s.get("insecure", &c->security.insecure);
    s.get("coordinator_key", &c->security.coordinator_key);
    s.get("coordinator_public_key", &c->security.coordinator_public_key);
    s.get("worker_key", &c->security.worker_key);
    s.get("allowed_keys", &c->security.allowed_keys);
    s.get("read_only_any_key", &c->security.read_only_any_key);
    f.fail(s.finish());
  }
  const json* ep = f.object("expert_parallel");
  if (!ep) return;
  JsonFields e(*ep, f.name("expert_parallel"));
  get_named(e, "mode", parse_ep_mode, &c->expert_parallel.mode);
  e.get("domain_sizes", &c->expert_parallel.domain_sizes);
  e.get("base_sync_every", &c->expert_parallel.base_sync_every);
  e.get("base_codec", &c->expert_parallel.base_codec);
  e.get("fused_encode", &c->expert_parallel.fused_encode);
  get_named(e, "tokens_once_per_worker", parse_tokens_once_per_worker, &c->expert_parallel.tokens_once_per_worker);
  e.get("pipeline_degree", &c->expert_parallel.pipeline_degree);
  e.get("backward_pipeline_degree", &c->expert_parallel.backward_pipeline_degree);
  get_named(e, "replica_weight_gradients", parse_replica_weight_gradients,
            &c->expert_parallel.replica_weight_gradients);
  e.get_or_infinity("memory_cap_bytes", &c->expert_parallel.memory_cap_bytes);
  f.fail(e.finish());
}

}  // namespace

json job_config_to_json(const JobConfig& job) {
  const TrainConfig& t = job.train;
  return {{"model", model_config_to_json(t.model)},
          {"data", {{"source", t.data.source},
                    {"builtin_bytes", t.data.builtin_bytes},
                    {"builtin_seed", t.data.builtin_seed},
                    {"validation_fraction", t.data.validation_fraction}}},
          {"optimizer", {{"learning_rate", t.optimizer.learning_rate},
                         {"beta1", t.optimizer.beta1},
                         {"beta2", t.optimizer.beta2},
                         {"eps", t.optimizer.eps},
                         {"weight_decay", t.optimizer.weight_decay},
                         {"grad_clip", t.optimizer.grad_clip}}},
          {"train", {{"steps", t.steps},
                     {"batch_size", t.batch_size},
                     {"seq_len", t.seq_len},
                     {"min_learning_rate", t.min_learning_rate},
                     {"warmup_steps", t.warmup_steps},
                     {"seed", t.seed},
                     {"log_every", t.log_every},
                     {"eval_every", t.eval_every},
                     {"eval_batches", t.eval_batches},
                     {"checkpoint_every", t.checkpoint_every},
                     {"checkpoint_dir", t.checkpoint_dir},
                     {"trace_steps", t.trace_steps},
                     {"trace_dir", t.trace_dir},
                     {"max_restarts", t.max_restarts},
                     {"nan_policy", t.nan_policy}}},
          {"farskip", {{"enabled", t.farskip.enabled},
                       {"overlapped", t.farskip.overlapped},
                       {"attention_only", t.farskip.attention_only},
                       {"moe_only", t.farskip.moe_only}}},
          {"cluster", cluster_to_json(job.cluster)}};
}

Expected<JobConfig> job_config_from_json(const json& j) {
  JobConfig job;
  TrainConfig& t = job.train;
  JsonFields f(j, "job");
  if (const json* model = f.object("model")) {
    auto m = model_config_from_json(*model);
    if (!m) f.fail("job.model", m.status().message());
    else t.model = *m;
  }
  auto section = [&](const char* key, auto read) {
    const json* s = f.object(key);
    if (!s) return;
    JsonFields sf(*s, f.name(key));
    read(sf);
    f.fail(sf.finish());
  };
  section("data", [&](JsonFields& d) {
    d.get("source", &t.data.source);
    d.get("builtin_bytes", &t.data.builtin_bytes);
    d.get("builtin_seed", &t.data.builtin_seed);
    d.get("validation_fraction", &t.data.validation_fraction);
  });
  section("optimizer", [&](JsonFields& o) {
    o.get("learning_rate", &t.optimizer.learning_rate);
    o.get("beta1", &t.optimizer.beta1);
    o.get("beta2", &t.optimizer.beta2);
    o.get("eps", &t.optimizer.eps);
    o.get("weight_decay", &t.optimizer.weight_decay);
    o.get("grad_clip", &t.optimizer.grad_clip);
  });
  section("train", [&](JsonFields& r) {
    r.get("steps", &t.steps);
    r.get("batch_size", &t.batch_size);
    r.get("seq_len", &t.seq_len);
    r.get("min_learning_rate", &t.min_learning_rate);
    r.get("warmup_steps", &t.warmup_steps);
    r.get("seed", &t.seed);
    r.get("log_every", &t.log_every);
    r.get("eval_every", &t.eval_every);
    r.get("eval_batches", &t.eval_batches);
    r.get("checkpoint_every", &t.checkpoint_every);
    r.get("checkpoint_dir", &t.checkpoint_dir);
    r.get("trace_steps", &t.trace_steps);
    r.get("trace_dir", &t.trace_dir);
    r.get("max_restarts", &t.max_restarts);
    r.get("nan_policy", &t.nan_policy);
  });
  section("farskip", [&](JsonFields& r) {
    r.get("enabled", &t.farskip.enabled);
    r.get("overlapped", &t.farskip.overlapped);
    r.get("attention_only", &t.farskip.attention_only);
    r.get("moe_only", &t.farskip.moe_only);
  });
  section("cluster", [&](JsonFields& c) { cluster_from_json(c, &job.cluster); });
  XD_RETURN_IF_ERROR(f.finish());
  if (Status st = job.validate(); !st.is_ok()) return st.with_context("job");
  return job;
}

Status override_expert_parallel(JobConfig* job, const std::string& mode, const std::vector<int>& domain_sizes) {
  ExpertParallelSpec& ep = job->cluster.expert_parallel;
  if (!mode.empty()) {
    auto m = parse_ep_mode(mode);
    if (!m) return m.status().with_context("--mode");
    ep.mode = *m;
    if (ep.mode == EpMode::kEp) ep.domain_sizes.assign(job->cluster.levels.size(), 1);
  }
  if (!domain_sizes.empty()) ep.domain_sizes = domain_sizes;
  return job->validate();
}

Status override_schedule(JobConfig* job, const ScheduleOverrides& o) {
  if (o.farskip) {
    job->train.farskip.enabled = true;
    XD_RETURN_IF_ERROR(apply_farskip(&job->train).with_context("--farskip"));
  }
  if (o.no_overlap) job->train.farskip.overlapped = false;
  if (o.pipeline_degree >= 0) job->cluster.expert_parallel.pipeline_degree = o.pipeline_degree;
  if (o.backward_pipeline_degree >= -1)
    job->cluster.expert_parallel.backward_pipeline_degree = o.backward_pipeline_degree;
  if (!o.replica_weight_gradients.empty()) {
    auto w = parse_replica_weight_gradients(o.replica_weight_gradients);
    if (!w) return w.status().with_context("--replica-weight-gradients");
    job->cluster.expert_parallel.replica_weight_gradients = *w;
  }
  if (o.sr_codecs) {
    if (job->cluster.levels.empty()) return Status::invalid_argument("--sr-codecs: the job has no link class");
    LinkCodecs& outer = job->cluster.levels.front().link.codecs;
    outer.expert_gather = kSrCodecs.expert_gather;
    outer.expert_grad = kSrCodecs.expert_grad;
    outer.dense_grad = kSrCodecs.dense_grad;
    job->cluster.expert_parallel.base_sync_every = kSrCodecs.base_sync_every;
  }
  if (o.delta_weights) {
    if (o.sr_codecs)
      return Status::invalid_argument(
          "--delta-weights and --sr-codecs both set the expert all-gather's codec: pick one");
    if (job->cluster.levels.empty()) return Status::invalid_argument("--delta-weights: the job has no link class");
    job->cluster.levels.front().link.codecs.expert_gather = kDeltaWeights;
  }
  if (!o.tokens_once_per_worker.empty()) {
    auto t = parse_tokens_once_per_worker(o.tokens_once_per_worker);
    if (!t) return t.status().with_context("--tokens-once-per-worker");
    job->cluster.expert_parallel.tokens_once_per_worker = *t;
  }
  if (!o.trace_steps.empty()) job->train.trace_steps = o.trace_steps;
  if (!o.trace_dir.empty()) job->train.trace_dir = o.trace_dir;
  return Status::ok();
}

std::vector<std::string> settings_without_effect(const JobConfig& job) {
  std::vector<std::string> out;
  const ExpertParallelSpec& ep = job.cluster.expert_parallel;
  const bool all_ones = std::all_of(ep.domain_sizes.begin(), ep.domain_sizes.end(), [](int s) { return s == 1; });
  const bool no_replicas = ep.mode == EpMode::kEp || (ep.mode == EpMode::kHybrid && all_ones);
  bool any_sr = false, base_signs = false;  // an sr: all-gather anywhere; the base crossing some level as signs
  for (size_t i = 0; i < job.cluster.levels.size(); ++i) {
    const LinkCodecs& c = job.cluster.levels[i].link.codecs;
    const std::string at = "cluster.levels[" + std::to_string(i) + "].link.codecs.";
    for (const auto& [kind, spec] : {std::pair{"expert_gather", &c.expert_gather}, {"expert_grad", &c.expert_grad}}) {
      auto parsed = ExpertCodecSpec::parse(*spec);
      if (!parsed) continue;  // validate() names it
      any_sr = any_sr || parsed->against_base;  // (sr: is refused on gradients)
      base_signs = base_signs || job.cluster.base_as_signs(i, parsed->against_base);
      if (no_replicas && !parsed->is_raw())
        out.push_back(at + kind + ": no effect: every domain is one worker, so no expert crosses a link");
      for (const ExpertCodecSpec::Switch& w : parsed->later)
        if (w.from_step >= static_cast<uint64_t>(job.train.steps))
          out.push_back(at + kind + ": the switch at step " + std::to_string(w.from_step) +
                        " never applies: the job's last step is " + std::to_string(job.train.steps - 1) +
                        " (the codec schedule counts steps from 0; logs and trace_steps from 1)");
    }
  }
  if (!any_sr && ep.base_sync_every != 1)
    out.push_back("cluster.expert_parallel.base_sync_every: no effect: no link's expert_gather codes against the SR "
                  "base (sr:)");
  if (ep.base_codec != "bf16" && !base_signs)
    out.push_back("cluster.expert_parallel.base_codec: no effect: no link class but the innermost has an sr: "
                  "expert_gather, and the innermost sends the base's sums in bf16");
  if (ep.replica_weight_gradients != ReplicaWeightGradients::kAuto && (no_replicas || !job.train.farskip.overlapped))
    out.push_back("cluster.expert_parallel.replica_weight_gradients: no effect: only an overlapped HybridEP backward "
                  "(replicas, farskip.overlapped: true) schedules the replicas' weight gradients");
  return out;
}

TrainConfig one_process_equivalent(const JobConfig& job) {
  TrainConfig t = job.train;
  t.batch_size = job.train.batch_size * job.cluster.world_size();
  return t;
}

}  // namespace xd
