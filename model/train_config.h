// TrainConfig: everything `xdmoe train` needs, read from YAML. Parsing is strict:
// an unknown key, a wrong type or an out-of-range value yields an error that
// names the file, the line and the key. Plain data; copyable.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"
#include "model/adamw.h"
#include "model/model_config.h"

namespace xd {

struct DataConfig {
  std::string source = "builtin";  // "builtin", or a path to any file (bytes are tokens)
  uint64_t builtin_bytes = 1 << 20;
  uint64_t builtin_seed = 1234;
  double validation_fraction = 0.05;  // tail of the corpus held out for evaluation
};

// FarSkip-Collective's switches, named as in its reference implementation
// (the top-level `farskip:` section). `enabled` sets FarSkip connectivity on
// every layer (model.connectivity; `attention_only` / `moe_only` pick the
// partial variants). `overlapped` is about execution, not math, and applies
// to every distributed run: true hides communication behind compute
// (docs/overlap.md); false is the "simple" implementation -- the same
// messages and the same numbers, token exchanges and the dense all-reduce in
// series with compute (HybridEP's expert all-gather and replica gradients
// still run on the communicator's threads).
struct FarSkipConfig {
  bool enabled = false;
  bool overlapped = true;
  bool attention_only = false;
  bool moe_only = false;
};

struct TrainConfig {
  ModelConfig model;
  FarSkipConfig farskip;
  DataConfig data;
  AdamWConfig optimizer;
  int64_t steps = 300;
  int batch_size = 8;          // sequences per step (per worker in distributed runs)
  int seq_len = 64;
  double min_learning_rate = 3e-4;
  int64_t warmup_steps = 20;
  uint64_t seed = 1;           // initialisation and batch sampling
  int64_t log_every = 10;
  int64_t eval_every = 100;    // 0 disables periodic evaluation
  int eval_batches = 4;
  int64_t checkpoint_every = 0;  // 0: only at the end
  std::string checkpoint_dir;    // empty: no checkpoints
  // `xdmoe launch` relaunches a job that lost a worker from its last complete
  // checkpoint, at most this many times (docs/operations.md).
  int max_restarts = 0;
  // A step whose loss or gradient is not finite: "stop" ends the run with an
  // error naming the tensor; "skip" leaves the weights as they were and goes
  // on (the kMaxSkippedInARow-th such step in a row stops the run).
  std::string nan_policy = "stop";
  static constexpr int kMaxSkippedInARow = 10;
  // Steps (1-based) whose timeline each worker writes to trace_dir as a
  // Chrome trace (docs/overlap.md); empty: none.
  std::vector<int64_t> trace_steps;
  std::string trace_dir = "runs/trace";

  Status validate() const;
  double learning_rate_at(int64_t step) const;  // warm-up then cosine decay
};

// The built-in default: a small model that trains on the built-in corpus in
// about a minute on two cores. examples/tiny.yaml spells it out.
TrainConfig default_train_config();

Expected<TrainConfig> load_train_config(const std::string& path);
// Turns farskip.enabled (and its variants) into model.connectivity, then
// validates (validate() names contradictory settings). The parser calls it.
Status apply_farskip(TrainConfig* config);
// `other_sections` names top-level keys that belong to other readers (for
// example "cluster") and are skipped here instead of rejected.
Expected<TrainConfig> parse_train_config(const std::string& yaml_text,
                                         const std::string& source_name = "<string>",
                                         const std::vector<std::string>& other_sections = {});

}  // namespace xd
