#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "model/byte_tokenizer.h"
#include "model/checkpoint.h"
#include "model/moe_transformer.h"
#include "model/safetensors.h"
#include "model/sliding_window.h"

namespace xd::cli {

namespace {
struct ForwardOptions {
  std::string checkpoint, tokens, out;
  int window = 0, stride = 0;
};

int fail(const std::string& msg) {
  std::fprintf(stderr, "xdmoe forward: %s\n", msg.c_str());
  return 2;
}

int run_forward(const ForwardOptions& o) {
  auto ck = load_checkpoint(o.checkpoint);
  if (!ck) return fail(ck.status().message());
  auto tokens = ByteTokenizer::encode_file(o.tokens);
  if (!tokens) return fail(tokens.status().message());
  const ModelConfig& cfg = ck->config;
  const int T = static_cast<int>(tokens->size());
  ParamLayout layout(cfg);
  MoeTransformer<float> model(layout);
  model.params() = ck->params;
  auto eval = evaluate_sliding_window(model, *tokens, {o.window, o.stride});
  if (!eval) return fail(eval.status().message());
  const float loss = static_cast<float>(eval->mean_ce);
  std::vector<SafetensorsEntry> out = {
      {"logits", Dtype::kF32, {T, cfg.vocab_size}, eval->logits.data()},
      {"loss", Dtype::kF32, {}, &loss}};
  Status st = write_safetensors(o.out, out, {{"format", "pt"}, {"window", std::to_string(eval->window)},
                                             {"stride", std::to_string(eval->stride)}});
  if (!st.is_ok()) return fail(st.message());
  std::printf("wrote %s: logits (%d, %d), loss %.6f", o.out.c_str(), T, cfg.vocab_size, loss);
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
      "forward", "Run a checkpoint on a file of byte tokens; write logits and loss");
  cmd->add_option("--checkpoint", opts->checkpoint, "Checkpoint directory")
      ->required()
      ->check(CLI::ExistingDirectory);
  cmd->add_option("--tokens", opts->tokens, "File whose bytes are the tokens")
      ->required()
      ->check(CLI::ExistingFile);
  cmd->add_option("--out", opts->out, "Output .safetensors: logits (T, V) F32, loss [] F32")
      ->required();
  cmd->add_option("--window", opts->window, "Tokens per forward (default: the model's max_seq_len)");
  cmd->add_option("--stride", opts->stride, "Tokens between window starts, 1..window-1 (default: window / 2)");
  cmd->footer(
      "A file longer than the window is evaluated with a sliding window: windows of --window\n"
      "tokens start every --stride tokens (the last one ends at the last token), and each\n"
      "scores only the tokens no earlier window scored, so every token after the first is\n"
      "scored exactly once with at least window - stride tokens of context. `loss` is the\n"
      "mean next-byte cross entropy over all of them; logits row t predicts byte t + 1.\n"
      "See docs/model.md, \"Evaluating long files\".");
  cmd->callback([opts, exit_code] { *exit_code = run_forward(*opts); });
}

}  // namespace xd::cli
