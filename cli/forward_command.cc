#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "cluster/job_config.h"
#include "model/byte_tokenizer.h"
#include "model/checkpoint.h"
#include "model/moe_transformer.h"
#include "model/safetensors.h"
#include "model/sliding_window.h"
#include "model/trainer.h"

namespace xd::cli {

namespace {
struct ForwardOptions {
  std::string checkpoint, tokens, held_out, out;
  int window = 0, stride = 0;
};

int fail(const std::string& msg) {
  std::fprintf(stderr, "xdmoe forward: %s\n", msg.c_str());
  return 2;
}

// The held-out tail of the data a config names (a one-process config or a
// distributed job's): the tokens its training never saw.
Expected<std::vector<int32_t>> held_out_of(const std::string& path) {
  auto distributed = has_cluster_section(path);
  if (!distributed) return distributed.status();
  DataConfig data;
  if (*distributed) {
    auto job = load_job_config(path);
    if (!job) return job.status();
    data = job->train.data;
  } else {
    auto cfg = load_train_config(path);
    if (!cfg) return cfg.status();
    data = cfg->data;
  }
  auto all = load_training_tokens(data);
  if (!all) return all.status();
  const size_t n = held_out_tokens(all->size(), data);
  if (n < 2)
    return Status::invalid_argument(path + " holds out " + std::to_string(n) +
                                    " tokens (data.validation_fraction " + std::to_string(data.validation_fraction) +
                                    "): nothing to score");
  return std::vector<int32_t>(all->end() - n, all->end());
}

int run_forward(const ForwardOptions& o) {
  auto ck = load_checkpoint(o.checkpoint);
  if (!ck) return fail(ck.status().message());
  auto tokens = o.held_out.empty() ? ByteTokenizer::encode_file(o.tokens) : held_out_of(o.held_out);
  if (!tokens) return fail(tokens.status().message());
  const ModelConfig& cfg = ck->config;
  const int T = static_cast<int>(tokens->size());
  ParamLayout layout(cfg);
  MoeTransformer<float> model(layout);
  model.params() = ck->params;
  auto eval = evaluate_sliding_window(model, *tokens, {o.window, o.stride});
  if (!eval) return fail(eval.status().message());
  const float loss = static_cast<float>(eval->mean_ce);
  if (!o.out.empty()) {
    std::vector<SafetensorsEntry> out = {
        {"logits", Dtype::kF32, {T, cfg.vocab_size}, eval->logits.data()},
        {"loss", Dtype::kF32, {}, &loss}};
    Status st = write_safetensors(o.out, out, {{"format", "pt"}, {"window", std::to_string(eval->window)},
                                               {"stride", std::to_string(eval->stride)}});
    if (!st.is_ok()) return fail(st.message());
    std::printf("wrote %s: logits (%d, %d), ", o.out.c_str(), T, cfg.vocab_size);
  }
  std::printf("%d tokens%s, loss %.6f", T, o.held_out.empty() ? "" : " held out", loss);
  if (eval->windows > 1)
    std::printf(" (%d windows of %d tokens, stride %d: every token scored once)", eval->windows, eval->window,
                eval->stride);
  std::printf("\n");
  return 0;
}
}  // namespace

void add_forward_command(CLI::App& app, int* exit_code) {
  auto opts = std::make_shared<ForwardOptions>();
  CLI::App* cmd = app.add_subcommand(
      "forward", "Run a checkpoint on a file of byte tokens, or on a config's held-out data; print the loss, write the logits");
  cmd->add_option("--checkpoint", opts->checkpoint, "Checkpoint directory")
      ->required()
      ->check(CLI::ExistingDirectory);
  auto* tokens = cmd->add_option("--tokens", opts->tokens, "File whose bytes are the tokens")
                     ->check(CLI::ExistingFile);
  auto* held_out = cmd->add_option("--held-out", opts->held_out,
                                   "Instead of --tokens: the held-out tail of the data this config trains on "
                                   "(data.validation_fraction; a one-process or a job config)")
                       ->check(CLI::ExistingFile);
  tokens->excludes(held_out);
  cmd->add_option("--out", opts->out, "Output .safetensors: logits (T, V) F32, loss [] F32 (default: none, "
                                      "only the loss is printed)");
  cmd->add_option("--window", opts->window, "Tokens per forward (default: the model's max_seq_len)");
  cmd->add_option("--stride", opts->stride, "Tokens between window starts, 1..window-1 (default: window / 2)");
  cmd->footer(
      "A file longer than the window is evaluated with a sliding window: windows of --window\n"
      "tokens start every --stride tokens (the last one ends at the last token), and each\n"
      "scores only the tokens no earlier window scored, so every token after the first is\n"
      "scored exactly once with at least window - stride tokens of context. `loss` is the\n"
      "mean next-byte cross entropy over all of them; logits row t predicts byte t + 1.\n"
      "See docs/model.md, \"Evaluating long files\".\n\n"
      "--held-out scores the tokens a config's training never saw: the last\n"
      "data.validation_fraction of its data, as every trainer cuts it. Training losses of\n"
      "distributed runs whose replicas are compressed are read through the rebuilt replicas;\n"
      "this scores the owners' exact weights.");
  cmd->callback([opts, exit_code] {
    if (opts->tokens.empty() == opts->held_out.empty()) {
      std::fprintf(stderr, "xdmoe forward: give --tokens FILE or --held-out CONFIG\n");
      *exit_code = 2;
      return;
    }
    *exit_code = run_forward(*opts);
  });
}

}  // namespace xd::cli
