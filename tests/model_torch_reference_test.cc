// Cross-checks the hand-written C++ model against tests/reference/mixtral_reference.py,
// an independent PyTorch implementation of docs/model.md evaluated in float64.
// Each case saves a checkpoint of a small random float model and a batch, runs the
// script, and compares logits, losses and the gradient of every parameter tensor.
// Skips (with the reason) when /usr/bin/python3 or torch is missing.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "model/checkpoint.h"
#include "common/rng.h"
#include "model/moe_transformer.h"
#include "model/safetensors.h"
#include "test_util.h"

namespace xd {
namespace {

using test_util::random_tokens;

namespace fs = std::filesystem;

constexpr const char* kPython = "/usr/bin/python3";
const std::string kScript = std::string(XD_SOURCE_DIR) + "/tests/reference/mixtral_reference.py";

using test_util::TempDir;

std::string slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::string quoted(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += (c == '\'') ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

// Empty when python3 with torch is usable, else why not. Checked once.
const std::string& torch_unavailable_reason() {
  static const std::string reason = [] {
    if (::access(kPython, X_OK) != 0) return std::string(kPython) + " is not available";
    std::string cmd = std::string(kPython) + " -c 'import torch' >/dev/null 2>&1";
    if (std::system(cmd.c_str()) != 0)
      return std::string("`import torch` fails under ") + kPython;
    return std::string();
  }();
  return reason;
}

struct ScriptRun {
  int exit_code = -1;
  std::string stderr_text;
};

// Runs the reference script; stderr is captured into `err_path`.
ScriptRun run_script(const std::string& args, const std::string& err_path) {
  std::string cmd = std::string(kPython) + " " + quoted(kScript) + " " + args + " 2>" +
                    quoted(err_path);
  int rc = std::system(cmd.c_str());
  ScriptRun r;
  r.exit_code = (rc != -1 && WIFEXITED(rc)) ? WEXITSTATUS(rc) : -1;
  r.stderr_text = slurp(err_path);
  return r;
}

// Reads tensor `name` of `dtype` and shape `shape` from `f` as doubles.
std::vector<double> read_tensor(const SafetensorsFile& f, const std::string& name, Dtype dtype,
                                const std::vector<int64_t>& shape) {
  const TensorInfo* t = f.find(name);
  EXPECT_NE(t, nullptr) << f.path() << ": no tensor " << name;
  if (!t) return {};
  EXPECT_EQ(t->dtype, dtype) << name;
  EXPECT_EQ(t->shape, shape) << name;
  if (t->dtype != dtype || t->shape != shape) return {};
  std::vector<double> out(t->numel());
  const char* p = static_cast<const char*>(t->data);
  for (size_t i = 0; i < out.size(); ++i) {
    if (dtype == Dtype::kF64) {
      std::memcpy(&out[i], p + 8 * i, 8);
    } else {
      float v;
      std::memcpy(&v, p + 4 * i, 4);
      out[i] = v;
    }
  }
  return out;
}

double read_scalar(const SafetensorsFile& f, const std::string& name) {
  std::vector<double> v = read_tensor(f, name, Dtype::kF64, {});
  return v.empty() ? NAN : v[0];
}

// ---------------------------------------------------------------- cases
struct RefCase {
  std::string name;
  ModelConfig cfg;
  bool training = false;  // routes with the GShard noise of kNoise
};
// Rows 3.. of step 4's global batch: exercises the global token index of the noise.
constexpr RoutingContext kNoise{true, 9, 4, 3};
void PrintTo(const RefCase& c, std::ostream* os) { *os << c.name; }

ModelConfig small_config() {
  ModelConfig c;
  c.vocab_size = 256;
  c.hidden_size = 32;
  c.num_layers = 2;
  c.num_heads = 4;
  c.num_kv_heads = 2;  // grouped KV heads
  c.max_seq_len = 16;
  c.num_experts = 4;
  c.top_k = 2;
  c.expert_intermediate_size = 24;
  c.num_shared_experts = 1;
  c.shared_intermediate_size = 16;
  c.gating = Gating::kSoftmaxTopK;
  c.aux_loss_coef = 0.1;  // large enough that their gradients weigh in
  c.z_loss_coef = 0.05;
  c.init_std = 0.2;       // sharp routing: no near-ties between float and float64
  return c;
}

RefCase make_case(std::string name, Gating g, std::vector<Connectivity> conn, double capacity = 0) {
  RefCase rc{std::move(name), small_config()};
  rc.cfg.gating = g;
  rc.cfg.num_layers = static_cast<int>(conn.size());
  rc.cfg.connectivity = std::move(conn);
  rc.cfg.capacity_factor = capacity;
  return rc;
}

std::vector<RefCase> all_cases() {
  using C = Connectivity;
  const std::vector<C> reg = {C::kRegular, C::kRegular};
  RefCase gshard_training = make_case("GShardNoisyTopKInTraining", Gating::kGShardNoisyTopK, reg);
  gshard_training.training = true;
  RefCase xmoe = make_case("XMoeCosineRouting", Gating::kXMoe, reg);
  xmoe.cfg.router_dim = 3;
  RefCase soft_moe = make_case("SoftMoeCausalTwoSlotsPerExpert", Gating::kSoftMoe, reg);
  soft_moe.cfg.soft_moe_slots = 2;
  RefCase soft_moe_farskip = make_case("SoftMoeOnFarSkipLayers", Gating::kSoftMoe, {C::kFarSkip, C::kFarSkip});
  return {
      make_case("SoftmaxTopKRegularGqaShared", Gating::kSoftmaxTopK, reg),
      make_case("FarSkipOnEveryLayer", Gating::kSoftmaxTopK, {C::kFarSkip, C::kFarSkip}),
      // Three layers: farskip_attention is a no-op on layer 0 (r_0 = 0), so it recurs on
      // layer 2 where it changes the attention input.
      make_case("MixedFarSkipAttentionFarSkipMoeFarSkipAttention", Gating::kSoftmaxTopK,
                {C::kFarSkipAttention, C::kFarSkipMoe, C::kFarSkipAttention}),
      make_case("SigmoidTopK", Gating::kSigmoidTopK, reg),
      make_case("ExpertChoice", Gating::kExpertChoice, reg),
      make_case("SoftmaxTopKWithCapacityFactor075", Gating::kSoftmaxTopK, reg, 0.75),
      gshard_training,
      make_case("GShardNoisyTopKAtEvaluationHasNoNoise", Gating::kGShardNoisyTopK, reg),
      xmoe,
      soft_moe,
      soft_moe_farskip,
  };
}

class SmallModel : public ::testing::TestWithParam<RefCase> {};

TEST_P(SmallModel, LogitsLossesAndGradientsMatchTheDocumentedForwardInPyTorch) {
  if (!torch_unavailable_reason().empty()) {
    std::printf("[torch-ref] skipped: %s\n", torch_unavailable_reason().c_str());
    GTEST_SKIP() << torch_unavailable_reason();
  }
  const RefCase& rc = GetParam();
  const ModelConfig& cfg = rc.cfg;
  ASSERT_TRUE(cfg.validate().is_ok()) << cfg.validate().to_string();
  const int B = 2, T = 16, N = B * T, V = cfg.vocab_size;

  ParamLayout layout(cfg);
  MoeTransformer<float> model(layout);
  model.init(1234);
  // The noise weights start at 0 (softplus(0) for every token); random ones
  // make the check see how the noise scale depends on the token.
  test_util::randomise_tensors(layout, model.params().data(), ".gate_noise.", 0.5, 77);
  if (rc.training) model.set_routing_context(kNoise);
  std::vector<int32_t> in = random_tokens(N, V, 11), tg = random_tokens(N, V, 12);
  model.zero_grad();
  LossStats st = model.forward(in.data(), tg.data(), B, T);
  model.backward();
  if (cfg.capacity_factor > 0 && cfg.gating != Gating::kExpertChoice) {
    EXPECT_GT(st.dropped, 0) << "the capacity case should drop assignments";
  }

  TempDir tmp;
  const std::string ckpt = tmp / "ckpt", batch = tmp / "batch.safetensors",
                    out = tmp / "out.safetensors";
  Status s = save_checkpoint(ckpt, layout, model.params().data(), nullptr, nullptr, 0,
                             TrainerState{});
  ASSERT_TRUE(s.is_ok()) << s.to_string();
  std::vector<int64_t> in64(in.begin(), in.end()), tg64(tg.begin(), tg.end());
  s = write_safetensors(batch, {{"inputs", Dtype::kI64, {B, T}, in64.data()},
                                {"targets", Dtype::kI64, {B, T}, tg64.data()}});
  ASSERT_TRUE(s.is_ok()) << s.to_string();

  std::string noise_flags;
  if (rc.training)
    noise_flags = " --noise-seed " + std::to_string(kNoise.seed) + " --noise-step " + std::to_string(kNoise.step) +
                  " --noise-first-row " + std::to_string(kNoise.first_row);
  ScriptRun run = run_script("--checkpoint " + quoted(ckpt) + " --batch " + quoted(batch) +
                                 " --out " + quoted(out) + noise_flags,
                             tmp / "stderr.txt");
  ASSERT_EQ(run.exit_code, 0) << "mixtral_reference.py failed; its stderr:\n" << run.stderr_text;
  Expected<SafetensorsFile> ref = SafetensorsFile::open(out);
  ASSERT_TRUE(ref.has_value()) << ref.status().to_string();

  // Logits.
  std::vector<double> ref_logits = read_tensor(*ref, "logits", Dtype::kF32, {N, V});
  ASSERT_EQ(ref_logits.size(), model.logits().size());
  double max_logit_diff = 0;
  for (size_t i = 0; i < ref_logits.size(); ++i)
    max_logit_diff = std::max(max_logit_diff, std::abs(ref_logits[i] - model.logits()[i]));

  // Losses.
  const double loss = read_scalar(*ref, "loss"), ce = read_scalar(*ref, "ce_loss"),
               aux = read_scalar(*ref, "aux_loss"), z = read_scalar(*ref, "z_loss");
  const double loss_rel = std::abs(st.loss - loss) / std::abs(loss);

  // Gradients, tensor by tensor.
  double worst_err = 0;
  std::string worst_name = "(none)";
  for (const TensorSlot& slot : layout.slots()) {
    std::vector<double> g = read_tensor(*ref, "grad." + slot.name, Dtype::kF64, slot.shape);
    ASSERT_EQ(g.size(), slot.numel()) << slot.name;
    double diff2 = 0, ref2 = 0;
    for (size_t i = 0; i < g.size(); ++i) {
      double d = model.grads()[slot.offset + i] - g[i];
      diff2 += d * d;
      ref2 += g[i] * g[i];
    }
    // A tensor without gradient (an expert no token reached) must have none here too.
    double err = ref2 > 0 ? std::sqrt(diff2 / ref2) : std::sqrt(diff2);
    EXPECT_LT(err, 1e-3) << "gradient of " << slot.name;
    if (err >= worst_err) {
      worst_err = err;
      worst_name = slot.name;
    }
  }

  std::printf(
      "[torch-ref] %s: max |logit diff| %.3e, loss rel diff %.3e (cpp %.6f, torch %.6f), "
      "worst grad rel error %.3e (%s), dropped %lld\n",
      rc.name.c_str(), max_logit_diff, loss_rel, st.loss, loss, worst_err, worst_name.c_str(),
      static_cast<long long>(st.dropped));
  EXPECT_LT(max_logit_diff, 1e-4);
  EXPECT_LT(loss_rel, 1e-5);
  EXPECT_NEAR(st.ce_loss, ce, 1e-5 * std::abs(ce));
  EXPECT_NEAR(st.aux_loss, aux, 1e-5 * std::max(1.0, std::abs(aux)));
  EXPECT_NEAR(st.z_loss, z, 1e-5 * std::max(1.0, std::abs(z)));
  if (cfg.gating == Gating::kExpertChoice || cfg.gating == Gating::kSoftMoe) {
    EXPECT_EQ(aux, 0.0);
  }
}

// Full names read "TorchReference/SmallModel.<test>/<case>".
INSTANTIATE_TEST_SUITE_P(TorchReference, SmallModel, ::testing::ValuesIn(all_cases()),
                         [](const auto& info) { return info.param.name; });

TEST(TorchReferenceScript, FailsWithAMessageNamingTheMissingCheckpointFile) {
  if (!torch_unavailable_reason().empty()) GTEST_SKIP() << torch_unavailable_reason();
  TempDir tmp;
  ScriptRun run = run_script("--checkpoint " + quoted(tmp / "nowhere") + " --batch " +
                                 quoted(tmp / "b.safetensors") + " --out " +
                                 quoted(tmp / "o.safetensors"),
                             tmp / "stderr.txt");
  EXPECT_NE(run.exit_code, 0);
  EXPECT_NE(run.stderr_text.find("config.json"), std::string::npos) << run.stderr_text;
  EXPECT_EQ(run.stderr_text.find("Traceback"), std::string::npos) << run.stderr_text;
}

}  // namespace
}  // namespace xd
