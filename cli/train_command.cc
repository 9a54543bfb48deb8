#include <cstdio>
#include <memory>
#include <string>

#include "cli/commands.h"
#include "model/trainer.h"

namespace xd::cli {

namespace {
struct TrainOptions {
  std::string config;
  std::string resume;
  int64_t steps = 0;
  std::string checkpoint_dir;
};

int run_train(const TrainOptions& o) {
  TrainConfig config = default_train_config();
  if (!o.config.empty()) {
    auto loaded = load_train_config(o.config);
    if (!loaded) {
      std::fprintf(stderr, "xdmoe train: %s\n", loaded.status().message().c_str());
      return 2;
    }
    config = *loaded;
  } else {
    std::printf("no --config given: using the built-in default (see examples/tiny.yaml)\n");
  }
  if (o.steps > 0) config.steps = o.steps;
  if (!o.checkpoint_dir.empty()) config.checkpoint_dir = o.checkpoint_dir;
  auto trainer = Trainer::create(config);
  if (!trainer) {
    std::fprintf(stderr, "xdmoe train: %s\n", trainer.status().message().c_str());
    return 2;
  }
  if (!o.resume.empty()) {
    Status st = (*trainer)->resume(o.resume);
    if (!st.is_ok()) {
      std::fprintf(stderr, "xdmoe train: resume: %s\n", st.message().c_str());
      return 2;
    }
    std::printf("resumed from %s at step %lld\n", o.resume.c_str(),
                (long long)(*trainer)->current_step());
  }
  Status st = (*trainer)->run([](const std::string& line) {
    std::printf("%s\n", line.c_str());
    std::fflush(stdout);
  });
  if (!st.is_ok()) {
    std::fprintf(stderr, "xdmoe train: %s\n", st.message().c_str());
    return 1;
  }
  const auto& h = (*trainer)->history();
  if (!h.empty())
    std::printf("done: %lld steps, final loss %.4f (ce %.4f), unigram baseline %.4f\n",
                (long long)(*trainer)->current_step(), h.back().loss.loss, h.back().loss.ce_loss,
                (*trainer)->baseline_unigram_loss());
  return 0;
}
}  // namespace

void add_train_command(CLI::App& app, int* exit_code) {
  auto opts = std::make_shared<TrainOptions>();
  CLI::App* cmd = app.add_subcommand("train", "Train the MoE model in this one process");
  cmd->add_option("--config", opts->config, "YAML config (default: the built-in tiny model)")
      ->check(CLI::ExistingFile);
  cmd->add_option("--resume", opts->resume, "Checkpoint directory to resume from")
      ->check(CLI::ExistingDirectory);
  cmd->add_option("--steps", opts->steps, "Override train.steps");
  cmd->add_option("--checkpoint-dir", opts->checkpoint_dir, "Override train.checkpoint_dir");
  cmd->callback([opts, exit_code] { *exit_code = run_train(*opts); });
}

}  // namespace xd::cli
