// gemm_pieces_bench: the pieces of gemm_in_pieces (model/gemm.h), which cut thin
// products into pieces OpenBLAS multiplies with its small-matrix kernels and
// transpose a thin op(B) first, set beside one cblas_sgemm call of the same
// product, in the same run. It also prints whether gemm<float> takes the
// pieces on this machine (gemm_uses_pieces()). Shapes are the model's:
// the linear layers, the SwiGLU experts' forward (op(B) transposed), input
// gradient (untransposed) and weight gradient (op(A) transposed), at the
// Table V model (d = 64, ff = 64) and the default one (d = 128, ff = 256),
// and wider ones the pieces must leave whole. Samples of the two sides
// alternate, so load spikes hit both; the ratio is of medians.
//
// usage: gemm_pieces_bench [--reps N] [--min-sample-ms X] [--csv FILE]
// Threads are not set: use OPENBLAS_NUM_THREADS (1 is one worker per core).
#include <cblas.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "common/clock.h"
#include "common/rng.h"
#include "model/gemm.h"

namespace {

struct Shape {
  const char* what;
  bool ta, tb;
  int m, n, k;
  float beta;
};

// C (m, n) = op(A) op(B) + beta C. Rows are tokens per worker or per expert.
const Shape kShapes[] = {
    {"linear fwd, d 64 -> 64 (x W^T)", false, true, 2048, 64, 64, 0.f},
    {"linear fwd, d 64 -> 256 (logits)", false, true, 2048, 256, 64, 0.f},
    {"linear dx, 64 <- 64 (dy W)", false, false, 2048, 64, 64, 1.f},
    {"linear dW, 64 x 64 over 2048 rows", true, false, 64, 64, 2048, 1.f},
    {"expert fwd, 512 rows, d 64 ff 64", false, true, 512, 64, 64, 0.f},
    {"expert dx, 512 rows, d 64 ff 64", false, false, 512, 64, 64, 1.f},
    {"expert dW, 64 x 64 over 512 rows", true, false, 64, 64, 512, 1.f},
    {"linear fwd, d 128 -> 128", false, true, 2048, 128, 128, 0.f},
    {"linear dx, 128 <- 128", false, false, 2048, 128, 128, 1.f},
    {"linear dW, 128 x 128 over 2048 rows", true, false, 128, 128, 2048, 1.f},
    {"expert fwd, 1024 rows, d 128 ff 256", false, true, 1024, 256, 128, 0.f},
    {"expert dx, 1024 rows, ff 256 <- d 128", false, false, 1024, 256, 128, 1.f},
    {"expert dW, 256 x 128 over 1024 rows", true, false, 256, 128, 1024, 1.f},
    {"wide (whole): 1024 rows, 512 x 512", false, false, 1024, 512, 512, 1.f},
    {"wide (whole): dW 512 x 512 over 1024", true, false, 512, 512, 1024, 1.f},
};

[[noreturn]] void usage(int code) {
  std::fprintf(code ? stderr : stdout,
               "usage: gemm_pieces_bench [--reps N] [--min-sample-ms X] [--csv FILE]\n"
               "  --reps           alternating samples per side (default 21)\n"
               "  --min-sample-ms  calls repeated so one sample lasts at least this (default 2)\n"
               "  --csv            also write the table as CSV to FILE\n"
               "Threads are not set: use OPENBLAS_NUM_THREADS (1 = one worker per core).\n");
  std::exit(code);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  int reps = 21;
  double min_sample_ms = 2;
  std::string csv_path;
  for (int i = 1; i < argc; ++i) {
    std::string flag = argv[i];
    if (flag == "--help" || flag == "-h") usage(0);
    if (i + 1 >= argc) usage(2);
    std::string value = argv[++i];
    char* end = nullptr;
    if (flag == "--reps") {
      long v = std::strtol(value.c_str(), &end, 10);
      if (*end != '\0' || v < 3 || v > 1000) usage(2);
      reps = static_cast<int>(v);
    } else if (flag == "--min-sample-ms") {
      min_sample_ms = std::strtod(value.c_str(), &end);
      if (*end != '\0' || !(min_sample_ms > 0 && min_sample_ms <= 1000)) usage(2);
    } else if (flag == "--csv") {
      csv_path = value;
    } else {
      usage(2);
    }
  }
  std::printf("gemm_pieces_bench: thin products in pieces vs one cblas_sgemm, same product\n");
  std::printf("openblas: %s, core %s, threads %d\n", openblas_get_config(),
              openblas_get_corename(), openblas_get_num_threads());
  std::printf("gemm<float> here: %s\n\n",
              xd::gemm_uses_pieces()
                  ? "pieces (a core with small-matrix kernels, or XDMOE_GEMM_PIECES=1)"
                  : "one call (no small-matrix kernels on this core, or XDMOE_GEMM_PIECES=0)");
  std::printf("%-40s %5s %5s %5s | %9s %9s | %6s | %s\n", "product (C = op(A) op(B))", "m", "n",
              "k", "one GF/s", "pieces", "gain", "path");
  FILE* csv = csv_path.empty() ? nullptr : std::fopen(csv_path.c_str(), "w");
  if (!csv_path.empty() && !csv) {
    std::fprintf(stderr, "gemm_pieces_bench: cannot write %s\n", csv_path.c_str());
    return 1;
  }
  if (csv) std::fprintf(csv, "product,ta,tb,m,n,k,beta,one_gflops,pieces_gflops,gain_pct\n");
  xd::Rng rng(7);
  for (const Shape& s : kShapes) {
    const int lda = s.ta ? s.m : s.k, ldb = s.tb ? s.k : s.n;
    std::vector<float> a(static_cast<size_t>(s.m) * s.k), b(static_cast<size_t>(s.k) * s.n);
    std::vector<float> c(static_cast<size_t>(s.m) * s.n, 0.f);
    for (float& x : a) x = static_cast<float>(rng.normal());
    for (float& x : b) x = static_cast<float>(rng.normal() * 0.01);
    auto one = [&] {
      cblas_sgemm(CblasRowMajor, s.ta ? CblasTrans : CblasNoTrans, s.tb ? CblasTrans : CblasNoTrans,
                  s.m, s.n, s.k, 1.f, a.data(), lda, b.data(), ldb, s.beta, c.data(), s.n);
    };
    auto ours = [&] {
      xd::gemm_in_pieces(s.ta, s.tb, s.m, s.n, s.k, 1.f, a.data(), lda, b.data(), ldb, s.beta,
                         c.data(), s.n);
    };
    // Calls per sample: enough for min_sample_ms, from a timed warm-up.
    for (int w = 0; w < 3; ++w) { one(); ours(); }
    double t0 = xd::steady_seconds();
    one();
    const double single = std::max(1e-7, xd::steady_seconds() - t0);
    const int calls = std::max(1, static_cast<int>(min_sample_ms * 1e-3 / single));
    std::vector<double> t_one, t_ours;
    for (int r = 0; r < reps; ++r) {
      for (int side = 0; side < 2; ++side) {
        const bool ours_now = (side == 0) == (r % 2 == 0);
        double start = xd::steady_seconds();
        for (int i = 0; i < calls; ++i) ours_now ? ours() : one();
        (ours_now ? t_ours : t_one).push_back((xd::steady_seconds() - start) / calls);
      }
    }
    const double flops = 2.0 * s.m * s.n * s.k;
    const double g_one = flops / median(t_one) / 1e9, g_ours = flops / median(t_ours) / 1e9;
    const double gain = 100.0 * (median(t_one) / median(t_ours) - 1.0);
    const char* path = s.ta ? "A^T B" : (s.tb ? "A B^T" : "A B");
    std::printf("%-40s %5d %5d %5d | %9.1f %9.1f | %+5.0f%% | %s\n", s.what, s.m, s.n, s.k, g_one,
                g_ours, gain, path);
    if (csv)
      std::fprintf(csv, "\"%s\",%d,%d,%d,%d,%d,%g,%.2f,%.2f,%.1f\n", s.what, s.ta, s.tb, s.m, s.n,
                   s.k, s.beta, g_one, g_ours, gain);
  }
  if (csv) std::fclose(csv);
  std::printf("\ngain: one call's median time / the pieces' - 1 (alternating samples).\n");
  return 0;
}
