#include "model/trainer.h"

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <limits>

#include "common/clock.h"
#include "model/byte_tokenizer.h"
#include "common/log.h"
#include "model/checkpoint.h"
#include "model/corpus.h"

namespace xd {

namespace {

std::vector<std::pair<size_t, size_t>> norm_ranges(const ParamLayout& layout) {
  std::vector<std::pair<size_t, size_t>> r;
  for (const TensorSlot& s : layout.slots())
    if (s.shape.size() == 1) r.emplace_back(s.offset, s.offset + s.numel());
  return r;
}

std::string format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  int s = static_cast<int>(seconds + 0.5);
  char buf[32];
  std::snprintf(buf, sizeof buf, "%d:%02d:%02d", s / 3600, (s / 60) % 60, s % 60);
  return buf;
}

}  // namespace

Expected<std::vector<int32_t>> load_training_tokens(const DataConfig& data) {
  if (data.source == "builtin")
    return ByteTokenizer::encode(builtin_corpus(data.builtin_seed, data.builtin_bytes));
  auto tokens = ByteTokenizer::encode_file(data.source);
  if (!tokens) return tokens.status().with_context("data.source");
  return tokens;
}

size_t held_out_tokens(size_t total, const DataConfig& data) {
  return static_cast<size_t>(total * data.validation_fraction);
}

Trainer::Trainer(const TrainConfig& config) : config_(config) {}

Expected<std::unique_ptr<Trainer>> Trainer::create(const TrainConfig& config) {
  XD_RETURN_IF_ERROR(config.validate());
  auto tokens = load_training_tokens(config.data);
  if (!tokens) return tokens.status();
  std::unique_ptr<Trainer> t(new Trainer(config));
  const size_t total = tokens->size();
  const size_t held_out = held_out_tokens(total, config.data);
  const size_t window = static_cast<size_t>(config.seq_len) + 1;
  std::vector<int32_t> train(tokens->begin(), tokens->end() - held_out);
  XD_RETURN_IF_ERROR(
      BatchSampler::validate(train.size(), config.batch_size, config.seq_len, 0, 1)
          .with_context("data '" + config.data.source + "' (" + std::to_string(total) + " tokens)"));
  if (held_out >= window)
    t->eval_tokens_ = std::make_shared<std::vector<int32_t>>(tokens->end() - held_out, tokens->end());
  t->unigram_loss_ = unigram_entropy_nats(train);
  t->train_tokens_ = std::make_shared<std::vector<int32_t>>(std::move(train));
  t->sampler_ = std::make_unique<BatchSampler>(t->train_tokens_, config.batch_size,
                                               config.seq_len, config.seed);
  t->layout_ = std::make_unique<ParamLayout>(config.model);
  t->model_ = std::make_unique<MoeTransformer<float>>(*t->layout_);
  t->model_->init(config.seed);
  t->optimizer_ = std::make_unique<AdamW<float>>(t->layout_->size(), config.optimizer,
                                                 norm_ranges(*t->layout_));
  return t;
}

Status Trainer::resume(const std::string& dir) {
  auto ck = load_checkpoint(dir);
  if (!ck) return ck.status();
  if (ck->params.size() != layout_->size())
    return Status::invalid_argument("checkpoint '" + dir +
                                    "' was written for a different model shape than the config");
  if (!ck->has_optimizer)
    return Status::invalid_argument("checkpoint '" + dir + "' has no optimizer state to resume");
  model_->params() = ck->params;
  optimizer_->first_moment() = ck->adam_m;
  optimizer_->second_moment() = ck->adam_v;
  optimizer_->set_step_count(ck->adam_step);
  step_ = ck->trainer.step;
  sampler_->set_position(ck->trainer.data_position);
  return Status::ok();
}

Expected<StepStats> Trainer::step() {
  const auto start = std::chrono::steady_clock::now();
  model_->set_routing_context(RoutingContext{true, config_.seed, sampler_->position(), 0});
  sampler_->next(&inputs_, &targets_);
  model_->zero_grad();
  StepStats s;
  s.loss = model_->forward(inputs_.data(), targets_.data(), config_.batch_size, config_.seq_len);
  s.learning_rate = config_.learning_rate_at(step_);
  // The non-finite guard: nothing is updated from a non-finite loss or gradient.
  std::string why;
  if (!std::isfinite(s.loss.loss)) {
    why = "loss is " + std::to_string(s.loss.loss) + "; weights not finite: " +
          non_finite_tensors(*layout_, model_->params().data());
  } else {
    model_->backward();
    double norm_sq = 0;
    for (float g : model_->grads()) norm_sq += (double)g * g;
    if (std::isfinite(norm_sq))
      s.grad_norm = optimizer_->step(model_->params().data(), model_->grads().data(), s.learning_rate, norm_sq);
    else
      why = "gradient not finite in " + non_finite_tensors(*layout_, model_->grads().data());
  }
  if (!why.empty()) {
    why = "step " + std::to_string(step_ + 1) + ": " + why;
    if (config_.nan_policy != "skip") return Status::internal(why + "; stopping before the update (train.nan_policy: stop)");
    if (++skipped_in_a_row_ >= TrainConfig::kMaxSkippedInARow)
      return Status::internal(why + "; " + std::to_string(skipped_in_a_row_) + " steps in a row were not finite");
    XD_LOG_WARN("trainer", "skipped %s (train.nan_policy: skip)", why.c_str());
    s.skipped = true;
    s.grad_norm = std::numeric_limits<double>::quiet_NaN();
  } else {
    skipped_in_a_row_ = 0;
  }
  s.step = ++step_;
  s.seconds = seconds_since(start);
  s.tokens_per_second = config_.batch_size * config_.seq_len / s.seconds;
  history_.push_back(s);
  return s;
}

double Trainer::evaluate() {
  auto tokens = eval_tokens_ ? eval_tokens_ : train_tokens_;
  BatchSampler eval(tokens, config_.batch_size, config_.seq_len, config_.seed ^ 0x5eedull);
  std::vector<int32_t> in, tg;
  double total = 0;
  model_->set_routing_context(RoutingContext{});  // evaluation: no routing noise
  for (int b = 0; b < config_.eval_batches; ++b) {
    eval.next(&in, &tg);
    total += model_->forward(in.data(), tg.data(), config_.batch_size, config_.seq_len).ce_loss;
  }
  return total / config_.eval_batches;
}

Status Trainer::save_checkpoint(const std::string& dir) const {
  TrainerState st;
  st.step = step_;
  st.data_position = sampler_->position();
  st.seed = config_.seed;
  st.last_loss = history_.empty() ? 0.0 : history_.back().loss.loss;
  return xd::save_checkpoint(dir, *layout_, model_->params().data(),
                             optimizer_->first_moment().data(), optimizer_->second_moment().data(),
                             optimizer_->step_count(), st);
}

Status Trainer::run(const std::function<void(const std::string&)>& log) {
  char line[256];
  std::snprintf(line, sizeof line,
                "training %lld steps, %d x %d tokens per step, %zu parameters, unigram baseline %.3f nats",
                (long long)config_.steps, config_.batch_size, config_.seq_len, layout_->size(),
                unigram_loss_);
  log(line);
  const auto start = std::chrono::steady_clock::now();
  const int64_t first = step_;
  while (step_ < config_.steps) {
    auto s = step();
    if (!s) return s.status();
    const bool last = step_ == config_.steps;
    if (step_ % config_.log_every == 0 || last || step_ == first + 1) {
      const double elapsed = seconds_since(start);
      const double per_step = elapsed / double(step_ - first);
      const double tps = config_.batch_size * config_.seq_len / per_step;
      std::snprintf(line, sizeof line,
                    "step %5lld/%lld | loss %.4f | ce %.4f | aux %.4f | z %.3f | lr %.2e | "
                    "gnorm %.2f | %.0f tok/s | ETA %s",
                    (long long)step_, (long long)config_.steps, s->loss.loss, s->loss.ce_loss,
                    s->loss.aux_loss, s->loss.z_loss, s->learning_rate, s->grad_norm, tps,
                    format_duration(per_step * double(config_.steps - step_)).c_str());
      log(line);
    }
    if (config_.eval_every > 0 && (step_ % config_.eval_every == 0 || last)) {
      std::snprintf(line, sizeof line, "eval  %5lld | held-out ce %.4f nats (unigram %.4f)",
                    (long long)step_, evaluate(), unigram_loss_);
      log(line);
    }
    const bool checkpoint_now =
        !config_.checkpoint_dir.empty() &&
        (last || (config_.checkpoint_every > 0 && step_ % config_.checkpoint_every == 0));
    if (checkpoint_now) {
      const std::string dir = (std::filesystem::path(config_.checkpoint_dir) /
                               checkpoint_dir_name(step_)).string();
      XD_RETURN_IF_ERROR(save_checkpoint(dir));
      log("checkpoint " + dir);
    }
  }
  return Status::ok();
}

}  // namespace xd
