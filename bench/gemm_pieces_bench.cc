// gemm_pieces_bench: the pieces of gemm_in_pieces (model/gemm.h), which cut thin
// products into pieces OpenBLAS multiplies with its small-matrix kernels and
// transpose a thin op(B) first, and gemm<float> as this machine runs it (the
// pieces, the thin AVX2 kernel of model/detail/thin_gemm.h, or one call),
// set beside one cblas_sgemm call of the same product, in the same run. It
// also prints which path gemm<float> takes for each product. Shapes are the model's:
// the linear layers, the SwiGLU experts' forward (op(B) transposed), input
// gradient (untransposed) and weight gradient (op(A) transposed), at the
// Table V model (d = 64, ff = 64) and the default one (d = 128, ff = 256),
// and wider ones the pieces must leave whole. Samples of the three sides
// take turns, so load spikes hit all; the ratios are of medians.
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
    {"router logits, 8 experts (x W^T)", false, true, 2048, 8, 64, 0.f},
    {"router dx, 8 experts (dy W)", false, false, 2048, 64, 8, 1.f},
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
  std::printf("gemm_pieces_bench: thin products in pieces and through gemm<float> vs one cblas_sgemm\n");
  std::printf("openblas: %s, core %s, threads %d\n", openblas_get_config(),
              openblas_get_corename(), openblas_get_num_threads());
  std::printf("gemm<float> here: %s\n\n",
              xd::gemm_uses_pieces()
                  ? "pieces (a core with small-matrix kernels, or XDMOE_GEMM_PIECES=1)"
                  : xd::gemm_uses_thin_kernel(false, 64, 64)
                        ? "the thin AVX2 kernel where op(A) is untransposed, op(B) holds at "
                          "most 8192 entries and C is at least 16 wide, else one call (no "
                          "small-matrix kernels on this core)"
                        : "one call (no small-matrix kernels and no AVX2 here, or XDMOE_THIN_GEMM=0)");
  std::printf("%-40s %5s %5s %5s | %9s %9s %6s | %9s %6s %-6s | %s\n", "product (C = op(A) op(B))",
              "m", "n", "k", "one GF/s", "pieces", "gain", "gemm<f>", "gain", "takes", "op");
  FILE* csv = csv_path.empty() ? nullptr : std::fopen(csv_path.c_str(), "w");
  if (!csv_path.empty() && !csv) {
    std::fprintf(stderr, "gemm_pieces_bench: cannot write %s\n", csv_path.c_str());
    return 1;
  }
  if (csv)
    std::fprintf(csv,
                 "product,ta,tb,m,n,k,beta,one_gflops,pieces_gflops,gain_pct,gemm_gflops,"
                 "gemm_gain_pct,gemm_path\n");
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
    auto pieces = [&] {
      xd::gemm_in_pieces(s.ta, s.tb, s.m, s.n, s.k, 1.f, a.data(), lda, b.data(), ldb, s.beta,
                         c.data(), s.n);
    };
    auto chosen = [&] {
      xd::gemm<float>(s.ta, s.tb, s.m, s.n, s.k, 1.f, a.data(), lda, b.data(), ldb, s.beta,
                      c.data(), s.n);
    };
    const char* takes = xd::gemm_uses_pieces() ? "pieces"
                        : xd::gemm_uses_thin_kernel(s.ta, s.n, s.k) ? "thin"
                                                                     : "one";
    // Calls per sample: enough for min_sample_ms, from a timed warm-up.
    for (int w = 0; w < 3; ++w) { one(); pieces(); chosen(); }
    double t0 = xd::steady_seconds();
    one();
    const double single = std::max(1e-7, xd::steady_seconds() - t0);
    const int calls = std::max(1, static_cast<int>(min_sample_ms * 1e-3 / single));
    std::vector<double> times[3];  // one call, pieces, gemm<float>
    for (int r = 0; r < reps; ++r) {
      for (int turn = 0; turn < 3; ++turn) {
        const int side = (turn + r) % 3;
        double start = xd::steady_seconds();
        for (int i = 0; i < calls; ++i) side == 0 ? one() : side == 1 ? pieces() : chosen();
        times[side].push_back((xd::steady_seconds() - start) / calls);
      }
    }
    const double flops = 2.0 * s.m * s.n * s.k;
    const double t_one = median(times[0]), t_pieces = median(times[1]), t_chosen = median(times[2]);
    const double g_one = flops / t_one / 1e9, g_pieces = flops / t_pieces / 1e9;
    const double g_chosen = flops / t_chosen / 1e9;
    const double gain = 100.0 * (t_one / t_pieces - 1.0), gain_chosen = 100.0 * (t_one / t_chosen - 1.0);
    const char* op = s.ta ? "A^T B" : (s.tb ? "A B^T" : "A B");
    std::printf("%-40s %5d %5d %5d | %9.1f %9.1f %+5.0f%% | %9.1f %+5.0f%% %-6s | %s\n", s.what, s.m,
                s.n, s.k, g_one, g_pieces, gain, g_chosen, gain_chosen, takes, op);
    if (csv)
      std::fprintf(csv, "\"%s\",%d,%d,%d,%d,%d,%g,%.2f,%.2f,%.1f,%.2f,%.1f,%s\n", s.what, s.ta,
                   s.tb, s.m, s.n, s.k, s.beta, g_one, g_pieces, gain, g_chosen, gain_chosen, takes);
  }
  if (csv) std::fclose(csv);
  std::printf("\ngain: one call's median time / the pieces' (or gemm<float>'s) - 1, samples taking "
              "turns;\ntakes: gemm<float>'s path here: pieces, thin (the AVX2 kernel) or one (one "
              "cblas_sgemm call).\n");
  return 0;
}
