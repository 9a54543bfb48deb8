// Codec benchmark: compression ratio, encode and decode MB/s on one core, and
// reconstruction NMSE (||x - x'||^2 / ||x||^2) of every codec on real tensors
// of a trained model:
//   expert weights   every routed expert's w1, w3, w2 (the HybridEP AG traffic),
//                    plain codecs and the SR codec (residual vs the layer's
//                    mean expert) at several densities, and in int8 and int4
//                    rows;
//   activations      the rows Dispatch sends (the token A2A traffic);
//   output grads     the rows the backward of Combine sends;
//   expert grads     the routed experts' weight gradients (the replica-gradient
//                    return traffic), by rows of the matrix, and as the
//                    replica-gradient message lays them out: one row a tensor
//                    ("expert grads/t"), where int8_row and int4_row without a
//                    scale block have one scale for the whole tensor;
//   delta:           the expert weights as bit differences from the step
//                    before's (what receivers hold), one message a layer's
//                    projection; exact (NMSE 0). Only when it trains here.
// MB/s count fp32 input bytes; memcpy of the same bytes is measured in the same
// run as the yardstick. Without --checkpoint it first trains the built-in
// model for --train-steps steps.
//
// Usage: OPENBLAS_NUM_THREADS=1 codec_bench [--checkpoint DIR] [--train-steps N]
//                                          [--reps R] [--csv FILE]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "compression/codec.h"
#include "compression/expert_codec.h"
#include "compression/expert_stream_codec.h"
#include "model/checkpoint.h"
#include "model/trainer.h"

namespace {

using namespace xd;

struct Dataset {
  std::string name;
  std::vector<std::vector<float>> tensors;  // each encoded on its own
  std::vector<TensorShape> shapes;
  std::vector<std::vector<float>> bases;    // SR: the base of each tensor (expert weights only)
  size_t bytes() const {
    size_t b = 0;
    for (const auto& t : tensors) b += t.size() * sizeof(float);
    return b;
  }
};

double seconds_of(const std::function<void()>& f, int reps) {
  double best = 1e300;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

struct Row {
  std::string data, codec;
  double ratio = 0, encode_mb_s = 0, decode_mb_s = 0, nmse = 0;
};

// One codec over one dataset; `sr` encodes residuals against the bases.
Row measure(const Dataset& d, const std::string& spec, bool sr, int reps) {
  Row row;
  row.data = d.name;
  row.codec = (sr ? "sr:" : "") + spec;
  auto pipeline = CodecPipeline::parse(spec);
  auto expert_codec = ExpertResidualCodec::create(spec);
  if (!pipeline || !expert_codec) {
    std::fprintf(stderr, "bad codec %s\n", spec.c_str());
    std::exit(2);
  }
  std::vector<EncodedTensor> enc(d.tensors.size());
  std::vector<std::vector<float>> dec(d.tensors.size());
  for (size_t i = 0; i < d.tensors.size(); ++i) dec[i].resize(d.tensors[i].size());
  const double t_enc = seconds_of([&] {
    for (size_t i = 0; i < d.tensors.size(); ++i) {
      Status st = sr ? expert_codec->encode(d.tensors[i].data(), d.bases[i].data(), d.shapes[i], &enc[i])
                     : pipeline->encode(d.tensors[i].data(), d.shapes[i], &enc[i]);
      if (!st.is_ok()) std::fprintf(stderr, "encode %s: %s\n", spec.c_str(), st.message().c_str()), std::exit(1);
    }
  }, reps);
  const double t_dec = seconds_of([&] {
    for (size_t i = 0; i < d.tensors.size(); ++i) {
      Status st = sr ? expert_codec->decode(enc[i].metadata, enc[i].payload.data(), enc[i].payload.size(),
                                            d.bases[i].data(), dec[i].data(), dec[i].size())
                     : decode_tensor(enc[i].metadata, enc[i].payload.data(), enc[i].payload.size(), dec[i].data(),
                                     dec[i].size());
      if (!st.is_ok()) std::fprintf(stderr, "decode %s: %s\n", spec.c_str(), st.message().c_str()), std::exit(1);
    }
  }, reps);
  double wire = 0, err = 0, norm = 0;
  for (size_t i = 0; i < d.tensors.size(); ++i) {
    wire += enc[i].payload.size() + enc[i].metadata.size();
    for (size_t j = 0; j < d.tensors[i].size(); ++j) {
      const double x = d.tensors[i][j], e = x - dec[i][j];
      err += e * e;
      norm += x * x;
    }
  }
  row.ratio = d.bytes() / wire;
  row.encode_mb_s = d.bytes() / t_enc / 1e6;
  row.decode_mb_s = d.bytes() / t_dec / 1e6;
  row.nmse = norm > 0 ? err / norm : 0;
  return row;
}

// delta: one message per (layer, projection) of the experts, from receivers
// that hold `before` (the weights one optimizer step earlier) to `after`:
// the wire bytes of the step's messages, and the encode and decode time.
Row measure_delta(const std::string& spec, const std::vector<std::vector<float>>& before,
                  const std::vector<std::vector<float>>& after, size_t experts_per_message, int reps) {
  auto parsed = ExpertCodecSpec::parse(spec);
  if (!parsed) std::fprintf(stderr, "bad codec %s\n", spec.c_str()), std::exit(2);
  Row row;
  row.data = "expert weights";
  row.codec = spec + " (a step)";
  const size_t n = after.front().size();
  double best_enc = 1e300, best_dec = 1e300, wire = 0, raw = 0, err = 0;
  for (int r = 0; r < reps; ++r) {
    wire = raw = err = 0;
    double t_enc = 0, t_dec = 0;
    for (size_t first = 0; first < after.size(); first += experts_per_message) {
      ExpertStreamCodec sender(*parsed, ExpertStreamCodec::Traffic::kWeights, n);
      ExpertStreamCodec receiver(*parsed, ExpertStreamCodec::Traffic::kWeights, n);
      std::vector<std::vector<float>> x(before.begin() + first, before.begin() + first + experts_per_message);
      std::vector<std::vector<float>> got(experts_per_message, std::vector<float>(n));
      std::vector<ExpertTensorRef> mine, theirs;
      for (size_t e = 0; e < experts_per_message; ++e) {
        mine.push_back({e, x[e].data(), nullptr, 0});
        theirs.push_back({e, got[e].data(), nullptr, 0});
      }
      for (int step = 0; step < 2; ++step) {  // the step before (untimed), then the step
        if (step == 1)
          for (size_t e = 0; e < experts_per_message; ++e) x[e] = after[first + e];
        std::vector<float> packed;
        EncodedTensor enc;
        ReconstructionError re;
        const auto t0 = std::chrono::steady_clock::now();
        Status st = sender.encode(mine, &packed, &enc, &re);
        const auto t1 = std::chrono::steady_clock::now();
        if (st.is_ok()) st = receiver.receive(theirs, packed, enc);
        const auto t2 = std::chrono::steady_clock::now();
        if (!st.is_ok()) std::fprintf(stderr, "%s: %s\n", spec.c_str(), st.message().c_str()), std::exit(1);
        if (step == 0) continue;
        t_enc += std::chrono::duration<double>(t1 - t0).count();
        t_dec += std::chrono::duration<double>(t2 - t1).count();
        wire += enc.payload.empty() ? packed.size() * sizeof(float) : enc.payload.size() + enc.metadata.size();
        raw += experts_per_message * n * sizeof(float);
        for (size_t e = 0; e < experts_per_message; ++e)
          if (std::memcmp(got[e].data(), x[e].data(), n * sizeof(float)) != 0) err = 1;
      }
    }
    best_enc = std::min(best_enc, t_enc);
    best_dec = std::min(best_dec, t_dec);
  }
  if (err != 0) std::fprintf(stderr, "%s: a receiver's weights differ from the sender's\n", spec.c_str()), std::exit(1);
  row.ratio = raw / wire;
  row.encode_mb_s = raw / best_enc / 1e6;
  row.decode_mb_s = raw / best_dec / 1e6;
  row.nmse = 0;
  return row;
}

}  // namespace

int main(int argc, char** argv) {
  std::string checkpoint, csv = "bench/results/codecs.csv";
  int train_steps = 300, reps = 5;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--checkpoint") && i + 1 < argc) checkpoint = argv[++i];
    else if (!std::strcmp(argv[i], "--train-steps") && i + 1 < argc) train_steps = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--reps") && i + 1 < argc) reps = std::max(1, std::atoi(argv[++i]));
    else if (!std::strcmp(argv[i], "--csv") && i + 1 < argc) csv = argv[++i];
    else {
      std::fprintf(stderr, "usage: %s [--checkpoint DIR] [--train-steps N] [--reps R] [--csv FILE]\n", argv[0]);
      return 2;
    }
  }
  // A trained model: from a checkpoint, or trained here.
  TrainConfig cfg = default_train_config();
  std::vector<float> params, params_before;  // params_before: one step earlier (trained here only)
  if (!checkpoint.empty()) {
    auto ck = load_checkpoint(checkpoint);
    if (!ck) return std::fprintf(stderr, "%s\n", ck.status().message().c_str()), 1;
    cfg.model = ck->config;
    params = ck->params;
    std::printf("model from %s\n", checkpoint.c_str());
  } else {
    cfg.steps = train_steps;
    auto trainer = Trainer::create(cfg);
    if (!trainer) return std::fprintf(stderr, "%s\n", trainer.status().message().c_str()), 1;
    std::printf("training the built-in model for %d steps ...\n", train_steps);
    std::fflush(stdout);
    StepStats last;
    for (int s = 0; s < train_steps; ++s) {
      if (s == train_steps - 1) params_before = (*trainer)->model().params();
      last = *(*trainer)->step();
    }
    std::printf("trained: loss %.4f\n", last.loss.loss);
    params = (*trainer)->model().params();
  }
  const ModelConfig& mc = cfg.model;
  ParamLayout layout(mc);
  MoeTransformer<float> model(layout);
  model.params() = params;

  // Activations and gradients of one step on the corpus.
  auto tokens = load_training_tokens(cfg.data);
  if (!tokens) return std::fprintf(stderr, "%s\n", tokens.status().message().c_str()), 1;
  const int B = cfg.batch_size, T = cfg.seq_len;
  std::vector<int32_t> in(tokens->begin(), tokens->begin() + B * T), tgt(tokens->begin() + 1, tokens->begin() + 1 + B * T);
  // Keeps a copy of what crosses the exchange: the experts' inputs
  // (Dispatch) and their output gradients (the backward of Combine).
  LocalExpertExchange<float> exchange(mc.num_experts);
  std::vector<float> activations, output_grads;
  exchange.set_observer([&](const ExchangeTag& tag, const std::vector<float>& rows, const std::vector<int>&) {
    std::vector<float>& keep = tag.phase == (int)ExchangePhase::kDispatch ? activations : output_grads;
    keep.insert(keep.end(), rows.begin(), rows.end());
  });
  model.zero_grad();
  model.forward(in.data(), tgt.data(), B, T, &exchange);
  model.backward(&exchange);

  Dataset experts, expert_grads, grad_messages, acts, ograds;
  experts.name = "expert weights";
  expert_grads.name = "expert grads";
  grad_messages.name = "expert grads/t";
  acts.name = "activations";
  ograds.name = "output grads";
  const size_t d = mc.hidden_size, ff = mc.expert_intermediate_size, E = mc.num_experts;
  ModelWeights<float> w = layout.bind(model.params().data()), g = layout.bind(model.grads().data());
  for (size_t l = 0; l < w.layers.size(); ++l)
    for (int which = 0; which < 3; ++which) {
      float* block = which == 0 ? w.layers[l].w1 : which == 1 ? w.layers[l].w3 : w.layers[l].w2;
      float* gblock = which == 0 ? g.layers[l].w1 : which == 1 ? g.layers[l].w3 : g.layers[l].w2;
      const size_t n = ff * d;
      const TensorShape shape = which == 2 ? TensorShape{d, ff} : TensorShape{ff, d};
      std::vector<const float*> all;
      for (size_t e = 0; e < E; ++e) all.push_back(block + e * n);
      std::vector<float> base(n);
      ExpertResidualCodec::mean_expert(all, n, base.data());
      for (size_t e = 0; e < E; ++e) {
        experts.tensors.emplace_back(block + e * n, block + (e + 1) * n);
        experts.shapes.push_back(shape);
        experts.bases.push_back(base);
        expert_grads.tensors.emplace_back(gblock + e * n, gblock + (e + 1) * n);
        expert_grads.shapes.push_back(shape);
        grad_messages.tensors.push_back(expert_grads.tensors.back());
        grad_messages.shapes.push_back({1, n});
      }
    }
  acts.tensors.push_back(activations);
  acts.shapes.push_back({activations.size() / d, d});
  ograds.tensors.push_back(output_grads);
  ograds.shapes.push_back({output_grads.size() / d, d});

  // The yardstick: memcpy of the expert weights.
  std::vector<float> sink(experts.bytes() / sizeof(float));
  const double t_copy = seconds_of([&] {
    size_t at = 0;
    for (const auto& t : experts.tensors) {
      std::memcpy(sink.data() + at, t.data(), t.size() * sizeof(float));
      at += t.size();
    }
  }, reps);
  const double memcpy_mb_s = experts.bytes() / t_copy / 1e6;

  std::vector<Row> rows;
  for (const char* spec : {"raw+zstd:1", "bf16", "bf16+zstd:1", "fp16", "int8_row", "topk:0.01+zstd:1"})
    rows.push_back(measure(experts, spec, false, reps));
  for (const char* spec : {"bf16+zstd:1", "topk:0.1+zstd:1", "topk:0.05+zstd:1", "topk:0.02+zstd:1",
                           "topk:0.01+zstd:1", "topk:0.005+zstd:1", "topk_sign:0.1+zstd:1", "topk_sign:0.05+zstd:1",
                           "topk_sign:1+zstd:1", "block_sign:0.5+zstd:1", "block_sign:0.5:8+zstd:1",
                           "int8_row+zstd:1", "int4_row:128+zstd:1"})
    rows.push_back(measure(experts, spec, true, reps));
  if (!params_before.empty()) {
    // The experts of the step before, in the same order as `experts`.
    ModelWeights<float> wb = layout.bind(params_before.data());
    std::vector<std::vector<float>> before;
    for (size_t l = 0; l < wb.layers.size(); ++l)
      for (int which = 0; which < 3; ++which) {
        const float* block = which == 0 ? wb.layers[l].w1 : which == 1 ? wb.layers[l].w3 : wb.layers[l].w2;
        for (size_t e = 0; e < E; ++e) before.emplace_back(block + e * ff * d, block + (e + 1) * ff * d);
      }
    for (const char* spec : {"delta:raw", "delta:zstd:1"})
      rows.push_back(measure_delta(spec, before, experts.tensors, E, reps));
  } else {
    std::printf("(no delta: rows: a checkpoint has no step before it)\n");
  }
  for (Dataset* ds : {&acts, &ograds})
    for (const char* spec : {"raw+zstd:1", "bf16", "bf16+zstd:1", "fp16", "int8_row", "int8_row+zstd:1"})
      rows.push_back(measure(*ds, spec, false, reps));
  for (const char* spec : {"bf16", "int8_row", "int8_row+zstd:1", "int4_row", "int4_row+zstd:1", "topk:0.1+zstd:1",
                           "topk:0.01+zstd:1"})
    rows.push_back(measure(expert_grads, spec, false, reps));
  for (const char* spec : {"int8_row+zstd:1", "int8_row:64+zstd:1", "int4_row+zstd:1", "int4_row:128+zstd:1",
                           "int4_row:64+zstd:1", "int4_row:32+zstd:1"})
    rows.push_back(measure(grad_messages, spec, false, reps));

  std::printf("\nmodel: d %zu, ff %zu, %zu experts x %zu layers; expert weights %.1f MB, activations %.1f MB, "
              "output grads %.1f MB; memcpy %.0f MB/s\n",
              d, ff, E, w.layers.size(), experts.bytes() / 1e6, acts.bytes() / 1e6, ograds.bytes() / 1e6, memcpy_mb_s);
  std::printf("%-15s %-22s %9s %12s %12s %12s\n", "data", "codec", "ratio", "encode MB/s", "decode MB/s", "NMSE");
  std::ofstream out(csv);
  out << "data,codec,ratio,encode_mb_s,decode_mb_s,nmse,memcpy_mb_s\n";
  for (const Row& r : rows) {
    std::printf("%-15s %-22s %8.1fx %12.0f %12.0f %12.3e\n", r.data.c_str(), r.codec.c_str(), r.ratio,
                r.encode_mb_s, r.decode_mb_s, r.nmse);
    out << '"' << r.data << "\"," << r.codec << ',' << r.ratio << ',' << r.encode_mb_s << ',' << r.decode_mb_s << ','
        << r.nmse << ',' << memcpy_mb_s << '\n';
  }
  std::printf("\nCSV: %s (sr: = the residual against the layer's mean expert; MB/s of fp32 input, one core)\n",
              csv.c_str());
  return 0;
}
