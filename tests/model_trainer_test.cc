#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <cstring>
#include <fstream>
#include <limits>
#include <set>

#include "model/adamw.h"
#include "model/checkpoint.h"
#include "model/batch_sampler.h"
#include "model/trainer.h"

namespace xd {
namespace {

namespace fs = std::filesystem;

TrainConfig small_config() {
  TrainConfig c = default_train_config();
  c.model.hidden_size = 64;
  c.model.num_layers = 2;
  c.model.num_experts = 4;
  c.model.expert_intermediate_size = 128;
  c.model.shared_intermediate_size = 128;
  c.model.max_seq_len = 32;
  c.model.connectivity.assign(2, Connectivity::kFarSkip);
  c.seq_len = 32;
  c.batch_size = 8;
  c.steps = 150;
  c.warmup_steps = 10;
  c.data.builtin_bytes = 256 * 1024;
  c.eval_every = 0;
  return c;
}

fs::path temp_dir(const std::string& name) {
  fs::path p = fs::temp_directory_path() / ("xdmoe_test_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  return p;
}

TEST(AdamW, AHookAfterEachBlockSeesEveryElementOnceInOrderWithItsNewValueAndChangesNoBit) {
  const size_t n = 3 * AdamW<float>::kBlock + 123;
  std::vector<float> p0(n), g0(n);
  for (size_t i = 0; i < n; ++i) {
    p0[i] = std::sin(0.37 * i);
    g0[i] = std::cos(0.11 * i);
  }
  AdamW<float> plain(n, AdamWConfig{}), hooked(n, AdamWConfig{});
  std::vector<float> pa = p0, ga = g0, pb = p0, gb = g0;
  for (int step = 0; step < 3; ++step) {
    plain.step(pa.data(), ga.data(), 1e-2);
    size_t next = 0;
    std::vector<float> seen;
    hooked.step(pb.data(), gb.data(), 1e-2, -1.0, [&](size_t begin, size_t end) {
      EXPECT_EQ(begin, next) << "blocks in order, none skipped";
      EXPECT_GT(end, begin);
      EXPECT_LE(end - begin, AdamW<float>::kBlock);
      seen.insert(seen.end(), pb.begin() + begin, pb.begin() + end);  // already updated
      next = end;
    });
    EXPECT_EQ(next, n);
    ASSERT_EQ(0, std::memcmp(pa.data(), pb.data(), n * sizeof(float))) << "step " << step;
    ASSERT_EQ(0, std::memcmp(seen.data(), pa.data(), n * sizeof(float))) << "the hook sees the new values";
  }
}

TEST(Training, LossFallsWellBelowTheUnigramBaselineOnTheBuiltinCorpus) {
  auto trainer = Trainer::create(small_config());
  ASSERT_TRUE(trainer) << trainer.status().to_string();
  Status st = (*trainer)->run([](const std::string&) {});
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  const double unigram = (*trainer)->baseline_unigram_loss();
  const double first = (*trainer)->history().front().loss.ce_loss;
  const double held_out = (*trainer)->evaluate();
  std::printf("[train] first ce %.4f, held-out ce after 150 steps %.4f, unigram %.4f\n", first,
              held_out, unigram);
  EXPECT_GT(first, unigram);  // starts near ln(256)
  EXPECT_LT(held_out, unigram - 1.0);
}

TEST(Training, TwoRunsWithTheSameSeedGiveBitIdenticalLosses) {
  TrainConfig c = small_config();
  c.steps = 5;
  auto a = Trainer::create(c), b = Trainer::create(c);
  ASSERT_TRUE(a && b);
  for (int i = 0; i < 5; ++i) EXPECT_EQ((*a)->step()->loss.loss, (*b)->step()->loss.loss);
}

TEST(Checkpoint, SaveThenLoadGivesABitIdenticalForward) {
  TrainConfig c = small_config();
  auto t = Trainer::create(c);
  ASSERT_TRUE(t);
  for (int i = 0; i < 3; ++i) ASSERT_TRUE((*t)->step());
  fs::path dir = temp_dir("roundtrip");
  ASSERT_TRUE((*t)->save_checkpoint(dir.string()).is_ok());
  auto ck = load_checkpoint(dir.string());
  ASSERT_TRUE(ck) << ck.status().to_string();
  ParamLayout layout(ck->config);
  MoeTransformer<float> loaded(layout);
  loaded.params() = ck->params;
  std::vector<int32_t> tokens(32);
  for (int i = 0; i < 32; ++i) tokens[i] = (i * 37) % 256;
  (*t)->model().forward(tokens.data(), nullptr, 1, 32);
  loaded.forward(tokens.data(), nullptr, 1, 32);
  EXPECT_EQ((*t)->model().logits(), loaded.logits());
  fs::remove_all(dir);
}

class ResumeWithGating : public ::testing::TestWithParam<Gating> {};

// GShard's noise is keyed by the batch index, so a resumed run draws what the
// uninterrupted one drew; every other router has no state beyond the weights.
TEST_P(ResumeWithGating, ResumingGivesTheSameNextLossesAsAnUninterruptedRun) {
  TrainConfig c = small_config();
  c.model.gating = GetParam();
  c.steps = 12;
  auto straight = Trainer::create(c);
  ASSERT_TRUE(straight);
  std::vector<double> expected;
  for (int i = 0; i < 12; ++i) expected.push_back((*straight)->step()->loss.loss);

  fs::path dir = temp_dir("resume");
  {
    auto first = Trainer::create(c);
    for (int i = 0; i < 6; ++i) ASSERT_TRUE((*first)->step());
    ASSERT_TRUE((*first)->save_checkpoint(dir.string()).is_ok());
  }
  auto resumed = Trainer::create(c);
  ASSERT_TRUE((*resumed)->resume(dir.string()).is_ok());
  EXPECT_EQ((*resumed)->current_step(), 6);
  for (int i = 6; i < 12; ++i) EXPECT_EQ((*resumed)->step()->loss.loss, expected[i]) << "step " << i + 1;
  EXPECT_EQ((*resumed)->model().routing_context().training, true) << "a training step routes as in training";
  (*resumed)->evaluate();
  EXPECT_EQ((*resumed)->model().routing_context().training, false) << "evaluation routes without noise";
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Checkpoint, ResumeWithGating,
                         ::testing::Values(Gating::kSoftmaxTopK, Gating::kGShardNoisyTopK, Gating::kXMoe,
                                           Gating::kSoftMoe),
                         [](const auto& info) { return std::string(gating_name(info.param)); });

TEST(Training, NonFiniteLossStopsBeforeTheUpdateWithAClearError) {
  TrainConfig c = small_config();
  auto t = Trainer::create(c);
  ASSERT_TRUE(t);
  std::vector<float> before = (*t)->model().params();
  (*t)->model().weights().lm_head[0] = std::nanf("");
  before[(*t)->model().layout().find("lm_head.weight")->offset] = std::nanf("");
  auto s = (*t)->step();
  ASSERT_FALSE(s);
  EXPECT_NE(s.status().message().find("loss is"), std::string::npos) << s.status().message();
  EXPECT_EQ((*t)->current_step(), 0);
  // Parameters other than the poisoned one are untouched.
  const std::vector<float>& after = (*t)->model().params();
  for (size_t i = 0; i < after.size(); ++i) {
    if (!std::isnan(before[i])) {
      ASSERT_EQ(before[i], after[i]) << i;
    }
  }
}

TEST(Training, WithNanPolicySkipAStepWithANonFiniteLossChangesNothingAndTrainingGoesOn) {
  TrainConfig c = small_config();
  c.nan_policy = "skip";
  c.batch_size = 2;
  c.seq_len = 8;
  // A byte that some of the first ten batches read and others do not: its
  // embedding row, poisoned, makes exactly those steps non-finite.
  auto tokens = load_training_tokens(c.data);
  ASSERT_TRUE(tokens);
  const size_t held_out = static_cast<size_t>(tokens->size() * c.data.validation_fraction);
  auto train = std::make_shared<std::vector<int32_t>>(tokens->begin(), tokens->end() - held_out);
  BatchSampler sampler(train, c.batch_size, c.seq_len, c.seed);
  std::vector<std::set<int32_t>> seen(10);
  std::vector<int32_t> in, tg;
  for (auto& s : seen) {
    sampler.next(&in, &tg);
    s.insert(in.begin(), in.end());
  }
  int32_t poisoned = -1;
  for (int32_t t = 0; t < 256 && poisoned < 0; ++t) {
    int n = 0;
    for (const auto& s : seen) n += s.count(t);
    if (n >= 2 && n <= 6) poisoned = t;
  }
  ASSERT_GE(poisoned, 0);
  auto t = Trainer::create(c);
  ASSERT_TRUE(t);
  const TensorSlot* embed = (*t)->model().layout().find("model.embed_tokens.weight");
  ASSERT_NE(embed, nullptr);
  (*t)->model().params()[embed->offset + (size_t)poisoned * c.model.hidden_size] = std::nanf("");
  int skipped = 0;
  for (int step = 0; step < 10; ++step) {
    const std::vector<float> before = (*t)->model().params();
    auto s = (*t)->step();
    ASSERT_TRUE(s) << s.status().to_string();
    EXPECT_EQ(s->skipped, seen[step].count(poisoned) == 1) << "step " << step + 1;
    if (s->skipped) {
      ++skipped;
      EXPECT_TRUE(std::equal(before.begin(), before.end(), (*t)->model().params().begin(),
                             [](float a, float b) { return std::memcmp(&a, &b, sizeof a) == 0; }))
          << "a skipped step changed the weights";
    } else {
      EXPECT_TRUE(std::isfinite(s->loss.loss));
    }
  }
  EXPECT_GE(skipped, 2);
  EXPECT_EQ((*t)->current_step(), 10);
}

TEST(Training, WithNanPolicyStopAPoisonedGradientStopsNamingTheTensor) {
  TrainConfig c = small_config();
  auto t = Trainer::create(c);
  ASSERT_TRUE(t);
  // A NaN in an expert's weight reaches the loss only through the tokens it
  // serves; its gradient, or the loss, is not finite.
  const TensorSlot* w = (*t)->model().layout().find("model.layers.1.block_sparse_moe.experts.2.w2.weight");
  ASSERT_NE(w, nullptr);
  (*t)->model().params()[w->offset] = std::numeric_limits<float>::infinity();
  auto s = (*t)->step();
  ASSERT_FALSE(s);
  EXPECT_NE(s.status().message().find("train.nan_policy: stop"), std::string::npos) << s.status().message();
  EXPECT_NE(s.status().message().find("experts.2.w2.weight (1 of"), std::string::npos) << s.status().message();
  EXPECT_EQ((*t)->current_step(), 0);
}

TEST(TrainConfig, ErrorsNameTheFileLineAndKey) {
  auto bad_key = parse_train_config("model:\n  hidden_size: 64\n  num_expertz: 4\n", "cfg.yaml");
  ASSERT_FALSE(bad_key);
  EXPECT_NE(bad_key.status().message().find("cfg.yaml:3"), std::string::npos) << bad_key.status().message();
  EXPECT_NE(bad_key.status().message().find("model.num_expertz"), std::string::npos);

  auto bad_type = parse_train_config("train:\n  steps: lots\n", "cfg.yaml");
  ASSERT_FALSE(bad_type);
  EXPECT_NE(bad_type.status().message().find("train.steps"), std::string::npos) << bad_type.status().message();
  EXPECT_NE(bad_type.status().message().find("cfg.yaml:2"), std::string::npos);

  auto bad_value = parse_train_config("model:\n  top_k: 9\n", "cfg.yaml");
  ASSERT_FALSE(bad_value);
  EXPECT_NE(bad_value.status().message().find("model.top_k"), std::string::npos) << bad_value.status().message();

  auto bad_enum = parse_train_config("model:\n  gating: softmx\n", "cfg.yaml");
  ASSERT_FALSE(bad_enum);
  EXPECT_NE(bad_enum.status().message().find("softmx"), std::string::npos);

  auto bad_yaml = parse_train_config("model: [unclosed\n", "cfg.yaml");
  ASSERT_FALSE(bad_yaml);
  EXPECT_NE(bad_yaml.status().message().find("YAML syntax"), std::string::npos);
}

TEST(TrainConfig, TheShippedExampleEqualsTheBuiltinDefault) {
  auto ex = load_train_config(std::string(XD_SOURCE_DIR) + "/examples/tiny.yaml");
  ASSERT_TRUE(ex) << ex.status().to_string();
  TrainConfig d = default_train_config();
  EXPECT_EQ(ex->model.hidden_size, d.model.hidden_size);
  EXPECT_EQ(ex->model.num_layers, d.model.num_layers);
  EXPECT_EQ(ex->model.num_experts, d.model.num_experts);
  EXPECT_EQ(ex->steps, d.steps);
  EXPECT_EQ(ex->optimizer.learning_rate, d.optimizer.learning_rate);
}

TEST(TrainConfig, ASingleConnectivityAppliesToEveryLayerAndAListPerLayer) {
  auto one = parse_train_config("model:\n  num_layers: 3\n  connectivity: farskip\n");
  ASSERT_TRUE(one) << one.status().to_string();
  EXPECT_EQ(one->model.connectivity, std::vector<Connectivity>(3, Connectivity::kFarSkip));
  auto list = parse_train_config("model:\n  num_layers: 2\n  connectivity: [farskip_moe, regular]\n");
  ASSERT_TRUE(list) << list.status().to_string();
  EXPECT_EQ(list->model.connectivity[0], Connectivity::kFarSkipMoe);
  auto wrong = parse_train_config("model:\n  num_layers: 3\n  connectivity: [farskip, regular]\n");
  EXPECT_FALSE(wrong);
}

TEST(TrainConfig, TheFarSkipSectionSetsConnectivityAndRefusesContradictions) {
  auto full = parse_train_config("model: {num_layers: 3}\nfarskip: {enabled: true}\n");
  ASSERT_TRUE(full) << full.status().to_string();
  EXPECT_EQ(full->model.connectivity, std::vector<Connectivity>(3, Connectivity::kFarSkip));
  EXPECT_TRUE(full->farskip.overlapped) << "overlapped by default";
  auto attention = parse_train_config("model: {num_layers: 2}\nfarskip: {enabled: true, attention_only: true}\n");
  ASSERT_TRUE(attention) << attention.status().to_string();
  EXPECT_EQ(attention->model.connectivity[1], Connectivity::kFarSkipAttention);
  auto moe = parse_train_config("farskip: {enabled: true, moe_only: true, overlapped: false}\n");
  ASSERT_TRUE(moe) << moe.status().to_string();
  EXPECT_EQ(moe->model.connectivity[0], Connectivity::kFarSkipMoe);
  EXPECT_FALSE(moe->farskip.overlapped);
  auto off = parse_train_config("farskip: {enabled: false}\n");
  ASSERT_TRUE(off);
  EXPECT_EQ(off->model.layer_connectivity(0), Connectivity::kRegular);
  const std::pair<const char*, const char*> bad[] = {
      {"farskip: {attention_only: true}\n", "farskip.attention_only: needs farskip.enabled: true"},
      {"farskip: {enabled: true, attention_only: true, moe_only: true}\n", "exclude each other"},
      {"model: {connectivity: farskip_moe}\nfarskip: {enabled: true}\n",
       "farskip.enabled: asks for farskip on every layer, but model.connectivity says farskip_moe"},
      {"farskip: {enabeld: true}\n", "farskip.enabeld"},
      {"train: {steps: 5, trace_steps: [6]}\n", "train.trace_steps: step 6 is outside 1..5"},
      {"farskip: {enabled: true}\nfarskip: {enabled: false}\n",
       "job.yaml:2: config.farskip: given twice (first on line 1)"},
      {"train: {steps: 5, steps: 6}\n", "train.steps: given twice"},
      {"train: {steps: 99999999999999999999}\n", "train.steps: '99999999999999999999' is out of range"},
      {"train: {steps: 5x}\n", "train.steps: expected an integer, got '5x'"},
      {"train: {steps: 08}\n", "train.steps: expected an integer, got '08'"},
  };
  for (const auto& [yaml, want] : bad) {
    auto r = parse_train_config(yaml, "job.yaml");
    ASSERT_FALSE(r) << yaml;
    EXPECT_NE(r.status().message().find(want), std::string::npos) << r.status().message();
  }
}

}  // namespace
}  // namespace xd
