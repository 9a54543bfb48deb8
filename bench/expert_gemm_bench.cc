// expert_gemm_bench: the SwiGLU expert compute (model/swiglu_expert.h) at the
// model's real shapes, set beside bare cblas_sgemm on the same GEMM sequence.
//
// For tokens-per-expert n, hidden d and expert ff the expert does
//   forward  (3 GEMMs): h1 = x w1^T, h3 = x w3^T          (n x d)(d x ff)
//                       y  = gated w2^T                    (n x ff)(ff x d)
//   backward (6 GEMMs): dgated  = dy w2,   dw2 += dy^T gated,
//                       dx     += dh1 w1,  dw1 += dh1^T x,
//                       dx     += dh3 w3,  dw3 += dh3^T x
// i.e. 2*n*d*ff FLOPs per GEMM, 6*n*d*ff forward and 18*n*d*ff forward+backward.
// Only those GEMM FLOPs are counted for every GFLOP/s figure here.
//
// Measured per shape, interleaved so noise hits both sides alike:
//   (a) swiglu_expert_forward                  vs (c_fwd) the 3 forward GEMMs
//   (b) swiglu_expert_forward + _backward      vs (c_f+b) all 9 GEMMs
// where (c) are bare cblas_sgemm calls with the same transposes, leading
// dimensions and betas on preallocated buffers (no elementwise work, no allocation).
// efficiency % = GFLOP/s(ours) / GFLOP/s(sgemm) = t(sgemm) / t(ours).
// A second table splits the gap into forward and backward: overhead = expert time
// minus the bare-sgemm time of the same GEMMs (paired medians), also per element of
// the (n, ff) activations, i.e. what the non-GEMM work (gate, copies) costs.
//
// Threads are not set here: run with OPENBLAS_NUM_THREADS=1 (one worker per core)
// or as wanted; the header prints what OpenBLAS reports. See bench/README.md.

#include <cblas.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "model/swiglu_expert.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Shape {
  int d, ff, n;
};

struct Options {
  int d = 128;   // default training config's expert shape
  int ff = 256;
  std::vector<int> ns = {64, 256, 1024, 4096};
  int reps = 30;
  double min_sample_ms = 2.0;  // inner iterations per sample so one sample lasts >= this
  bool realistic = true;       // also d=512, ff=1024, n in {256, 1024}
  bool breakdown = true;       // print the overhead table too
  std::string csv;
};

[[noreturn]] void usage_error(const std::string& msg) {
  std::fprintf(stderr, "expert_gemm_bench: %s\n(try --help)\n", msg.c_str());
  std::exit(2);
}

void print_help() {
  std::printf(
      "usage: expert_gemm_bench [--d N] [--ff N] [--n N[,N...]] [--reps N]\n"
      "                         [--min-sample-ms X] [--csv FILE] [--no-realistic]\n"
      "                         [--no-breakdown]\n"
      "  --d              hidden size d                       (default 128)\n"
      "  --ff             expert intermediate size ff         (default 256)\n"
      "  --n              tokens per expert, comma list       (default 64,256,1024,4096)\n"
      "  --reps           timed samples per measurement       (default 30)\n"
      "  --min-sample-ms  calls are repeated so one sample lasts at least this (default 2)\n"
      "  --csv            also write the results as CSV to FILE\n"
      "  --no-realistic   skip the extra d=512 ff=1024 n={256,1024} shapes\n"
      "  --no-breakdown   skip the forward/backward overhead table\n"
      "Threads are not set: use OPENBLAS_NUM_THREADS.\n");
}

long parse_long(const std::string& flag, const std::string& s, long lo, long hi) {
  if (s.empty()) usage_error(flag + ": empty value");
  errno = 0;
  char* end = nullptr;
  long v = std::strtol(s.c_str(), &end, 10);
  if (errno != 0 || end == s.c_str() || *end != '\0')
    usage_error(flag + ": '" + s + "' is not an integer");
  if (v < lo || v > hi)
    usage_error(flag + ": " + s + " is out of range [" + std::to_string(lo) + ", " +
                std::to_string(hi) + "]");
  return v;
}

double parse_double(const std::string& flag, const std::string& s, double lo, double hi) {
  if (s.empty()) usage_error(flag + ": empty value");
  errno = 0;
  char* end = nullptr;
  double v = std::strtod(s.c_str(), &end);
  if (errno != 0 || end == s.c_str() || *end != '\0' || !std::isfinite(v))
    usage_error(flag + ": '" + s + "' is not a number");
  if (v < lo || v > hi) usage_error(flag + ": " + s + " is out of range");
  return v;
}

std::vector<int> parse_list(const std::string& flag, const std::string& s) {
  std::vector<int> out;
  size_t pos = 0;
  while (true) {
    size_t comma = s.find(',', pos);
    std::string item = s.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    out.push_back((int)parse_long(flag, item, 1, 1 << 20));
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return out;
}

Options parse_args(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      print_help();
      std::exit(0);
    }
    if (a == "--no-realistic") {
      o.realistic = false;
      continue;
    }
    if (a == "--no-breakdown") {
      o.breakdown = false;
      continue;
    }
    std::string flag = a, value;
    bool has_value = false;
    if (size_t eq = a.find('='); a.rfind("--", 0) == 0 && eq != std::string::npos) {
      flag = a.substr(0, eq);
      value = a.substr(eq + 1);
      has_value = true;
    }
    const bool known = flag == "--d" || flag == "--ff" || flag == "--n" || flag == "--reps" ||
                       flag == "--csv" || flag == "--min-sample-ms";
    if (!known) usage_error("unknown argument '" + a + "'");
    if (!has_value) {
      if (i + 1 >= argc) usage_error(flag + ": missing value");
      value = argv[++i];
    }
    if (flag == "--d") o.d = (int)parse_long(flag, value, 1, 1 << 16);
    else if (flag == "--ff") o.ff = (int)parse_long(flag, value, 1, 1 << 16);
    else if (flag == "--n") o.ns = parse_list(flag, value);
    else if (flag == "--reps") o.reps = (int)parse_long(flag, value, 1, 100000);
    else if (flag == "--min-sample-ms") o.min_sample_ms = parse_double(flag, value, 0.0, 10000.0);
    else if (flag == "--csv") {
      if (value.empty()) usage_error("--csv: empty file name");
      o.csv = value;
    }
  }
  return o;
}

void fill(std::vector<float>* v, std::mt19937* rng, float scale) {
  std::uniform_real_distribution<float> u(-scale, scale);
  for (float& x : *v) x = u(*rng);
}

double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

// One timed sample: `iters` back-to-back calls, returns ms per call.
double sample(const std::function<void()>& f, int iters) {
  auto t0 = Clock::now();
  for (int i = 0; i < iters; ++i) f();
  return ms_since(t0) / iters;
}

struct Stats {
  double best = 0, median = 0;  // ms per call
};

Stats stats(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  Stats s;
  s.best = v.front();
  const size_t m = v.size() / 2;
  s.median = v.size() % 2 ? v[m] : 0.5 * (v[m - 1] + v[m]);
  return s;
}

// Calls per sample so that one sample of f lasts >= min_ms (best of 3 single calls).
int calibrate(const std::function<void()>& f, double min_ms) {
  double t = sample(f, 1);
  for (int i = 0; i < 2; ++i) t = std::min(t, sample(f, 1));
  if (t <= 0) return 1000;
  return std::clamp((int)std::ceil(min_ms / t), 1, 100000);
}

// Times A and B interleaved (A B, then B A on the next rep, ...) after a warm-up.
void measure_pair(const std::function<void()>& a, const std::function<void()>& b, int reps,
                  double min_ms, Stats* sa, Stats* sb) {
  for (int w = 0; w < 3; ++w) {  // warm-up: pages, caches, OpenBLAS buffers
    a();
    b();
  }
  // The same call count for both sides, enough for the faster one to last >= min_ms.
  const int iters = std::max(calibrate(a, min_ms), calibrate(b, min_ms));
  std::vector<double> ta, tb;
  ta.reserve(reps);
  tb.reserve(reps);
  for (int r = 0; r < reps; ++r) {
    if (r % 2 == 0) {
      ta.push_back(sample(a, iters));
      tb.push_back(sample(b, iters));
    } else {
      tb.push_back(sample(b, iters));
      ta.push_back(sample(a, iters));
    }
  }
  *sa = stats(std::move(ta));
  *sb = stats(std::move(tb));
}

struct Result {
  Shape s;
  double fwd_gflop = 0, fb_gflop = 0;
  Stats ours_fwd, base_fwd, ours_fb, base_fb;
  // Overhead = expert median - sgemm median (ms per call); bwd = (f+b) - fwd.
  double fwd_overhead() const { return ours_fwd.median - base_fwd.median; }
  double bwd_overhead() const {
    return (ours_fb.median - ours_fwd.median) - (base_fb.median - base_fwd.median);
  }
  double ns_per_elem(double ms) const { return ms * 1e6 / ((double)s.n * s.ff); }
};

double gflops(double gflop, double ms) { return ms > 0 ? gflop / (ms * 1e-3) : 0.0; }
double pct(double base_ms, double ours_ms) { return ours_ms > 0 ? 100.0 * base_ms / ours_ms : 0.0; }

Result run_shape(const Shape& s, const Options& o) {
  const int n = s.n, d = s.d, ff = s.ff;
  const size_t nd = (size_t)n * d, nf = (size_t)n * ff, fd = (size_t)ff * d;
  std::mt19937 rng(1234u + (unsigned)n * 7u + (unsigned)d * 13u + (unsigned)ff);
  const float ws = 1.0f / std::sqrt((float)d), ws2 = 1.0f / std::sqrt((float)ff);

  // Shared inputs.
  std::vector<float> x(nd), dy(nd), w1(fd), w3(fd), w2(fd);
  fill(&x, &rng, 1.0f);
  fill(&dy, &rng, 1e-3f);
  fill(&w1, &rng, ws);
  fill(&w3, &rng, ws);
  fill(&w2, &rng, ws2);

  // Ours: model/swiglu_expert with one cache reused across calls (as a kept MoeCache).
  std::vector<float> out(nd), dx(nd, 0.f), dw1(fd, 0.f), dw3(fd, 0.f), dw2(fd, 0.f);
  xd::ExpertParams<float> p{w1.data(), w3.data(), w2.data(), dw1.data(), dw3.data(), dw2.data()};
  xd::ExpertCache<float> cache;

  // Baseline: preallocated buffers, same GEMM calls, nothing else.
  std::vector<float> h1(nf), h3(nf), gated(nf), out_b(nd), dgated(nf, 0.f), dh1(nf), dh3(nf);
  std::vector<float> dx_b(nd, 0.f), dw1_b(fd, 0.f), dw3_b(fd, 0.f), dw2_b(fd, 0.f);
  fill(&gated, &rng, 0.5f);
  fill(&dh1, &rng, 1e-3f);
  fill(&dh3, &rng, 1e-3f);

  const auto NT = CblasNoTrans, T = CblasTrans;
  const auto RM = CblasRowMajor;
  auto base_fwd = [&] {
    cblas_sgemm(RM, NT, T, n, ff, d, 1.f, x.data(), d, w1.data(), d, 0.f, h1.data(), ff);
    cblas_sgemm(RM, NT, T, n, ff, d, 1.f, x.data(), d, w3.data(), d, 0.f, h3.data(), ff);
    cblas_sgemm(RM, NT, T, n, d, ff, 1.f, gated.data(), ff, w2.data(), ff, 0.f, out_b.data(), d);
  };
  auto base_bwd = [&] {
    // linear_backward(dgated, dw2, dy, gated, w2, n, ff, d)
    cblas_sgemm(RM, NT, NT, n, ff, d, 1.f, dy.data(), d, w2.data(), ff, 1.f, dgated.data(), ff);
    cblas_sgemm(RM, T, NT, d, ff, n, 1.f, dy.data(), d, gated.data(), ff, 1.f, dw2_b.data(), ff);
    // linear_backward(dx, dw1, dh1, x, w1, n, d, ff) and the same for w3
    cblas_sgemm(RM, NT, NT, n, d, ff, 1.f, dh1.data(), ff, w1.data(), d, 1.f, dx_b.data(), d);
    cblas_sgemm(RM, T, NT, ff, d, n, 1.f, dh1.data(), ff, x.data(), d, 1.f, dw1_b.data(), d);
    cblas_sgemm(RM, NT, NT, n, d, ff, 1.f, dh3.data(), ff, w3.data(), d, 1.f, dx_b.data(), d);
    cblas_sgemm(RM, T, NT, ff, d, n, 1.f, dh3.data(), ff, x.data(), d, 1.f, dw3_b.data(), d);
  };
  auto base_fb = [&] {
    base_fwd();
    base_bwd();
  };
  auto ours_fwd = [&] { xd::swiglu_expert_forward(out.data(), &cache, x.data(), p, n, d, ff); };
  auto ours_fb = [&] {
    xd::swiglu_expert_forward(out.data(), &cache, x.data(), p, n, d, ff);
    xd::swiglu_expert_backward(dx.data(), dy.data(), x.data(), cache, p, n, d, ff);
  };

  Result r;
  r.s = s;
  r.fwd_gflop = 3.0 * 2.0 * n * (double)d * ff * 1e-9;
  r.fb_gflop = 9.0 * 2.0 * n * (double)d * ff * 1e-9;
  measure_pair(ours_fwd, base_fwd, o.reps, o.min_sample_ms, &r.ours_fwd, &r.base_fwd);
  measure_pair(ours_fb, base_fb, o.reps, o.min_sample_ms, &r.ours_fb, &r.base_fb);

  return r;
}

// First three fields of /proc/loadavg, "?" where it does not exist. A loaded
// machine shows up as medians far below the bests; interleaving keeps the ratio fair.
std::string loadavg() {
  FILE* f = std::fopen("/proc/loadavg", "r");
  if (!f) return "?";
  char buf[64] = {};
  double a = 0, b = 0, c = 0;
  const bool ok = std::fgets(buf, sizeof buf, f) && std::sscanf(buf, "%lf %lf %lf", &a, &b, &c) == 3;
  std::fclose(f);
  if (!ok) return "?";
  std::snprintf(buf, sizeof buf, "%.2f %.2f %.2f", a, b, c);
  return buf;
}

void print_header() {
  const char* cfg = openblas_get_config();
  const char* core = openblas_get_corename();
  const char* env = std::getenv("OPENBLAS_NUM_THREADS");
  std::printf("expert_gemm_bench: SwiGLU expert (model/swiglu_expert) vs bare cblas_sgemm\n");
  std::printf("OpenBLAS config : %s\n", cfg ? cfg : "?");
  std::printf("OpenBLAS core   : %s\n", core ? core : "?");
  std::printf("OpenBLAS threads: %d (OPENBLAS_NUM_THREADS=%s), procs %d\n",
              openblas_get_num_threads(), env ? env : "unset", openblas_get_num_procs());
  std::printf("load average    : %s (at start)\n", loadavg().c_str());
}

void print_table(const std::vector<Result>& rs, const Options& o) {
  std::printf(
      "\nGFLOP/s count GEMM FLOPs only (fwd 6*n*d*ff, fwd+bwd 18*n*d*ff); best/median of %d "
      "samples;\neff = sgemm time / expert time (target >= 80%%).\n\n",
      o.reps);
  std::printf("%5s %5s %5s | %-37s | %-37s\n", "", "", "",
              "(a) forward vs 3 sgemm", "(b) forward+backward vs 9 sgemm");
  std::printf("%5s %5s %5s | %8s %13s %13s | %8s %13s %13s | %s\n", "d", "ff", "n", "ours ms",
              "ours GF/s", "sgemm GF/s", "ours ms", "ours GF/s", "sgemm GF/s", "eff % (fwd, f+b)");
  std::printf("%5s %5s %5s | %8s %13s %13s | %8s %13s %13s | %s\n", "", "", "", "median",
              "best/med", "best/med", "median", "best/med", "best/med", "median [best]");
  std::printf("%.*s\n", 128,
              "-------------------------------------------------------------------------------"
              "-------------------------------------------------------------------------------");
  for (const Result& r : rs) {
    char a1[32], a2[32], b1[32], b2[32];
    std::snprintf(a1, sizeof a1, "%.1f/%.1f", gflops(r.fwd_gflop, r.ours_fwd.best),
                  gflops(r.fwd_gflop, r.ours_fwd.median));
    std::snprintf(a2, sizeof a2, "%.1f/%.1f", gflops(r.fwd_gflop, r.base_fwd.best),
                  gflops(r.fwd_gflop, r.base_fwd.median));
    std::snprintf(b1, sizeof b1, "%.1f/%.1f", gflops(r.fb_gflop, r.ours_fb.best),
                  gflops(r.fb_gflop, r.ours_fb.median));
    std::snprintf(b2, sizeof b2, "%.1f/%.1f", gflops(r.fb_gflop, r.base_fb.best),
                  gflops(r.fb_gflop, r.base_fb.median));
    const double ef = pct(r.base_fwd.median, r.ours_fwd.median);
    const double eb = pct(r.base_fb.median, r.ours_fb.median);
    std::printf("%5d %5d %5d | %8.3f %13s %13s | %8.3f %13s %13s | %5.1f %5.1f [%.1f %.1f]%s\n",
                r.s.d, r.s.ff, r.s.n, r.ours_fwd.median, a1, a2, r.ours_fb.median, b1, b2, ef, eb,
                pct(r.base_fwd.best, r.ours_fwd.best), pct(r.base_fb.best, r.ours_fb.best),
                (ef < 80.0 || eb < 80.0) ? "  <80%" : "");
  }
}

void print_breakdown(const std::vector<Result>& rs) {
  std::printf(
      "\nWhere the time goes (medians, ms per call). bwd = (f+b) - fwd. overhead = expert - sgemm\n"
      "on the same GEMMs: the non-GEMM work (gate, copies, allocation); ns/el = overhead per\n"
      "element of the (n, ff) activations. ovh %% = (fwd + bwd overhead) / expert f+b.\n");
  std::printf("%5s %5s %5s | %9s %9s %9s %7s | %9s %9s %9s %7s | %6s\n", "d", "ff", "n",
              "fwd sgemm", "expert", "overhead", "ns/el", "bwd sgemm", "expert", "overhead",
              "ns/el", "ovh %");
  std::printf("%.*s\n", 104,
              "-------------------------------------------------------------------------------"
              "-------------------------------------------------------------------------------");
  for (const Result& r : rs) {
    const double bs = r.base_fb.median - r.base_fwd.median, bo = r.ours_fb.median - r.ours_fwd.median;
    const double fo = r.fwd_overhead(), bw = r.bwd_overhead();
    std::printf("%5d %5d %5d | %9.3f %9.3f %9.3f %7.2f | %9.3f %9.3f %9.3f %7.2f | %5.1f%%\n",
                r.s.d, r.s.ff, r.s.n, r.base_fwd.median, r.ours_fwd.median, fo,
                r.ns_per_elem(fo), bs, bo, bw, r.ns_per_elem(bw),
                r.ours_fb.median > 0 ? 100.0 * (fo + bw) / r.ours_fb.median : 0.0);
  }
}

bool write_csv(FILE* f, const std::vector<Result>& rs) {
  std::fprintf(f,
               "d,ff,n,openblas_threads,fwd_gflop,fb_gflop,"
               "ours_fwd_best_ms,ours_fwd_median_ms,sgemm_fwd_best_ms,sgemm_fwd_median_ms,"
               "ours_fwd_median_gflops,sgemm_fwd_median_gflops,fwd_eff_median_pct,fwd_eff_best_pct,"
               "ours_fb_best_ms,ours_fb_median_ms,sgemm_fb_best_ms,sgemm_fb_median_ms,"
               "ours_fb_median_gflops,sgemm_fb_median_gflops,fb_eff_median_pct,fb_eff_best_pct,"
               "fwd_overhead_ms,bwd_overhead_ms,fwd_overhead_ns_per_elem,bwd_overhead_ns_per_elem\n");
  const int th = openblas_get_num_threads();
  for (const Result& r : rs) {
    std::fprintf(f, "%d,%d,%d,%d,%.6f,%.6f,", r.s.d, r.s.ff, r.s.n, th, r.fwd_gflop, r.fb_gflop);
    std::fprintf(f, "%.6f,%.6f,%.6f,%.6f,%.3f,%.3f,%.2f,%.2f,", r.ours_fwd.best,
                 r.ours_fwd.median, r.base_fwd.best, r.base_fwd.median,
                 gflops(r.fwd_gflop, r.ours_fwd.median), gflops(r.fwd_gflop, r.base_fwd.median),
                 pct(r.base_fwd.median, r.ours_fwd.median), pct(r.base_fwd.best, r.ours_fwd.best));
    std::fprintf(f, "%.6f,%.6f,%.6f,%.6f,%.3f,%.3f,%.2f,%.2f,", r.ours_fb.best, r.ours_fb.median,
                 r.base_fb.best, r.base_fb.median, gflops(r.fb_gflop, r.ours_fb.median),
                 gflops(r.fb_gflop, r.base_fb.median), pct(r.base_fb.median, r.ours_fb.median),
                 pct(r.base_fb.best, r.ours_fb.best));
    std::fprintf(f, "%.6f,%.6f,%.4f,%.4f\n", r.fwd_overhead(), r.bwd_overhead(),
                 r.ns_per_elem(r.fwd_overhead()), r.ns_per_elem(r.bwd_overhead()));
  }
  return std::fclose(f) == 0;
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse_args(argc, argv);
  std::vector<Shape> shapes;
  for (int n : o.ns) shapes.push_back({o.d, o.ff, n});
  if (o.realistic)
    for (int n : {256, 1024}) shapes.push_back({512, 1024, n});

  FILE* csv = nullptr;  // opened up front so a bad path fails before the long run
  if (!o.csv.empty() && !(csv = std::fopen(o.csv.c_str(), "w"))) {
    std::fprintf(stderr, "expert_gemm_bench: cannot open CSV file '%s': %s\n", o.csv.c_str(),
                 std::strerror(errno));
    return 2;
  }
  print_header();
  std::fflush(stdout);
  std::vector<Result> results;
  for (const Shape& s : shapes) {
    std::fprintf(stderr, "  running d=%d ff=%d n=%d ...\n", s.d, s.ff, s.n);
    results.push_back(run_shape(s, o));
  }
  print_table(results, o);
  if (o.breakdown) print_breakdown(results);
  std::printf("\nload average    : %s (at end)\n", loadavg().c_str());
  if (csv) {
    if (!write_csv(csv, results)) {
      std::fprintf(stderr, "expert_gemm_bench: cannot write CSV to '%s': %s\n", o.csv.c_str(),
                   std::strerror(errno));
      return 1;
    }
    std::printf("\nCSV written to %s\n", o.csv.c_str());
  }
  return 0;
}
