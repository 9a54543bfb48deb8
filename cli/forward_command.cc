#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "model/byte_tokenizer.h"
#include "model/checkpoint.h"
#include "model/moe_transformer.h"
#include "model/ops.h"
#include "model/safetensors.h"

namespace xd::cli {

namespace {
struct ForwardOptions {
  std::string checkpoint, tokens, out;
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
  if (T > cfg.max_seq_len)
    return fail("'" + o.tokens + "' has " + std::to_string(T) +
                " tokens, more than the model's max_seq_len " + std::to_string(cfg.max_seq_len));
  ParamLayout layout(cfg);
  MoeTransformer<float> model(layout);
  model.params() = ck->params;
  model.forward(tokens->data(), nullptr, 1, T);
  const std::vector<float>& logits = model.logits();
  // Mean cross entropy of predicting byte t+1 from positions 0..t.
  float loss = 0;
  if (T > 1)
    loss = static_cast<float>(cross_entropy_forward_backward<float>(
        nullptr, logits.data(), tokens->data() + 1, T - 1, cfg.vocab_size, 1.0));
  std::vector<SafetensorsEntry> out = {
      {"logits", Dtype::kF32, {T, cfg.vocab_size}, logits.data()},
      {"loss", Dtype::kF32, {}, &loss}};
  Status st = write_safetensors(o.out, out, {{"format", "pt"}});
  if (!st.is_ok()) return fail(st.message());
  std::printf("wrote %s: logits (%d, %d), loss %.6f\n", o.out.c_str(), T, cfg.vocab_size, loss);
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
  cmd->callback([opts, exit_code] { *exit_code = run_forward(*opts); });
}

}  // namespace xd::cli
