// Link and GEMM probes: fit the planner's alpha-beta models (FSMoE Eq. 1,
// t = alpha + n * beta) by least squares from short timed micro-benchmarks.
//   * probe_link: messages of a few sizes between two in-process Transports
//     over loopback, the link shaped like one link class; n is bytes.
//   * probe_gemm: cblas_sgemm (through model/gemm.h) of a few shapes; n is flops,
//     so 1 / beta is the GEMM rate and alpha the per-call overhead. It sets
//     OpenBLAS's thread count for its duration (not thread-safe against other
//     GEMMs of this process running meanwhile).
// probe_link aims at its time budget (3 s by default) by lowering repetitions,
// down to one; probe_gemm stops after the round in which it passes
// max_seconds (1 s) or reaches good_r2. The fit is reported as measured
// (alpha may come out slightly negative from noise).
#pragma once

#include <chrono>
#include <cstddef>
#include <utility>
#include <vector>

#include "common/status.h"
#include "transport/link_shaping.h"

namespace xd {

struct LinearFit {
  double alpha = 0;  // intercept: seconds
  double beta = 0;   // slope: seconds per unit (byte or flop)
  double r2 = 0;     // coefficient of determination of the fit
  std::vector<std::pair<double, double>> samples;  // (n, seconds) that were fitted
};

// Ordinary least squares of seconds on n. Fewer than two distinct n: beta = 0,
// alpha = the mean, r2 = 0.
LinearFit fit_line(std::vector<std::pair<double, double>> samples);
// The upper median of a few timings (the step probe's and this probe's);
// `values` must not be empty.
double upper_median(std::vector<double> values);

struct LinkProbeOptions {
  std::vector<size_t> sizes = {1 << 10, 64 << 10, 512 << 10, 2 << 20};
  int repetitions = 3;  // rounds over the sizes; each size's fastest time is fitted
  // A shaped size predicted to take longer than this is replaced by smaller
  // ones (at least three sizes stay), and repetitions drop to fit the budget.
  double max_message_s = 0.4;
  double time_budget_s = 3.0;
  int extra_small_messages = 8;  // a batch of the smallest size, for the CPU time per message
  std::chrono::milliseconds timeout{20000};  // per message
};

// The fit of a link probe, and the CPU time the process spent on a message
// (the sender's and the receiver's transport together: what a worker that
// sends and receives as much pays per message sent), as a line: a fixed part
// per message (the threads' wake-ups and hand-offs, which dominate small
// messages) and a part per byte (the copies), fitted between the smallest
// and the largest size.
struct LinkFit : LinearFit {
  double cpu_s_per_message = 0;
  double cpu_s_per_byte = 0;
};

Expected<LinkFit> probe_link(const LinkShaping& shaping, const LinkProbeOptions& options = {});

struct GemmProbeOptions {
  // (m, n, k) of C(m, n) = A(m, k) B(n, k)^T, the shape of our linear layers.
  std::vector<std::vector<int>> shapes = {
      {64, 64, 64}, {128, 128, 128}, {256, 128, 256}, {256, 256, 256}, {512, 256, 256}};
  double min_seconds_per_shape = 0.05;  // time spent on each shape, all rounds
  int samples_per_shape = 5;            // rounds over all shapes; each shape's fastest is fitted
  // More rounds follow while the fit's r2 is below good_r2, until max_seconds.
  double good_r2 = 0.99;
  double max_seconds = 1.0;
  // OpenBLAS threads while probing (restored after); 0 keeps the process's
  // setting. Workers run with OPENBLAS_NUM_THREADS=1, so 1 gives their rate.
  int threads = 1;
};

LinearFit probe_gemm(const GemmProbeOptions& options = {});

}  // namespace xd
