// Compressed expert traffic: the error-feedback bookkeeping of one level's
// codec, and, in a four-worker job over real sockets, the SR base experts and
// the rebuilt replicas that every worker must hold to the bit.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <iterator>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <thread>

#include "actors/distributed_trainer.h"
#include "cluster/job_config.h"
#include "common/rng.h"
#include "compression/bfloat16.h"
#include "compression/expert_stream_codec.h"
#include "job_runner.h"

namespace xd {
namespace {


std::vector<float> normal(size_t n, uint64_t seed, float scale = 1.0f) {
  Rng rng(seed);
  std::vector<float> v(n);
  for (float& x : v) x = static_cast<float>(rng.normal()) * scale;
  return v;
}

ExpertStreamCodec codec(const std::string& spec, ExpertStreamCodec::Traffic traffic, size_t n) {
  auto s = ExpertCodecSpec::parse(spec);
  XD_CHECK(s.has_value());
  return ExpertStreamCodec(*s, traffic, n);
}

// Sender encodes, receiver decodes the same message: returns the receiver's copy.
std::vector<float> send_once(ExpertStreamCodec& sender, ExpertStreamCodec& receiver, std::vector<float>& x,
                             const float* base, ReconstructionError* err) {
  std::vector<float> packed, got(x.size(), 0.0f), decoded(x.size());
  EncodedTensor enc;
  EXPECT_TRUE(sender.encode({{7, x.data(), base}}, &packed, &enc, err).is_ok());
  if (enc.payload.empty()) decoded = packed;
  else EXPECT_TRUE(decode_tensor(enc.metadata, enc.payload.data(), enc.payload.size(), decoded.data(), x.size()).is_ok());
  receiver.apply({{7, got.data(), base}}, decoded.data());
  return got;
}

TEST(ExpertStreamCodec, WeightFeedbackStartsExactThenConvergesAfterAChangeAndTheSenderKnowsWhatTheReceiverHolds) {
  for (const char* spec :
       {"sr:ef:topk:0.05", "sr:ef:topk_sign:0.05+zstd:1", "sr:ef:pred:topk_sign:0.05+zstd:1", "sr:ef:pred:bf16",
        "sr:ef:block_sign:0.5+zstd:1"}) {
    SCOPED_TRACE(spec);
    const size_t n = 4096;
    std::vector<float> x = normal(n, 1), base = normal(n, 2, 0.5f);
    auto sender = codec(spec, ExpertStreamCodec::Traffic::kWeights, n);
    auto receiver = codec(spec, ExpertStreamCodec::Traffic::kWeights, n);
    {
      ReconstructionError err;
      std::vector<float> packed;
      EncodedTensor enc;
      ASSERT_TRUE(sender.encode({{7, x.data(), base.data()}}, &packed, &enc, &err).is_ok());
      EXPECT_TRUE(enc.payload.empty()) << "the first transfer goes raw";
      std::vector<float> got(n, 0.0f);
      receiver.apply({{7, got.data(), base.data()}}, packed.data());
      for (size_t i = 0; i < n; ++i) ASSERT_NEAR(got[i], x[i], 1e-6f) << "receivers start from the owner's weights";
    }
    x = normal(n, 11);  // a change no 5% of the entries can describe at once
    double first = 0, last = 0;
    // A jump is prediction's worst case: the velocity it learns from the
    // jump overshoots and settles, about 3x slower than feedback alone.
    const int kSteps = ExpertCodecSpec::parse(spec)->predict ? 150 : 60;
    for (int step = 0; step < kSteps; ++step) {
      ReconstructionError err;
      std::vector<float> got = send_once(sender, receiver, x, base.data(), &err);
      // The sender's error figure is the receiver's actual error.
      double actual = 0;
      for (size_t i = 0; i < n; ++i) actual += (double(x[i]) - got[i]) * (double(x[i]) - got[i]);
      EXPECT_NEAR(err.error, actual, 1e-5 * actual + 1e-9) << "step " << step;  // up to float rounding
      if (step == 0) first = err.error / err.signal;
      last = err.error / err.signal;
    }
    if (ExpertCodecSpec::parse(spec)->pipeline.is_sparse()) {
      EXPECT_GT(first, 0.5) << "5% of the entries cannot describe an unrelated tensor at once";
    }
    EXPECT_LT(last, 1e-4) << "what one step drops, later steps send";
  }
}

// Weights as an optimizer moves them, plus the values that break naive bit
// arithmetic: both zeros, signs that flip, denormals, infinities, a NaN and
// the extremes of the range. Every step's receiver holds the sender's bits.
TEST(ExpertStreamCodec, DeltaRebuildsEveryWeightToTheBitStepAfterStepAndSmallStepsCostFewerBytes) {
  const size_t n = 4096;
  for (const char* spec : {"delta:zstd:1", "delta:raw"}) {
    SCOPED_TRACE(spec);
    ExpertStreamCodec sender = codec(spec, ExpertStreamCodec::Traffic::kWeights, n);
    ExpertStreamCodec receiver = codec(spec, ExpertStreamCodec::Traffic::kWeights, n);
    std::vector<float> x = normal(n, 3, 0.02f);
    const float specials[] = {0.0f, -0.0f, 1e-45f, -1e-45f, 1e-39f, std::numeric_limits<float>::max(),
                              -std::numeric_limits<float>::max(), std::numeric_limits<float>::infinity(),
                              -std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()};
    for (size_t i = 0; i < std::size(specials); ++i) x[i] = specials[i];
    Rng rng(5);
    std::vector<size_t> bytes;
    for (int step = 0; step < 6; ++step) {
      if (step > 0)
        for (size_t i = 0; i < n; ++i) {
          if (i < std::size(specials)) x[i] = specials[(i + step) % std::size(specials)];  // any bits to any bits
          else x[i] += static_cast<float>(5e-4 * rng.normal());
        }
      ReconstructionError err;
      std::vector<float> packed, got(n, 0.0f);
      EncodedTensor enc;
      ASSERT_TRUE(sender.encode({{7, x.data(), nullptr}}, &packed, &enc, &err).is_ok());
      bytes.push_back(enc.payload.empty() ? packed.size() * sizeof(float) : enc.payload.size() + enc.metadata.size());
      const Status received = receiver.receive({{7, got.data(), nullptr}}, packed, enc);
      ASSERT_TRUE(received.is_ok()) << received.to_string();
      ASSERT_EQ(0, std::memcmp(got.data(), x.data(), n * sizeof(float))) << "step " << step;
      EXPECT_EQ(err.error, 0.0);
    }
    if (std::string(spec) == "delta:zstd:1") {
      std::printf("delta:zstd:1 bytes per step of %zu: %zu then", n * sizeof(float), bytes[0]);
      for (size_t b = 1; b < bytes.size(); ++b) std::printf(" %zu", bytes[b]);
      std::printf("\n");
      for (size_t b = 1; b < bytes.size(); ++b) EXPECT_LT(bytes[b], 0.8 * n * sizeof(float)) << "step " << b;
    } else {
      for (size_t b : bytes) EXPECT_EQ(b, n * sizeof(float));
    }
  }
}

// A step whose gradients hold a NaN (the non-finite guard will skip it): the
// lossy codec cannot take it, so the message crosses raw and the owner sees
// the NaN; nothing non-finite is carried into the next step's message.
TEST(ExpertStreamCodec, GradientsHoldingANanCrossRawAndLeaveNothingCarried) {
  const size_t n = 1024;
  ExpertStreamCodec sender = codec("ef:int4_row:128+zstd:1", ExpertStreamCodec::Traffic::kGradients, n);
  ExpertStreamCodec receiver = codec("ef:int4_row:128+zstd:1", ExpertStreamCodec::Traffic::kGradients, n);
  std::vector<float> g = normal(n, 11, 1e-3f);
  ReconstructionError err;
  (void)send_once(sender, receiver, g, nullptr, &err);  // something carried from a lossy step
  g = normal(n, 12, 1e-3f);
  g[100] = std::nanf("");
  std::vector<float> packed;
  EncodedTensor enc;
  ReconstructionError nan_err;
  ASSERT_TRUE(sender.encode({{7, g.data(), nullptr}}, &packed, &enc, &nan_err).is_ok());
  EXPECT_TRUE(enc.payload.empty() && enc.metadata.empty()) << "sent raw";
  EXPECT_TRUE(std::isnan(packed[100]));
  EXPECT_EQ(nan_err.signal, 0.0) << "the reconstruction error leaves it out";
  // The next, finite step: what arrives is that step's gradient alone, to
  // int4 precision, with no NaN carried.
  g = normal(n, 13, 1e-3f);
  std::vector<float> got = send_once(sender, receiver, g, nullptr, &err);
  for (size_t k = 0; k < n; ++k) {
    ASSERT_TRUE(std::isfinite(got[k])) << k;
    EXPECT_NEAR(got[k], g[k], 3e-4) << k;
  }
}

TEST(ExpertStreamCodec, WithoutFeedbackEveryStepSendsTheSameApproximation) {
  const size_t n = 2048;
  std::vector<float> x = normal(n, 3);
  auto sender = codec("topk:0.1", ExpertStreamCodec::Traffic::kWeights, n);
  auto receiver = codec("topk:0.1", ExpertStreamCodec::Traffic::kWeights, n);
  ReconstructionError a, b;
  const std::vector<float> first = send_once(sender, receiver, x, nullptr, &a);
  const std::vector<float> second = send_once(sender, receiver, x, nullptr, &b);
  EXPECT_EQ(first, second);
  EXPECT_DOUBLE_EQ(a.error, b.error);
  EXPECT_GT(a.error / a.signal, 0.1);
}

TEST(ExpertStreamCodec, GradientFeedbackDeliversEveryGradientEventuallyWhateverThePipeline) {
  // Over many steps, what arrived plus what the sender still carries is the
  // sum of every gradient sent: nothing is lost, only delayed. Sparse
  // (top-k), dense lossy (int8 and int4 rows, one scale or one per 64
  // entries) and 1-bit (every sign) pipelines alike.
  const size_t n = 1024;
  for (const char* spec : {"ef:topk:0.1+zstd:1", "ef:int8_row+zstd:1", "ef:int4_row+zstd:1", "ef:int4_row:64+zstd:1",
                           "ef:topk_sign:1+zstd:1"}) {
    auto sender = codec(spec, ExpertStreamCodec::Traffic::kGradients, n);
    auto receiver = codec(spec, ExpertStreamCodec::Traffic::kGradients, n);
    std::vector<double> sent(n, 0.0), arrived(n, 0.0);
    for (int step = 0; step < 30; ++step) {
      std::vector<float> g = normal(n, 100 + step);
      for (size_t i = 0; i < n; ++i) sent[i] += g[i];
      ReconstructionError err;
      const std::vector<float> got = send_once(sender, receiver, g, nullptr, &err);
      for (size_t i = 0; i < n; ++i) arrived[i] += got[i];
    }
    // Encoding a zero gradient packs exactly what the sender still carries.
    std::vector<float> zero(n, 0.0f), packed;
    EncodedTensor enc;
    ReconstructionError err;
    ASSERT_TRUE(sender.encode({{7, zero.data(), nullptr}}, &packed, &enc, &err).is_ok()) << spec;
    double worst = 0, carried = 0;
    for (size_t i = 0; i < n; ++i) {
      worst = std::max(worst, std::abs(arrived[i] + packed[i] - sent[i]));
      carried += double(packed[i]) * packed[i];
    }
    EXPECT_LT(worst, 1e-3) << spec << ": arrived + carried must equal what was sent";
    EXPECT_GT(carried, 0.0) << spec << " is lossy: the sender must still carry something";
  }
}

TEST(ExpertStreamCodec, GradientsAddToWhatTheReceiverAlreadyHas) {
  const size_t n = 256;
  auto sender = codec("bf16", ExpertStreamCodec::Traffic::kGradients, n);
  auto receiver = codec("bf16", ExpertStreamCodec::Traffic::kGradients, n);
  std::vector<float> g(n, 0.5f), mine(n, 1.0f), packed;
  EncodedTensor enc;
  ReconstructionError err;
  ASSERT_TRUE(sender.encode({{1, g.data(), nullptr}}, &packed, &enc, &err).is_ok());
  std::vector<float> decoded(n);
  ASSERT_TRUE(decode_tensor(enc.metadata, enc.payload.data(), enc.payload.size(), decoded.data(), n).is_ok());
  receiver.apply({{1, mine.data(), nullptr}}, decoded.data());
  for (float v : mine) ASSERT_EQ(v, 1.5f);
  EXPECT_EQ(err.error, 0.0) << "0.5 is exact in bf16";
}

TEST(ExpertStreamCodec, TheSparsePathLeavesEveryTensorAndStateAsTheDenseReferenceDoes) {
  // Three tensors per message, several steps, so feedback state carries over.
  // Feedback's receivers rebuild a replica at the kept entries alone while
  // the base stays; at step 3 the base moves (a new version) and they
  // rebuild it whole.
  const size_t n = 1000;
  std::vector<float> base0 = normal(n, 20, 0.5f), base1 = normal(n, 21, 0.5f), base2 = normal(n, 22, 0.5f);
  float* bases[3] = {base0.data(), base1.data(), base2.data()};
  struct Case {
    const char* spec;
    ExpertStreamCodec::Traffic traffic;
  };
  for (const Case& c : {Case{"sr:ef:topk:0.05+zstd:1", ExpertStreamCodec::Traffic::kWeights},
                        Case{"sr:topk:0.05", ExpertStreamCodec::Traffic::kWeights},
                        Case{"topk:0.05+zstd:1", ExpertStreamCodec::Traffic::kWeights},
                        Case{"ef:topk:0.1+zstd:1", ExpertStreamCodec::Traffic::kGradients},
                        Case{"topk:0.1", ExpertStreamCodec::Traffic::kGradients},
                        Case{"sr:ef:topk_sign:0.1+zstd:1", ExpertStreamCodec::Traffic::kWeights},
                        Case{"sr:ef:pred:topk_sign:0.1+zstd:1", ExpertStreamCodec::Traffic::kWeights},
                        Case{"ef:pred:topk:0.05", ExpertStreamCodec::Traffic::kWeights},
                        Case{"ef:topk_sign:0.1", ExpertStreamCodec::Traffic::kGradients},
                        Case{"sr:ef:block_sign:0.5+zstd:1", ExpertStreamCodec::Traffic::kWeights},
                        Case{"sr:ef:pred:block_sign:0.5:8", ExpertStreamCodec::Traffic::kWeights},
                        Case{"ef:block_sign:0.25", ExpertStreamCodec::Traffic::kGradients}}) {
    const bool weights = c.traffic == ExpertStreamCodec::Traffic::kWeights;
    auto sender = codec(c.spec, c.traffic, n);
    auto dense = codec(c.spec, c.traffic, n), sparse = codec(c.spec, c.traffic, n);
    std::vector<std::vector<float>> at_dense(3, std::vector<float>(n, 0.25f)), at_sparse = at_dense;
    uint64_t version = 0;
    for (int step = 0; step < 6; ++step) {
      if (step == 3) {
        for (int i = 0; i < 3; ++i)
          for (size_t k = 0; k < n; ++k) bases[i][k] += 0.125f;
        ++version;
      }
      std::vector<std::vector<float>> x;
      for (int i = 0; i < 3; ++i) x.push_back(normal(n, 100 * step + i));
      auto refs = [&](std::vector<std::vector<float>>& data) {
        std::vector<ExpertTensorRef> r;
        for (int i = 0; i < 3; ++i) r.push_back({(uint64_t)i, data[i].data(), weights ? bases[i] : nullptr, version});
        return r;
      };
      std::vector<float> packed;
      EncodedTensor enc;
      ReconstructionError err;
      ASSERT_TRUE(sender.encode(refs(x), &packed, &enc, &err).is_ok()) << c.spec;
      if (enc.payload.empty()) {  // feedback's first, raw transfer
        dense.apply(refs(at_dense), packed.data());
        sparse.apply(refs(at_sparse), packed.data());
        continue;
      }
      auto rec = parse_codec_record(enc.metadata);
      ASSERT_TRUE(rec);
      std::vector<float> decoded(3 * n);
      ASSERT_TRUE(decode_tensor(*rec, enc.payload.data(), enc.payload.size(), decoded.data(), decoded.size()).is_ok());
      dense.apply(refs(at_dense), decoded.data());
      SparseTensor entries;
      ASSERT_TRUE(decode_sparse(*rec, enc.payload.data(), enc.payload.size(), &entries).is_ok());
      sparse.apply_sparse(refs(at_sparse), entries);
      for (int i = 0; i < 3; ++i)
        for (size_t k = 0; k < n; ++k)
          ASSERT_EQ(at_dense[i][k], at_sparse[i][k]) << c.spec << " step " << step << " tensor " << i << " entry " << k;
      // The sender's figure is the receiver's error, up to float rounding.
      if (weights) {
        double actual = 0;
        for (int i = 0; i < 3; ++i)
          for (size_t k = 0; k < n; ++k) actual += (double(x[i][k]) - at_sparse[i][k]) * (double(x[i][k]) - at_sparse[i][k]);
        EXPECT_NEAR(err.error, actual, 1e-4 * actual) << c.spec << " step " << step;
      }
    }
  }
}

TEST(ExpertStreamCodec, AScheduleChangesTheMessagesAtItsStepAndTheReceiverStillHoldsWhatTheSenderCounts) {
  // Every residual's sign for steps 0-4 (step 0 goes raw), the largest 5%
  // from step 5 on; the weights drift a little each step, as under AdamW.
  const char* spec = "sr:ef:topk_sign:1+zstd:1@5:topk_sign:0.05+zstd:1";
  const size_t n = 4096;
  std::vector<float> x = normal(n, 30), base = normal(n, 31, 0.5f), got(n, 0.0f);
  auto sender = codec(spec, ExpertStreamCodec::Traffic::kWeights, n);
  auto receiver = codec(spec, ExpertStreamCodec::Traffic::kWeights, n);
  std::vector<size_t> bytes;
  for (uint64_t step = 0; step < 10; ++step) {
    const std::vector<float> drift = normal(n, 40 + step, 0.01f);
    for (size_t k = 0; k < n; ++k) x[k] += drift[k];
    std::vector<float> packed;
    EncodedTensor enc;
    ReconstructionError err;
    ASSERT_TRUE(sender.encode({{7, x.data(), base.data()}}, &packed, &enc, &err, nullptr, step).is_ok());
    bytes.push_back(enc.payload.size());
    if (step == 0) {
      ASSERT_TRUE(enc.payload.empty()) << "the first transfer goes raw";
      receiver.apply({{7, got.data(), base.data()}}, packed.data());
      continue;
    }
    auto rec = parse_codec_record(enc.metadata);
    ASSERT_TRUE(rec);
    // The record says how the message was coded: the receiver needs no step.
    if (step < 5) EXPECT_EQ(rec->stages.front().kept, n) << "step " << step;
    else EXPECT_NEAR(double(rec->stages.front().kept), n / 20.0, 1.0) << "step " << step;
    ASSERT_TRUE(receiver.apply_encoded({{7, got.data(), base.data()}}, *rec, enc.payload.data(), enc.payload.size())
                    .is_ok());
    double actual = 0;
    for (size_t k = 0; k < n; ++k) actual += (double(x[k]) - got[k]) * (double(x[k]) - got[k]);
    EXPECT_NEAR(err.error, actual, 1e-4 * actual) << "the sender's error is the receiver's, step " << step;
  }
  EXPECT_GT(bytes[4], 2 * bytes[5]) << "from step 5 on, a twentieth of the signs and their positions";
  EXPECT_EQ(ExpertCodecSpec::parse(spec)->pipeline_at(4).spec(), "topk_sign:1+zstd:1");
}

TEST(ExpertStreamCodec, RowsPackedInPiecesAsTheOptimizerWritesThemMakeTheSameMessageAsPackingAtOnce) {
  for (const char* spec : {"sr:ef:topk:0.02+zstd:1", "sr:ef:pred:topk:0.02+zstd:1"}) {
    SCOPED_TRACE(spec);
    const size_t n = 3000;
    const std::vector<float> base = normal(n, 30, 0.5f);
    auto whole = codec(spec, ExpertStreamCodec::Traffic::kWeights, n);
    auto pieces = codec(spec, ExpertStreamCodec::Traffic::kWeights, n);
    Rng rng(31);
    for (int step = 0; step < 4; ++step) {
      std::vector<float> a = normal(n, 40 + step), b = normal(n, 50 + step);
      const std::vector<ExpertTensorRef> refs{{1, a.data(), base.data()}, {2, b.data(), base.data()}};
      std::vector<float> packed_whole, packed(2 * n);
      EncodedTensor enc_whole, enc;
      ReconstructionError err_whole, err;
      ASSERT_TRUE(whole.encode(refs, &packed_whole, &enc_whole, &err_whole).is_ok());
      PackSums sums;
      for (size_t i = 0; i < refs.size(); ++i)
        for (size_t from = 0; from < n;) {
          const size_t count = std::min(n - from, (size_t)(1 + rng.uniform() * 700));
          pieces.pack(refs[i], from, count, packed.data() + i * n + from, &sums);
          from += count;
        }
      ASSERT_TRUE(pieces.encode(refs, &packed, &enc, &err, &sums).is_ok());
      EXPECT_EQ(enc.metadata, enc_whole.metadata) << "step " << step;
      EXPECT_EQ(enc.payload, enc_whole.payload) << "step " << step;
      EXPECT_EQ(0, std::memcmp(packed.data(), packed_whole.data(), packed.size() * sizeof(float))) << "step " << step;
      EXPECT_NEAR(err.error, err_whole.error, 1e-9 * (1 + err_whole.error));
      EXPECT_NEAR(err.signal, err_whole.signal, 1e-9 * err_whole.signal);
    }
  }
}

TEST(ExpertStreamCodec, PredictionTracksWeightsThatDriftAsUnderAdamWithAFractionOfFeedbacksError) {
  // Weights that move a little every step, mostly the same way (AdamW at a
  // steady learning rate): x_t = x_{t-1} + u + noise. Feedback alone lags
  // the drift between an entry's corrections; the prediction follows it.
  const size_t n = 4096;
  const std::vector<float> start = normal(n, 60), drift = normal(n, 61, 0.01f), base = normal(n, 62, 0.5f);
  double nmse[2] = {0, 0};
  const char* specs[2] = {"sr:ef:topk_sign:0.1", "sr:ef:pred:topk_sign:0.1"};
  for (int s = 0; s < 2; ++s) {
    auto sender = codec(specs[s], ExpertStreamCodec::Traffic::kWeights, n);
    auto receiver = codec(specs[s], ExpertStreamCodec::Traffic::kWeights, n);
    std::vector<float> x = start;
    for (int step = 0; step < 80; ++step) {
      const std::vector<float> noise = normal(n, 1000 + step, 0.002f);
      for (size_t i = 0; i < n; ++i) x[i] += drift[i] + noise[i];
      ReconstructionError err;
      const std::vector<float> got = send_once(sender, receiver, x, base.data(), &err);
      double actual = 0;
      for (size_t i = 0; i < n; ++i) actual += (double(x[i]) - got[i]) * (double(x[i]) - got[i]);
      EXPECT_NEAR(err.error, actual, 1e-4 * actual + 1e-9) << specs[s] << " step " << step;
      if (step >= 40) nmse[s] += err.error / err.signal;
    }
  }
  EXPECT_LT(nmse[1], nmse[0] / 3) << "feedback alone " << nmse[0] / 40 << ", with prediction " << nmse[1] / 40;
}

// ---- four workers, 2 DCs x 2, HybridEP with every expert gathered ----------

// The small MoE of job_runner.h on 2 DCs x 2 workers, HybridEP with every
// expert gathered; `gather` and `dense` are the DC link's codecs.
std::string job_yaml(const std::string& gather, const std::string& dense = "raw") {
  return testing::model_yaml() + R"(cluster:
  levels:
    - name: dc
      size: 2
      link: {bandwidth: 1gbit, latency: 0ms, shape: false, codecs: {expert_gather: ")" +
         gather + R"(", expert_grad: "ef:topk:0.2", dense_grad: )" + dense + R"(}}
    - name: worker
      size: 2
      link: {bandwidth: 10gbit, latency: 0ms, shape: false}
  expert_parallel:
    mode: hybrid
    domain_sizes: [2, 2]
    memory_cap: unlimited
    base_sync_every: 1
)";
}

JobConfig job_for(const std::string& gather, const std::string& dense = "raw") {
  auto job = parse_job_config(job_yaml(gather, dense), "job.yaml");
  XD_CHECK_MSG(job.has_value(), job.status().to_string().c_str());
  job->train.steps = 6;
  job->train.warmup_steps = 2;
  job->train.model.expert_init_spread = 0.3;  // experts start alike: the base has something to hold
  XD_CHECK(job->validate().is_ok());
  return *job;
}

// Floats of one projection of one expert (ff * d).
size_t expert_floats(const JobConfig& job) {
  return (size_t)job.train.model.expert_intermediate_size * job.train.model.hidden_size;
}

struct Workers {
  std::vector<std::unique_ptr<Transport>> transports;
  std::vector<std::unique_ptr<DistributedTrainer>> trainers;
};

// With `update`, every worker is handed it at its first step boundary.
Workers start_workers(const JobConfig& job, std::optional<PlanUpdate> update = std::nullopt) {
  Workers w;
  const int world = job.cluster.world_size();
  const std::vector<int> sizes = job.cluster.level_sizes();
  for (int r = 0; r < world; ++r) {
    TransportOptions o;
    o.rank = r;
    // One link class per level, unshaped, so bytes are counted per level.
    o.link_classes.assign(sizes.size(), LinkShaping{});
    o.link_class_names.clear();
    for (const LevelSpec& l : job.cluster.levels) o.link_class_names.push_back(l.name);
    auto t = Transport::create(o);
    XD_CHECK(t.has_value());
    w.transports.push_back(std::move(*t));
  }
  for (int r = 0; r < world; ++r) {
    std::vector<PeerInfo> peers;
    for (int p = 0; p < world; ++p)
      peers.push_back({p, w.transports[p]->endpoint(), std::max(0, link_level(sizes, r, p))});
    XD_CHECK(w.transports[r]->connect(peers).is_ok());
  }
  w.trainers.resize(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      DistributedOptions o;
      o.rank = r;
      o.level_sizes = job.cluster.level_sizes();
      o.domain_sizes = job.cluster.expert_parallel.domain_sizes;
      for (const LevelSpec& l : job.cluster.levels) o.link_names.push_back(l.name);
      o.timeout = std::chrono::seconds(30);
      if (update)
        o.take_plan = [update, given = std::make_shared<bool>(false)]() -> std::optional<PlanUpdate> {
          if (*given) return std::nullopt;
          *given = true;
          return update;
        };
      auto t = DistributedTrainer::create(job, o, w.transports[r].get());
      XD_CHECK_MSG(t.has_value(), t.status().to_string().c_str());
      w.trainers[r] = std::move(*t);
    });
  for (auto& t : threads) t.join();
  return w;
}

// One step on every worker at once; each then drains its communicator, so the
// base all-reduce and the next step's gathers have run.
void step_all(Workers& w, std::vector<StepMetrics>* metrics) {
  std::vector<std::thread> threads;
  metrics->assign(w.trainers.size(), StepMetrics{});
  for (size_t r = 0; r < w.trainers.size(); ++r)
    threads.emplace_back([&, r] {
      auto m = w.trainers[r]->step();
      XD_CHECK_MSG(m.has_value(), m.status().to_string().c_str());
      (*metrics)[r] = *m;
      w.trainers[r]->expert_communicator().drain();
    });
  for (auto& t : threads) t.join();
}

// One step of `a`, then of `b`; every worker of both ends it (`step`, from 0)
// at the same loss and with the same parameters, to the bit.
void step_both_alike(Workers& a, std::vector<StepMetrics>* ma_out, Workers& b, std::vector<StepMetrics>* mb_out,
                     int step) {
  step_all(a, ma_out);
  step_all(b, mb_out);
  const std::vector<StepMetrics>& ma = *ma_out;
  const std::vector<StepMetrics>& mb = *mb_out;
  for (size_t r = 0; r < a.trainers.size(); ++r) {
    EXPECT_EQ(ma[r].loss, mb[r].loss) << "worker " << r << " step " << step + 1;
    const std::vector<float>& pa = a.trainers[r]->model().params();
    const std::vector<float>& pb = b.trainers[r]->model().params();
    ASSERT_EQ(0, std::memcmp(pa.data(), pb.data(), pa.size() * sizeof(float)))
        << "worker " << r << " step " << step + 1;
  }
}

TEST(ExpertCompression, EveryWorkerHoldsABitIdenticalBaseAfterEveryStepAndItIsTheMeanExpertToBf16Precision) {
  const JobConfig job = job_for("sr:topk:0.05+zstd:1");
  Workers w = start_workers(job);
  const ModelConfig& mc = job.train.model;
  const size_t ef = expert_floats(job);
  std::vector<StepMetrics> metrics;
  for (int step = 0; step < 5; ++step) {
    step_all(w, &metrics);
    const std::vector<float> base = w.trainers[0]->expert_communicator().base_copy();
    ASSERT_EQ(base.size(), (size_t)mc.num_layers * 3 * ef);
    for (size_t r = 1; r < w.trainers.size(); ++r) {
      const std::vector<float> other = w.trainers[r]->expert_communicator().base_copy();
      ASSERT_EQ(0, std::memcmp(base.data(), other.data(), base.size() * sizeof(float)))
          << "worker " << r << " holds a different base after step " << step + 1;
    }
    // The base is the mean of all 8 experts as they were after this step's
    // update (the owners' exact weights). Its partial sums cross the DC link
    // in bf16 and the summed shard comes back in bf16: two roundings of at
    // most 2^-8 of a partial sum each.
    for (int layer = 0; layer < mc.num_layers; ++layer)
      for (int which = 0; which < 3; ++which)
        for (size_t k = 0; k < ef; k += 97) {
          double sum = 0, magnitude = 0;
          for (int e = 0; e < mc.num_experts; ++e) {
            // The owner's (e / 2) exact weights.
            const ExpertParams<float> p = w.trainers[e / 2]->expert_communicator().replica(layer, e);
            const float v = (which == 0 ? p.w1 : which == 1 ? p.w3 : p.w2)[k];
            sum += v;
            magnitude += std::abs(v);
          }
          EXPECT_NEAR(base[((size_t)layer * 3 + which) * ef + k], sum / mc.num_experts,
                      2 * std::ldexp(magnitude, -8) / mc.num_experts + 1e-7);
        }
    // Worker 0 sends half its DC group's shard each way, 2 bytes a float:
    // the layer's bases (3 tensors each) in bf16, half what fp32 would send.
    EXPECT_DOUBLE_EQ(metrics[0].bytes.at("dc/expert_base"), 2.0 * mc.num_layers * 3 * ef / 2)
        << "the base crosses the DC link in bf16";
    EXPECT_GT(metrics[0].nmse.at("dc/expert_gather"), 0.0) << "top-k of the residual is lossy";
    EXPECT_GT(metrics[0].bytes.at("dc/expert_gather_raw"), 10 * metrics[0].bytes.at("dc/expert_gather"));
    // Worker 0 encodes its experts for the other DC and decodes theirs; its
    // base's shard is cast to bf16 and its peer's cast back.
    for (const char* key : {"dc/expert_gather", "dc/expert_base"}) {
      ASSERT_TRUE(metrics[0].codec_encode_seconds.count(key) && metrics[0].codec_decode_seconds.count(key)) << key;
      EXPECT_GT(metrics[0].codec_encode_seconds.at(key), 0.0) << key;
      EXPECT_GT(metrics[0].codec_decode_seconds.at(key), 0.0) << key;
    }
  }
}

TEST(ExpertCompression, WithSignCodedBaseChangesEveryWorkerStillHoldsTheSameBaseAndItFollowsTheMeanExpert) {
  JobConfig job = job_for("sr:ef:topk_sign:1+zstd:1");
  job.cluster.expert_parallel.base_codec = "sign";
  ASSERT_TRUE(job.validate().is_ok());
  Workers w = start_workers(job);
  const ModelConfig& mc = job.train.model;
  const size_t ef = expert_floats(job);
  const size_t shard = (size_t)mc.num_layers * 3 * ef / 2;  // half the base: the DC group's inner shard
  const size_t rows = (shard + 1023) / 1024;
  std::vector<StepMetrics> metrics;
  std::vector<float> first_base;
  for (int step = 0; step < 5; ++step) {
    step_all(w, &metrics);
    const std::vector<float> base = w.trainers[0]->expert_communicator().base_copy();
    if (step == 0) first_base = base;
    for (size_t r = 1; r < w.trainers.size(); ++r) {
      const std::vector<float> other = w.trainers[r]->expert_communicator().base_copy();
      ASSERT_EQ(0, std::memcmp(base.data(), other.data(), base.size() * sizeof(float)))
          << "worker " << r << " holds a different base after step " << step + 1;
    }
    // Against the exact mean of the owners' weights: the first sync is exact
    // but for the inner bf16 stage; later ones lag by what the signs left out.
    // The first step's base, kept as it was, is further off: the changes do
    // move the base.
    double error = 0, signal = 0, frozen = 0;
    for (int layer = 0; layer < mc.num_layers; ++layer)
      for (int which = 0; which < 3; ++which)
        for (size_t k = 0; k < ef; ++k) {
          double sum = 0;
          for (int e = 0; e < mc.num_experts; ++e) {
            const ExpertParams<float> p = w.trainers[e / 2]->expert_communicator().replica(layer, e);
            sum += (which == 0 ? p.w1 : which == 1 ? p.w3 : p.w2)[k];
          }
          const size_t at = ((size_t)layer * 3 + which) * ef + k;
          const double mean = sum / mc.num_experts, d = base[at] - mean, f = first_base[at] - mean;
          error += d * d;
          frozen += f * f;
          signal += mean * mean;
        }
    EXPECT_LT(error / signal, 3e-4) << "step " << step + 1 << ": the base's NMSE against the mean expert";
    if (step == 4) {
      EXPECT_LT(error, frozen / 2) << "the sign-coded changes keep the base near the moving mean";
    }
    // Across the DC link: the partials in fp32 once, then a sign bit a float,
    // a scale per 1024 and a bit per row.
    const double want = step == 0 ? 4.0 * shard : 4.0 * rows + (rows + 7) / 8 + rows * 1024 / 8;
    EXPECT_DOUBLE_EQ(metrics[0].bytes.at("dc/expert_base"), want) << "step " << step + 1;
    // The copy the other DC holds of this worker's partial: exact at first,
    // then behind by what the signs left out; the coding's time with it.
    ASSERT_TRUE(metrics[0].nmse.count("dc/expert_base")) << "step " << step + 1;
    if (step == 0) {
      EXPECT_EQ(metrics[0].nmse.at("dc/expert_base"), 0.0);
    } else {
      EXPECT_GT(metrics[0].nmse.at("dc/expert_base"), 0.0) << "step " << step + 1;
    }
    EXPECT_LT(metrics[0].nmse.at("dc/expert_base"), 0.1) << "step " << step + 1;
    if (step > 0) {
      EXPECT_EQ(metrics[0].codec_encode_seconds.count("dc/expert_base"), 1u) << "step " << step + 1;
    }
  }
}

TEST(ExpertCompression, ReceiversAcrossTheDcRebuildTheSameReplicaAndThoseBesideTheOwnerGetItExactly) {
  for (const char* spec : {"sr:ef:topk:0.05+zstd:1", "sr:ef:pred:topk_sign:0.1+zstd:1", "sr:ef:pred:bf16",
                           "sr:ef:topk_sign:1+zstd:1@3:topk_sign:0.05+zstd:1"}) {
    SCOPED_TRACE(spec);
    const JobConfig job = job_for(spec);
    Workers w = start_workers(job);
    const ModelConfig& mc = job.train.model;
    const size_t ef = expert_floats(job);
    std::vector<StepMetrics> metrics;
    for (int step = 0; step < 5; ++step) {
      step_all(w, &metrics);
      for (int layer = 0; layer < mc.num_layers; ++layer)
        for (int e = 0; e < mc.num_experts; ++e) {
          // Workers 2 d and 2 d + 1 form DC d. The AG runs outer level first:
          // the owner sends e across the DC (compressed) and to its DC
          // neighbour (raw, exact); the receiver across the DC relays the
          // owner's message as it arrived to its own neighbour, which decodes
          // it into the same bits.
          const int owner = e / 2, neighbour = owner ^ 1, across = (owner + 2) % 4, across_neighbour = across ^ 1;
          auto w2 = [&](int r) { return w.trainers[r]->expert_communicator().replica(layer, e).w2; };
          const std::string where = "layer " + std::to_string(layer) + " expert " + std::to_string(e) + " after step " +
                                    std::to_string(step + 1);
          ASSERT_EQ(0, std::memcmp(w2(owner), w2(neighbour), ef * sizeof(float))) << where;
          ASSERT_EQ(0, std::memcmp(w2(across), w2(across_neighbour), ef * sizeof(float))) << where;
          ASSERT_NE(0, std::memcmp(w2(owner), w2(across), ef * sizeof(float))) << where << ": top-k is lossy";
        }
    }
    // Feedback: far better than the first step's reconstruction.
    EXPECT_LT(metrics[0].nmse.at("dc/expert_gather"), 0.05);
    // Inside the DC each worker sends its own experts raw and relays the
    // message it got from across: exactly those bytes, not the rebuilt floats.
    const double own_raw = double(mc.num_layers) * 2 * 3 * ef * sizeof(float);
    for (int r = 0; r < 4; ++r) {
      const std::map<std::string, double>& b = metrics[r].bytes;
      EXPECT_DOUBLE_EQ(b.at("worker/expert_gather_raw"), 2 * own_raw) << "worker " << r;
      EXPECT_DOUBLE_EQ(b.at("worker/expert_gather"), own_raw + metrics[(r + 2) % 4].bytes.at("dc/expert_gather"))
          << "worker " << r;
    }
  }
}

// Exact bit differences on the DC link: every worker trains to the bits of
// the raw all-gather, step after step, with fewer bytes across the DCs once
// the receivers hold the first step's weights.
TEST(ExpertCompression, DeltaWeightsAcrossTheDcTrainToTheBitsOfTheRawAllGatherWithFewerBytes) {
  Workers a = start_workers(job_for("delta:zstd:1")), b = start_workers(job_for("raw"));
  std::vector<StepMetrics> ma, mb;
  for (int step = 0; step < 5; ++step) {
    step_both_alike(a, &ma, b, &mb, step);
    if (::testing::Test::HasFatalFailure()) return;
    for (int r = 0; r < 4; ++r) {
      const double wire = ma[r].bytes.at("dc/expert_gather"), raw = ma[r].bytes.at("dc/expert_gather_raw");
      EXPECT_DOUBLE_EQ(raw, mb[r].bytes.at("dc/expert_gather")) << "worker " << r;
      if (r == 0) std::printf("step %d: the DC all-gather carries %.0f of %.0f raw bytes (%.2f)\n", step + 1, wire, raw,
                              wire / raw);
      if (step > 0) {
        EXPECT_LT(wire, 0.85 * raw) << "worker " << r << " step " << step + 1;
      }
      EXPECT_EQ(ma[r].nmse.count("dc/expert_gather") ? ma[r].nmse.at("dc/expert_gather") : 0.0, 0.0);
      // Exact, the replicas from across go on inside the DC as floats, not
      // relayed: no worker decodes a message twice.
      EXPECT_DOUBLE_EQ(ma[r].bytes.at("worker/expert_gather"), ma[r].bytes.at("worker/expert_gather_raw"));
    }
  }
}

TEST(ExpertCompression, ThreeLevelsRelayWhatCrossedTheDcsThroughBothRawLevelsAndEveryDcHoldsOneCopy) {
  // 2 DCs x 2 racks x 2 workers, every expert gathered everywhere, the SR
  // codec across the DCs only: the rack level relays what crossed the DCs,
  // and the worker level relays that again, with what the rack level
  // relayed to it.
  auto job = parse_job_config(testing::model_yaml() + R"(cluster:
  levels:
    - name: dc
      size: 2
      link: {bandwidth: 1gbit, latency: 0ms, shape: false, codecs: {expert_gather: "sr:ef:topk:0.05+zstd:1"}}
    - name: rack
      size: 2
      link: {bandwidth: 10gbit, latency: 0ms, shape: false}
    - name: worker
      size: 2
      link: {bandwidth: 10gbit, latency: 0ms, shape: false}
  expert_parallel:
    mode: hybrid
    domain_sizes: [2, 2, 2]
    memory_cap: unlimited
    base_sync_every: 2
)",
                              "job.yaml");
  ASSERT_TRUE(job.has_value()) << job.status().to_string();
  job->train.model.expert_init_spread = 0.3;
  Workers w = start_workers(*job);
  const ModelConfig& mc = job->train.model;
  const size_t ef = expert_floats(*job);
  std::vector<StepMetrics> metrics;
  for (int step = 0; step < 4; ++step) {
    step_all(w, &metrics);
    for (int layer = 0; layer < mc.num_layers; ++layer)
      for (int e = 0; e < mc.num_experts; ++e) {
        // Worker r is in DC r / 4; expert e is worker e's.
        auto w2 = [&](int r) { return w.trainers[r]->expert_communicator().replica(layer, e).w2; };
        const std::string where = "layer " + std::to_string(layer) + " expert " + std::to_string(e) + " after step " +
                                  std::to_string(step + 1);
        for (int r = 0; r < 8; ++r) {
          // Inside the owner's DC everyone holds the owner's exact weights; in
          // the other DC everyone holds what the owner's peer across rebuilt.
          const int same = e / 4 == r / 4 ? e : (e + 4) % 8;
          ASSERT_EQ(0, std::memcmp(w2(r), w2(same), ef * sizeof(float))) << where << " worker " << r;
        }
        if (step > 0) {
          ASSERT_NE(0, std::memcmp(w2(e), w2((e + 4) % 8), ef * sizeof(float))) << where << ": lossy";
        }
      }
  }
  // Raw levels: what a worker holds exactly goes raw (its own expert at the
  // rack level; that and its rack peer's at the worker level), and every
  // message that crossed the DCs is relayed as it was sent: the one from
  // across at the rack level, then that one and the one its rack peer
  // relayed to it. Worker r's peers: r ^ 4 across the DCs, r ^ 2 in its rack
  // level, r ^ 1 at the worker level; each sends one DC message a layer.
  const double own_raw = double(mc.num_layers) * 3 * ef * sizeof(float);
  auto dc_sent = [&](int q) { return metrics[q].bytes.at("dc/expert_gather"); };
  for (int r = 0; r < 8; ++r) {
    const std::map<std::string, double>& b = metrics[r].bytes;
    EXPECT_DOUBLE_EQ(b.at("rack/expert_gather_raw"), 2 * own_raw) << "worker " << r;
    EXPECT_DOUBLE_EQ(b.at("worker/expert_gather_raw"), 4 * own_raw) << "worker " << r;
    EXPECT_DOUBLE_EQ(b.at("rack/expert_gather"), own_raw + dc_sent(r ^ 4)) << "worker " << r;
    EXPECT_DOUBLE_EQ(b.at("worker/expert_gather"), 2 * own_raw + dc_sent(r ^ 4) + dc_sent(r ^ 2 ^ 4)) << "worker " << r;
  }
}

TEST(ExpertCompression, AScheduledAllGatherSwitchesOnEveryWorkerAtItsStep) {
  // Every sign for the gathers of steps 0-2 (step 0's goes raw), the largest
  // 5% of the signs from step 3 on. (The replicas it rebuilds are checked
  // across the DC in ReceiversAcrossTheDcRebuildTheSameReplica...)
  const JobConfig job = job_for("sr:ef:topk_sign:1+zstd:1@3:topk_sign:0.05+zstd:1");
  Workers w = start_workers(job);
  std::vector<StepMetrics> metrics;
  std::vector<std::vector<double>> bytes(4);  // per worker, per step
  for (int step = 0; step < 6; ++step) {
    step_all(w, &metrics);
    for (int r = 0; r < 4; ++r) bytes[r].push_back(metrics[r].bytes.at("dc/expert_gather"));
  }
  // A step's metrics count the gather for that step: step 0's raw, then
  // every sign (one bit an entry), then a twentieth of the signs and their
  // positions, on every worker at the same step.
  for (int r = 0; r < 4; ++r)
    for (int step = 1; step < 6; ++step) {
      const std::string at = "worker " + std::to_string(r) + " step " + std::to_string(step);
      EXPECT_GT(bytes[r][0], 10 * bytes[r][step]) << at;
      if (step < 3) EXPECT_GT(bytes[r][step], 1.5 * bytes[r][3]) << at;
      else EXPECT_LT(bytes[r][step], 0.67 * bytes[r][2]) << at;
    }
}

TEST(ExpertCompression, EncodingFusedWithTheOptimizerStepTrainsToTheSameBitsAsASeparatePass) {
  for (const char* spec : {"sr:ef:topk:0.05+zstd:1", "sr:ef:pred:topk:0.05+zstd:1"}) {
    SCOPED_TRACE(spec);
    JobConfig fused = job_for(spec);
    JobConfig separate = fused;
    separate.cluster.expert_parallel.fused_encode = false;
    separate.cluster.expert_parallel.base_sync_every = fused.cluster.expert_parallel.base_sync_every = 2;
    Workers a = start_workers(fused), b = start_workers(separate);
    std::vector<StepMetrics> ma, mb;
    for (int step = 0; step < 5; ++step) {
      step_both_alike(a, &ma, b, &mb, step);
      if (::testing::Test::HasFatalFailure()) return;
      for (size_t r = 0; r < a.trainers.size(); ++r) {
        const std::vector<float> base_a = a.trainers[r]->expert_communicator().base_copy();
        const std::vector<float> base_b = b.trainers[r]->expert_communicator().base_copy();
        ASSERT_EQ(0, std::memcmp(base_a.data(), base_b.data(), base_a.size() * sizeof(float)));
      }
      // Feedback's first transfer (step 1's gather) is raw; later ones are lossy.
      if (step > 0) {
        EXPECT_GT(ma[0].nmse.at("dc/expert_gather"), 0.0) << "the codec is lossy, so the packing mattered";
      }
    }
    // The gathers of steps 2-6 go from rows the update packed: one DC message
    // per layer each (step 1's gather starts before any update).
    const int layers = fused.train.model.num_layers;
    for (size_t r = 0; r < a.trainers.size(); ++r) {
      EXPECT_EQ(a.trainers[r]->expert_communicator().fused_messages(), 5 * layers) << "worker " << r;
      EXPECT_EQ(b.trainers[r]->expert_communicator().fused_messages(), 0) << "worker " << r;
      // Either way, each update sends every layer's gather as it goes (an SR
      // base, synced every other step, installs after the gathers).
      EXPECT_EQ(a.trainers[r]->expert_communicator().sent_during_update(), 5 * layers) << "worker " << r;
      EXPECT_EQ(b.trainers[r]->expert_communicator().sent_during_update(), 5 * layers) << "worker " << r;
    }
  }
}

TEST(ExpertCompression, APlanUpdateThatKeepsTheDomainsKeepsTheCodecStateAndTrainsToTheSameBits) {
  // Lossy codecs with error feedback on both expert streams, token rows on
  // the worker link: a re-plan that changes only when the replicas' weight
  // gradients are computed must leave the bits alone. (Another r sums a
  // layer's rows in other chunks: equal within fp32 rounding, not in bits.)
  JobConfig job = job_for("sr:ef:topk:0.05+zstd:1");
  job.cluster.expert_parallel.domain_sizes = {2, 1};
  job.cluster.expert_parallel.base_sync_every = 2;
  job.train.farskip.overlapped = true;
  PlanUpdate update;
  update.step = 3;
  update.domain_sizes = {2, 1};
  update.pipeline_degree = 1;
  update.backward_pipeline_degree = 1;
  update.replica_weights_late = true;
  update.reason = "a test's schedule change";
  Workers plain = start_workers(job), switched = start_workers(job, update);
  std::vector<const ExpertCommunicator*> before;
  for (auto& t : switched.trainers) before.push_back(&t->expert_communicator());
  std::vector<StepMetrics> mp, ms;
  for (int step = 0; step < 5; ++step) {
    step_both_alike(plain, &mp, switched, &ms, step);
    if (::testing::Test::HasFatalFailure()) return;
    if (step > 0) {
      EXPECT_GT(mp[0].nmse.at("dc/expert_gather"), 0.0) << "the codec is lossy, so its state mattered";
    }
  }
  for (size_t r = 0; r < switched.trainers.size(); ++r) {
    EXPECT_EQ(before[r], &switched.trainers[r]->expert_communicator()) << "worker " << r << " kept its communicator";
    EXPECT_TRUE(switched.trainers[r]->replica_weights_late()) << "worker " << r << " switched";
  }
}

TEST(ExpertCompression, TheUpdateSendsEachLayersGatherOnceItsExpertsAreWrittenAndReceiversGetTheUpdatedWeights) {
  // bf16 across the DC, so what a receiver holds is known exactly: the
  // owner's weights after the update, rounded. Were a layer sent before the
  // update had written it, the receiver would hold the old weights.
  const JobConfig job = job_for("bf16");
  Workers w = start_workers(job);
  const ModelConfig& mc = job.train.model;
  const size_t ef = expert_floats(job);
  std::vector<StepMetrics> metrics;
  for (int step = 0; step < 3; ++step) {
    step_all(w, &metrics);
    for (int layer = 0; layer < mc.num_layers; ++layer)
      for (int e = 0; e < mc.num_experts; ++e) {
        // Let the next step's gather land, then compare with the owner's
        // weights as this update left them, rounded to bf16 for the DC link.
        const int owner = e / 2, across = (owner + 2) % 4;
        w.trainers[across]->expert_communicator().wait_gathered(layer);
        std::vector<uint16_t> bits(ef);
        std::vector<float> expect(ef);
        floats_to_bf16(w.trainers[owner]->expert_communicator().replica(layer, e).w2, ef, bits.data());
        bf16_to_floats(bits.data(), ef, expect.data());
        ASSERT_EQ(0, std::memcmp(expect.data(), w.trainers[across]->expert_communicator().replica(layer, e).w2,
                                 ef * sizeof(float)))
            << "layer " << layer << " expert " << e << " after step " << step + 1;
      }
  }
  for (size_t r = 0; r < w.trainers.size(); ++r)
    EXPECT_EQ(w.trainers[r]->expert_communicator().sent_during_update(), 3 * mc.num_layers) << "worker " << r;
}

struct TrainingResult {
  double loss = 0;  // mean of the last five steps
  double nmse = 0;  // mean over the steps of the DC gather's NMSE
};

// Trains `steps` steps on four workers.
TrainingResult train(const std::string& gather, int steps) {
  JobConfig job = job_for(gather);
  job.train.steps = steps;
  Workers w = start_workers(job);
  std::vector<StepMetrics> metrics;
  TrainingResult r;
  for (int step = 0; step < steps; ++step) {
    step_all(w, &metrics);
    if (step >= steps - 5) r.loss += metrics[0].loss / 5;
    if (metrics[0].nmse.count("dc/expert_gather")) r.nmse += metrics[0].nmse.at("dc/expert_gather") / steps;
  }
  return r;
}

TEST(ExpertCompression, TrainingWithTheSrCodecOnTheDcLinkEndsWithinTwoPercentOfTheUncompressedLoss) {
  const TrainingResult raw = train("raw", 30);
  const TrainingResult sr = train("sr:ef:topk:0.05+zstd:1", 30);
  const TrainingResult plain = train("topk:0.05+zstd:1", 30);
  std::printf("last 5 of 30 steps: loss raw %.4f, SR with feedback %.4f (NMSE %.2e), top-k without base %.4f "
              "(NMSE %.2e)\n", raw.loss, sr.loss, sr.nmse, plain.loss, plain.nmse);
  EXPECT_NEAR(sr.loss, raw.loss, 0.02 * raw.loss);
  // 30 steps of a small model cannot rank the codecs by loss (training is
  // chaotic at this scale; bench/sr_loss_bench.py does it over 300 steps), but
  // how well the replicas are rebuilt is deterministic.
  EXPECT_LT(sr.nmse, 0.1 * plain.nmse) << "without the base and feedback, the same ratio rebuilds far worse";
}

// The replicated (dense) parameters of every worker, back to back.
std::vector<float> dense_parameters(DistributedTrainer& t) {
  std::vector<float> out;
  MoeTransformer<float>& m = t.model();
  for (const TensorSlot& s : m.layout().slots())
    if (!s.is_routed_expert()) out.insert(out.end(), m.params().begin() + s.offset, m.params().begin() + s.offset + s.numel());
  return out;
}

TEST(DenseGradients, Bf16OnTheDcLinkHalvesItsBytesAndKeepsEveryReplicatedParameterBitIdentical) {
  std::map<std::string, double> dc_bytes;
  std::vector<float> loss;
  for (const std::string dense : {"raw", "bf16"}) {
    Workers w = start_workers(job_for("raw", dense));
    std::vector<StepMetrics> metrics;
    double bytes = 0;
    for (int step = 0; step < 4; ++step) {
      step_all(w, &metrics);
      const std::vector<float> first = dense_parameters(*w.trainers[0]);
      for (size_t r = 1; r < w.trainers.size(); ++r)
        ASSERT_EQ(first, dense_parameters(*w.trainers[r])) << dense << ": worker " << r << " after step " << step + 1;
      for (const auto& m : metrics)
        for (const char* k : {"dc/reduce_scatter", "dc/all_reduce"})
          if (m.bytes.count(k)) bytes += m.bytes.at(k);
    }
    dc_bytes[dense] = bytes;
    loss.push_back(metrics[0].loss);
  }
  EXPECT_NEAR(dc_bytes["bf16"] / dc_bytes["raw"], 0.5, 0.01);
  EXPECT_NEAR(loss[1], loss[0], 0.01 * loss[0]) << "bf16 partial sums barely move the loss in 4 steps";
}

// Bound of bf16's rounding (round to nearest even, 8 significant bits): each
// value is off by at most 2^-9 of itself, so the NMSE is at most 2^-18.
constexpr double kBf16Nmse = 1.0 / (1 << 18);

TEST(CodecFigures, EachLossyTrafficKindReportsItsTimeAndErrorUnderItsLinkClassAndRawTrafficReportsNone) {
  JobConfig job = job_for("raw", "bf16");
  job.cluster.expert_parallel.domain_sizes = {1, 2};  // token rows cross the DC link
  LinkCodecs& dc = job.cluster.levels[0].link.codecs;
  dc.dispatch = "int8_row";
  dc.combine = "bf16";
  ASSERT_TRUE(job.validate().is_ok());
  Workers w = start_workers(job);
  std::vector<StepMetrics> metrics;
  for (int step = 0; step < 3; ++step) {
    step_all(w, &metrics);
    for (size_t r = 0; r < metrics.size(); ++r) {
      const StepMetrics& m = metrics[r];
      const std::string at = "worker " + std::to_string(r) + " step " + std::to_string(step + 1);
      double sum = 0;
      for (const auto* part : {&m.codec_encode_seconds, &m.codec_decode_seconds})
        for (const auto& [key, seconds] : *part) {
          EXPECT_TRUE(key == "dc/dispatch" || key == "dc/combine" || key == "dc/dense_grad")
              << at << ": " << key << " is raw traffic";
          sum += seconds;
        }
      EXPECT_NEAR(sum, m.codec_s, 1e-12) << at;
      EXPECT_EQ(m.codec_encode_seconds.size(), m.codec_decode_seconds.size()) << at;
      for (const char* key : {"dc/dispatch", "dc/combine", "dc/dense_grad"}) {
        // Every worker both sends and receives each kind: both parts count.
        const double encode = m.codec_encode_seconds.count(key) ? m.codec_encode_seconds.at(key) : 0.0;
        const double decode = m.codec_decode_seconds.count(key) ? m.codec_decode_seconds.at(key) : 0.0;
        EXPECT_GT(encode, 0.0) << at << ": " << key << " encodes what it sends";
        EXPECT_GT(decode, 0.0) << at << ": " << key << " decodes what it receives";
        ASSERT_TRUE(m.nmse.count(key)) << at << ": " << key;
        EXPECT_GT(m.nmse.at(key), 0.0) << at << ": " << key << " is lossy";
      }
      EXPECT_LE(m.nmse.at("dc/combine"), kBf16Nmse) << at;
      EXPECT_LE(m.nmse.at("dc/dense_grad"), kBf16Nmse) << at;
      // 8-bit rows with a scale each: coarser than bf16, and far from losing
      // the rows (an NMSE near 1).
      EXPECT_GT(m.nmse.at("dc/dispatch"), m.nmse.at("dc/combine")) << at;
      EXPECT_LT(m.nmse.at("dc/dispatch"), 1e-3) << at;
      EXPECT_EQ(m.nmse.size(), 3u) << at << ": only the lossy traffic has an error";
    }
  }
}

}  // namespace
}  // namespace xd
