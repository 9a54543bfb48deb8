// Trainer: single-process training of the MoE transformer (`xdmoe train`).
// Owns the model, the optimizer, the data and the sampler. step() is one
// forward/backward/AdamW update; run() loops with progress lines, periodic
// evaluation and checkpoints. A non-finite loss stops training with an error
// before the update, so the last checkpoint is never overwritten by a broken
// state. Not thread-safe.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "model/adamw.h"
#include "model/batch_sampler.h"
#include "model/moe_transformer.h"
#include "model/train_config.h"

namespace xd {

struct StepStats {
  int64_t step = 0;  // 1-based index of the step just taken
  LossStats loss;
  double grad_norm = 0;
  double learning_rate = 0;
  double seconds = 0;
  double tokens_per_second = 0;
  bool skipped = false;  // not finite, and train.nan_policy "skip": no update
};

// Loads the token stream a config names (built-in corpus or a file).
Expected<std::vector<int32_t>> load_training_tokens(const DataConfig& data);
// How many tokens at the end of that stream are held out for validation
// (data.validation_fraction). Every trainer, and `xdmoe forward --held-out`,
// cuts the same tail.
size_t held_out_tokens(size_t total, const DataConfig& data);

class Trainer {
 public:
  static Expected<std::unique_ptr<Trainer>> create(const TrainConfig& config);

  // Restores weights, optimizer moments, the step and the data position.
  Status resume(const std::string& checkpoint_dir);

  Expected<StepStats> step();
  // Mean cross entropy on the held-out tail (fixed batches), or on training
  // batches drawn with a separate seed when nothing is held out.
  double evaluate();
  Status save_checkpoint(const std::string& dir) const;

  // Trains until config().steps, printing progress to `log` (one line per
  // log_every steps) and writing checkpoints into config().checkpoint_dir.
  Status run(const std::function<void(const std::string&)>& log);

  int64_t current_step() const { return step_; }
  double baseline_unigram_loss() const { return unigram_loss_; }
  const TrainConfig& config() const { return config_; }
  MoeTransformer<float>& model() { return *model_; }
  const std::vector<StepStats>& history() const { return history_; }

 private:
  explicit Trainer(const TrainConfig& config);

  TrainConfig config_;
  std::unique_ptr<ParamLayout> layout_;
  std::unique_ptr<MoeTransformer<float>> model_;
  std::unique_ptr<AdamW<float>> optimizer_;
  std::shared_ptr<const std::vector<int32_t>> train_tokens_, eval_tokens_;
  std::unique_ptr<BatchSampler> sampler_;
  int64_t step_ = 0;
  int skipped_in_a_row_ = 0;
  double unigram_loss_ = 0;
  std::vector<int32_t> inputs_, targets_;
  std::vector<StepStats> history_;
};

}  // namespace xd
