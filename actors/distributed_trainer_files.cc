// DistributedTrainer's files (distributed_trainer.h): the Chrome trace of
// a chosen step, and the checkpoint shard it writes and resumes from.
#include <algorithm>
#include <filesystem>
#include <set>

#include <nlohmann/json.hpp>

#include "actors/distributed_trainer.h"
#include "common/atomic_file.h"
#include "common/log.h"
#include "model/checkpoint.h"
#include "model/distributed_checkpoint.h"
#include "model/hf_config.h"

namespace xd {

bool DistributedTrainer::traces(int64_t step) const {
  const std::vector<int64_t>& steps = job_.train.trace_steps;
  return std::find(steps.begin(), steps.end(), step) != steps.end();
}

void DistributedTrainer::write_trace(int64_t step) {
  timeline_.set_enabled(false);
  const std::vector<Span> spans = timeline_.take();
  double t0 = 1e300;
  for (const Span& s : spans) t0 = std::min(t0, s.start_s);
  nlohmann::json events = nlohmann::json::array();
  const int pid = opts_.rank;
  events.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", pid},
                    {"args", {{"name", "worker " + std::to_string(pid)}}}});
  for (Lane lane : {Lane::kCompute, Lane::kToExperts, Lane::kToSources, Lane::kExperts, Lane::kDense})
    events.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", pid}, {"tid", (int)lane},
                      {"args", {{"name", lane_name(lane)}}}});
  // Each shaped link class's egress gets a row of its own after the threads.
  auto link_name = [&](int c) {
    return (c < (int)opts_.link_names.size() ? opts_.link_names[c] : "class " + std::to_string(c)) + " link egress";
  };
  std::set<int> link_classes;
  for (const Span& s : spans)
    if (s.lane == Lane::kLink) link_classes.insert(s.layer);
  for (int c : link_classes)
    events.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", pid}, {"tid", (int)Lane::kLink + c},
                      {"args", {{"name", link_name(c)}}}});
  for (const Span& s : spans) {
    const bool link = s.lane == Lane::kLink;
    nlohmann::json e = {{"name", s.name},
                        {"cat", s.wait ? "wait" : link ? "link" : s.lane == Lane::kCompute ? "compute" : "comm"},
                        {"ph", "X"}, {"pid", pid}, {"tid", (int)s.lane + (link ? s.layer : 0)},
                        {"ts", (s.start_s - t0) * 1e6}, {"dur", (s.end_s - s.start_s) * 1e6}};
    if (link) e["args"] = {{"link", link_name(s.layer)}};
    else if (s.layer >= 0) e["args"] = {{"layer", s.layer}};
    events.push_back(std::move(e));
  }
  nlohmann::json trace = {{"traceEvents", events}, {"displayTimeUnit", "ms"},
                          {"otherData", {{"step", step}, {"rank", pid}, {"steady_t0_s", t0}}}};
  std::error_code ec;
  std::filesystem::create_directories(job_.train.trace_dir, ec);
  const std::string path = job_.train.trace_dir + "/trace-step" + std::to_string(step) + "-rank" +
                           std::to_string(pid) + ".json";
  const std::string text = trace.dump();
  Status st = write_file_atomic(path, text.data(), text.size());
  if (!st.is_ok()) XD_LOG_WARN("trainer", "cannot write the trace: %s", st.message().c_str());
}

Expected<ShardRecord> DistributedTrainer::save_checkpoint_shard(const std::string& dir) const {
  // The dense parameters are the same on every worker (all-reduced
  // gradients, same updates): rank 0 writes them once.
  return xd::save_checkpoint_shard(dir, opts_.rank, world_, *layout_, model_->params().data(),
                                   optimizer_->first_moment().data(), optimizer_->second_moment().data(),
                                   optimizer_->step_count(), step_, opts_.rank == 0);
}

Status DistributedTrainer::resume(const std::string& dir) {
  auto ck = load_checkpoint(dir);
  if (!ck) return ck.status();
  if (model_config_to_json(ck->config) != model_config_to_json(job_.train.model))
    return Status::invalid_argument("checkpoint " + dir + " is of another model than the job's (config.json differs)");
  if (!ck->has_optimizer) return Status::invalid_argument("checkpoint " + dir + " has no optimizer state to resume");
  // The full layout's offsets, by name: this worker's slice of every tensor.
  const ParamLayout full(ck->config);
  std::vector<float>& p = model_->params();
  std::vector<float>& m = optimizer_->first_moment();
  std::vector<float>& v = optimizer_->second_moment();
  for (const TensorSlot& s : layout_->slots()) {
    const TensorSlot* from = full.find(s.name);
    XD_CHECK(from && from->numel() == s.numel());
    std::copy_n(ck->params.begin() + from->offset, s.numel(), p.begin() + s.offset);
    std::copy_n(ck->adam_m.begin() + from->offset, s.numel(), m.begin() + s.offset);
    std::copy_n(ck->adam_v.begin() + from->offset, s.numel(), v.begin() + s.offset);
  }
  optimizer_->set_step_count(ck->adam_step);
  step_ = ck->trainer.step;
  sampler_->set_position(ck->trainer.data_position);
  if (step_ >= job_.train.steps)
    return Status::invalid_argument("checkpoint " + dir + " is at step " + std::to_string(step_) +
                                    ", already the job's last (train.steps " + std::to_string(job_.train.steps) + ")");
  XD_LOG_INFO("trainer", "rank %d: resumed from %s at step %lld (experts %d..%d of %d)", opts_.rank, dir.c_str(),
              (long long)step_, layout_->first_expert(), layout_->first_expert() + layout_->num_local_experts() - 1,
              ck->config.num_experts);
  return Status::ok();
}

std::string DistributedTrainer::non_finite_gradients() const {
  return non_finite_tensors(*layout_, model_->grads().data(),
                            "every local gradient is finite (the non-finite values are on other workers)");
}

}  // namespace xd
