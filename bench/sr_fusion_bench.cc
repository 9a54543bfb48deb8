// SR encode fused with the optimizer step, and SR decode as a sparse add
// (HybridEP Fig. 15), against the separate passes, on one core.
//
// One worker's routed experts, (layers, 3, experts, ff*d) as the model lays
// them out, start as a shared base plus a spread (like sparse upcycling) and
// take an AdamW step per iteration from seeded random gradients. Each
// iteration, per layer, the worker's all-gather message (its experts' w1, w3,
// w2) is encoded with the SR codec as the runtime does it
// (compression/expert_stream_codec.h):
//   separate  AdamW updates the block, then encode() packs x - base - held
//             from memory and encodes;
//   fused     AdamW's per-block hook packs the rows while the block it has
//             just written is in cache; encode() takes them.
// A receiver applies every message of the separate sender twice:
//   dense     decode_tensor() into a dense buffer, then apply() (the
//             reference path);
//   sparse    decode_sparse(), then apply_sparse() (what the runtime runs).
// Both senders must produce the same bytes, and both receivers the same
// bits: the bench checks it every iteration and fails otherwise.
//
// Reported per iteration (median over --iters): the optimizer alone, the
// encode overhead (optimizer + encode - optimizer alone) of each variant,
// each decode, and the fused / separate ratios.
//
// Usage: OPENBLAS_NUM_THREADS=1 sr_fusion_bench [--hidden D] [--ff F]
//          [--experts E] [--layers L] [--iters N] [--spec SPEC] [--csv FILE]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "compression/expert_stream_codec.h"
#include "common/rng.h"
#include "model/adamw.h"

namespace {

using namespace xd;

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

struct Options {
  int hidden = 64, ff = 512, experts = 1, layers = 2, iters = 30;
  std::string spec = "sr:ef:topk:0.04+zstd:1", csv;
};

// One sender: its weights, optimizer and per-layer codec state.
struct Sender {
  std::vector<float> params, grads;  // (layers, 3, experts, n)
  AdamW<float> optimizer;
  ExpertStreamCodec codec;
  Sender(const std::vector<float>& init, const ExpertCodecSpec& spec, size_t n)
      : params(init), grads(init.size()), optimizer(init.size(), AdamWConfig{}),
        codec(spec, ExpertStreamCodec::Traffic::kWeights, n) {}
};

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--hidden") o.hidden = std::atoi(next());
    else if (a == "--ff") o.ff = std::atoi(next());
    else if (a == "--experts") o.experts = std::atoi(next());
    else if (a == "--layers") o.layers = std::atoi(next());
    else if (a == "--iters") o.iters = std::atoi(next());
    else if (a == "--spec") o.spec = next();
    else if (a == "--csv") o.csv = next();
    else {
      std::fprintf(stderr,
                   "usage: sr_fusion_bench [--hidden D] [--ff F] [--experts E] [--layers L] [--iters N] "
                   "[--spec SPEC] [--csv FILE]\n");
      return a == "--help" ? 0 : 2;
    }
  }
  if (o.hidden < 1 || o.ff < 1 || o.experts < 1 || o.layers < 1 || o.iters < 3) {
    std::fprintf(stderr, "sizes must be positive and --iters at least 3\n");
    return 2;
  }
  auto spec = ExpertCodecSpec::parse(o.spec);
  if (!spec) {
    std::fprintf(stderr, "%s\n", spec.status().to_string().c_str());
    return 2;
  }
  const size_t n = (size_t)o.ff * o.hidden, per_layer = 3 * (size_t)o.experts * n;
  const size_t total = (size_t)o.layers * per_layer;
  // The base per (layer, which); experts = base + 0.2 x a spread.
  Rng rng(7);
  std::vector<float> base((size_t)o.layers * 3 * n), init(total);
  for (float& b : base) b = 0.05f * (float)rng.normal();
  for (int l = 0; l < o.layers; ++l)
    for (int w = 0; w < 3; ++w)
      for (int e = 0; e < o.experts; ++e)
        for (size_t k = 0; k < n; ++k)
          init[(((size_t)l * 3 + w) * o.experts + e) * n + k] =
              base[((size_t)l * 3 + w) * n + k] + 0.01f * (float)rng.normal();
  Sender alone(init, *spec, n), separate(init, *spec, n), fused(init, *spec, n);
  ExpertStreamCodec dense(*spec, ExpertStreamCodec::Traffic::kWeights, n);
  ExpertStreamCodec sparse(*spec, ExpertStreamCodec::Traffic::kWeights, n);
  std::vector<float> at_dense(total, 0.0f), at_sparse(total, 0.0f), decoded(per_layer);

  // A message's tensors in wire order (expert, then w1, w3, w2) over `data`.
  auto refs = [&](int layer, float* data) {
    std::vector<ExpertTensorRef> r;
    for (int e = 0; e < o.experts; ++e)
      for (int w = 0; w < 3; ++w)
        r.push_back({((uint64_t)layer * o.experts + e) * 3 + w, data + (((size_t)layer * 3 + w) * o.experts + e) * n,
                     &base[((size_t)layer * 3 + w) * n]});
    return r;
  };
  std::vector<std::vector<float>> rows(o.layers, std::vector<float>(per_layer));
  std::vector<std::vector<ExpertTensorRef>> fused_refs;
  for (int l = 0; l < o.layers; ++l) fused_refs.push_back(refs(l, fused.params.data()));
  std::vector<PackSums> sums(o.layers);
  // The optimizer's hook: block [begin, end) -> (layer, which, expert, k) -> the message row.
  auto hook = [&](size_t begin, size_t end) {
    for (size_t at = begin; at < end;) {
      const size_t layer = at / per_layer, in_layer = at % per_layer;
      const size_t w = in_layer / ((size_t)o.experts * n), e = in_layer / n % o.experts, k = in_layer % n;
      const size_t count = std::min(end - at, n - k);
      fused.codec.pack(fused_refs[layer][e * 3 + w], k, count, &rows[layer][(e * 3 + w) * n + k], &sums[layer]);
      at += count;
    }
  };

  std::vector<double> t_alone, t_sep, t_fused, t_dense, t_sparse, ratio_sent;
  for (int it = 0; it < o.iters; ++it) {
    Rng g(1000 + it);
    for (float& x : alone.grads) x = 0.01f * (float)g.normal();
    separate.grads = alone.grads;
    fused.grads = alone.grads;
    const double lr = 3e-3;
    double t0 = now_s();
    alone.optimizer.step(alone.params.data(), alone.grads.data(), lr);
    t_alone.push_back(now_s() - t0);

    std::vector<EncodedTensor> sent(o.layers);
    std::vector<std::vector<float>> sent_raw(o.layers);
    t0 = now_s();
    separate.optimizer.step(separate.params.data(), separate.grads.data(), lr);
    for (int l = 0; l < o.layers; ++l) {
      ReconstructionError err;
      if (!separate.codec.encode(refs(l, separate.params.data()), &sent_raw[l], &sent[l], &err).is_ok()) return 1;
    }
    t_sep.push_back(now_s() - t0);

    for (PackSums& s : sums) s = PackSums{};
    t0 = now_s();
    fused.optimizer.step(fused.params.data(), fused.grads.data(), lr, -1.0, hook);
    double bytes = 0;
    for (int l = 0; l < o.layers; ++l) {
      ReconstructionError err;
      EncodedTensor enc;
      std::vector<float> packed;
      packed.swap(rows[l]);
      if (!fused.codec.encode(refs(l, fused.params.data()), &packed, &enc, &err, &sums[l]).is_ok()) return 1;
      rows[l].swap(packed);
      if (enc.payload != sent[l].payload || enc.metadata != sent[l].metadata) {
        std::fprintf(stderr, "iteration %d layer %d: the fused sender's message differs from the separate one's\n", it, l);
        return 1;
      }
      bytes += enc.payload.empty() ? 4.0 * per_layer : enc.payload.size();
    }
    t_fused.push_back(now_s() - t0);
    ratio_sent.push_back(4.0 * total / bytes);

    double dense_s = 0, sparse_s = 0;
    for (int l = 0; l < o.layers; ++l) {
      const EncodedTensor& e = sent[l];
      if (e.payload.empty()) {  // feedback's first, raw transfer
        dense.apply(refs(l, at_dense.data()), sent_raw[l].data());
        sparse.apply(refs(l, at_sparse.data()), sent_raw[l].data());
        continue;
      }
      t0 = now_s();
      auto rec = parse_codec_record(e.metadata);
      if (!rec || !decode_tensor(*rec, e.payload.data(), e.payload.size(), decoded.data(), decoded.size()).is_ok()) return 1;
      dense.apply(refs(l, at_dense.data()), decoded.data());
      dense_s += now_s() - t0;
      t0 = now_s();
      auto rec2 = parse_codec_record(e.metadata);
      SparseTensor entries;
      if (!rec2 || !is_sparse(*rec2)) {
        std::fprintf(stderr, "--spec must be a top-k pipeline for the sparse decode\n");
        return 2;
      }
      if (!decode_sparse(*rec2, e.payload.data(), e.payload.size(), &entries).is_ok()) return 1;
      sparse.apply_sparse(refs(l, at_sparse.data()), entries);
      sparse_s += now_s() - t0;
    }
    if (std::memcmp(at_dense.data(), at_sparse.data(), total * sizeof(float)) != 0) {
      std::fprintf(stderr, "iteration %d: the sparse receiver holds other bits than the dense one\n", it);
      return 1;
    }
    if (it > 0) {  // the first iteration's raw transfer decodes nothing
      t_dense.push_back(dense_s);
      t_sparse.push_back(sparse_s);
    }
  }
  const double alone_ms = 1e3 * median(t_alone);
  const double sep_ms = 1e3 * median(t_sep) - alone_ms, fused_ms = 1e3 * median(t_fused) - alone_ms;
  const double dense_ms = 1e3 * median(t_dense), sparse_ms = 1e3 * median(t_sparse);
  std::printf("experts %d x %d layers, %.0f KB per expert, spec %s, ratio %.1fx, %d iterations (medians)\n",
              o.experts, o.layers, 3.0 * n * 4 / 1e3, o.spec.c_str(), median(ratio_sent), o.iters);
  std::printf("  optimizer alone            %8.3f ms\n", alone_ms);
  std::printf("  encode overhead, separate  %8.3f ms\n", sep_ms);
  std::printf("  encode overhead, fused     %8.3f ms  (%.2fx of separate, %.0f%% less)\n", fused_ms,
              fused_ms / sep_ms, 100.0 * (1 - fused_ms / sep_ms));
  std::printf("  decode, dense reference    %8.3f ms\n", dense_ms);
  std::printf("  decode, sparse add         %8.3f ms  (%.2fx of dense, %.0f%% less)\n", sparse_ms,
              sparse_ms / dense_ms, 100.0 * (1 - sparse_ms / dense_ms));
  if (!o.csv.empty()) {
    const bool fresh = !std::ifstream(o.csv).good();
    std::ofstream f(o.csv, std::ios::app);
    if (fresh) f << "hidden,ff,experts,layers,spec,ratio,optimizer_ms,encode_separate_ms,encode_fused_ms,decode_dense_ms,decode_sparse_ms\n";
    f << o.hidden << "," << o.ff << "," << o.experts << "," << o.layers << "," << o.spec << "," << median(ratio_sent)
      << "," << alone_ms << "," << sep_ms << "," << fused_ms << "," << dense_ms << "," << sparse_ms << "\n";
  }
  return 0;
}
