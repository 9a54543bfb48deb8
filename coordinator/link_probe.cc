#include "coordinator/link_probe.h"

#include <algorithm>
#include <cmath>
#include <memory>

#include <cblas.h>

#include "common/check.h"
#include "common/clock.h"
#include "model/gemm.h"
#include "transport/transport.h"

namespace xd {

double upper_median(std::vector<double> values) {
  XD_CHECK(!values.empty());
  std::nth_element(values.begin(), values.begin() + values.size() / 2, values.end());
  return values[values.size() / 2];
}

LinearFit fit_line(std::vector<std::pair<double, double>> samples) {
  LinearFit f;
  f.samples = std::move(samples);
  const double k = static_cast<double>(f.samples.size());
  if (f.samples.empty()) return f;
  double mx = 0, my = 0;
  for (const auto& [x, y] : f.samples) {
    mx += x;
    my += y;
  }
  mx /= k;
  my /= k;
  double sxx = 0, sxy = 0, syy = 0;
  for (const auto& [x, y] : f.samples) {
    sxx += (x - mx) * (x - mx);
    sxy += (x - mx) * (y - my);
    syy += (y - my) * (y - my);
  }
  if (!(sxx > 0)) {
    f.alpha = my;
    return f;
  }
  f.beta = sxy / sxx;
  f.alpha = my - f.beta * mx;
  double sse = 0;
  for (const auto& [x, y] : f.samples) {
    const double e = y - (f.alpha + f.beta * x);
    sse += e * e;
  }
  f.r2 = syy > 0 ? 1.0 - sse / syy : 1.0;
  return f;
}

Expected<LinkFit> probe_link(const LinkShaping& shaping, const LinkProbeOptions& options) {
  if (options.sizes.empty() || options.repetitions < 1)
    return Status::invalid_argument("link probe: needs sizes and at least one repetition");

  // Sizes that fit the per-message limit on this link.
  std::vector<size_t> sizes = options.sizes;
  const double bw = shaping.bandwidth_bytes_per_s;
  if (bw > 0) {
    const double cap = options.max_message_s * bw;
    std::vector<size_t> kept;
    for (size_t s : sizes)
      if (double(s) <= cap) kept.push_back(s);
    if (kept.size() < 3) {
      const size_t top = std::max<size_t>(64, static_cast<size_t>(cap));
      kept = {std::max<size_t>(1, top / 64), std::max<size_t>(2, top / 8), top};
    }
    sizes = kept;
  }
  std::sort(sizes.begin(), sizes.end());
  sizes.erase(std::unique(sizes.begin(), sizes.end()), sizes.end());
  auto predicted = [&](size_t s) {
    return shaping.latency_s + (bw > 0 ? double(s) / bw : double(s) / 1e9) + 1e-3;
  };
  int reps = options.repetitions;
  for (;;) {
    double total = 0;
    for (size_t s : sizes) total += reps * predicted(s);
    if (total <= 0.8 * options.time_budget_s || reps == 1) break;
    --reps;
  }

  TransportOptions base;
  base.job = 0x50524F42u;  // "PROB"
  base.link_classes = {shaping};
  base.link_class_names = {"probe"};
  TransportOptions oa = base, ob = base;
  oa.rank = 0;
  ob.rank = 1;
  auto a = Transport::create(oa);
  if (!a) return a.status().with_context("link probe");
  auto b = Transport::create(ob);
  if (!b) return b.status().with_context("link probe");
  const std::vector<PeerInfo> peers = {{0, (*a)->endpoint(), 0}, {1, (*b)->endpoint(), 0}};
  XD_RETURN_IF_ERROR((*a)->connect(peers).with_context("link probe"));
  XD_RETURN_IF_ERROR((*b)->connect(peers).with_context("link probe"));

  auto buffer = std::make_shared<std::vector<char>>(sizes.back(), 'x');
  uint32_t seq = 0;
  auto send_one = [&](size_t bytes) -> Expected<double> {
    const Tag tag{MessageKind::kPointToPoint, seq++, kNoLayer, 0, 0};
    auto slot = (*b)->recv(0, tag);
    const double t0 = steady_seconds();
    (*a)->send(1, tag, {OutFrame{buffer->data(), bytes, buffer}});
    auto m = slot->wait(options.timeout);
    const double t1 = steady_seconds();
    if (!m) return m.status().with_context("link probe: message of " + std::to_string(bytes) + " bytes");
    if (m->payload_bytes() != bytes) return Status::internal("link probe: wrong payload size");
    return t1 - t0;
  };
  // Warm-up: the first messages pay for the connection set-up.
  for (int i = 0; i < 2; ++i) {
    auto w = send_one(sizes.front());
    if (!w) return w.status();
  }
  // Rounds over all sizes, keeping each size's fastest time: load on the
  // machine only ever delays a delivery, and a burst of it hits one round.
  std::vector<double> best(sizes.size(), 1e300), cpu(sizes.size(), 0.0);
  std::vector<int> sent(sizes.size(), 0);
  auto timed = [&](size_t i) -> Status {
    const double cpu0 = process_cpu_seconds();
    auto t = send_one(sizes[i]);
    if (!t) return t.status();
    cpu[i] += process_cpu_seconds() - cpu0;
    ++sent[i];
    best[i] = std::min(best[i], *t);
    return Status::ok();
  };
  for (int r = 0; r < reps; ++r)
    for (size_t i = 0; i < sizes.size(); ++i) XD_RETURN_IF_ERROR(timed(i));
  // The smallest messages' CPU time is mostly the fixed part per message,
  // a small and noisy figure: a batch of them steadies it. In the rounds
  // each follows the largest, whose last work (its release, the wait for
  // its acks) may fall in the small one's window; the batch follows one
  // untimed small message, and its median is the small size's figure (a
  // timer or another thread's wake-up landing in one message's window
  // leaves it).
  double cpu_small = cpu.front() / sent.front();
  if (options.extra_small_messages > 0) {
    auto w = send_one(sizes.front());
    if (!w) return w.status();
    std::vector<double> each;
    for (int extra = 0; extra < options.extra_small_messages; ++extra) {
      const double before = cpu.front();
      XD_RETURN_IF_ERROR(timed(0));
      each.push_back(cpu.front() - before);
    }
    cpu_small = upper_median(std::move(each));
  }
  std::vector<std::pair<double, double>> samples;
  for (size_t i = 0; i < sizes.size(); ++i) samples.emplace_back(double(sizes[i]), best[i]);
  LinkFit fit{fit_line(std::move(samples))};
  // The shaper sleeps while it paces: what the process spent is the two
  // transports' work, one send and one receive of each message. Its mean
  // per message of the smallest and of the largest size give the line.
  const double small = double(sizes.front()), large = double(sizes.back());
  cpu_small = std::max(0.0, cpu_small);
  const double cpu_large = std::max(0.0, cpu.back() / sent.back());
  fit.cpu_s_per_byte = large > small ? std::max(0.0, (cpu_large - cpu_small) / (large - small)) : cpu_large / large;
  fit.cpu_s_per_message = std::max(0.0, cpu_small - fit.cpu_s_per_byte * small);
  return fit;
}

LinearFit probe_gemm(const GemmProbeOptions& options) {
  struct Shape {
    int m, n, k;
    std::vector<float> a, b, c;
    int reps = 1;
    double best = 1e300;
    void call() {
      gemm<float>(false, true, m, n, k, 1.0f, a.data(), k, b.data(), k, 0.0f, c.data(), n);
    }
  };
  // Workers run with one OpenBLAS thread each; so does the probe, by default.
  const int saved_threads = openblas_get_num_threads();
  if (options.threads > 0) openblas_set_num_threads(options.threads);
  std::vector<Shape> shapes;
  for (const auto& dims : options.shapes) {
    XD_CHECK(dims.size() == 3 && dims[0] > 0 && dims[1] > 0 && dims[2] > 0);
    Shape s{dims[0], dims[1], dims[2], {}, {}, {}};
    s.a.resize(size_t(s.m) * s.k);
    s.b.resize(size_t(s.n) * s.k);
    s.c.resize(size_t(s.m) * s.n);
    for (size_t i = 0; i < s.a.size(); ++i) s.a[i] = float((i * 7 + 3) % 13) / 13.0f - 0.5f;
    for (size_t i = 0; i < s.b.size(); ++i) s.b[i] = float((i * 5 + 1) % 11) / 11.0f - 0.5f;
    s.call();  // warm-up
    const double t0 = steady_seconds();
    s.call();
    const double once = std::max(1e-7, steady_seconds() - t0);
    const int rounds = std::max(1, options.samples_per_shape);
    s.reps = std::max(1, static_cast<int>(options.min_seconds_per_shape / rounds / once));
    shapes.push_back(std::move(s));
  }
  // Rounds over all shapes, keeping each shape's fastest timing: other load
  // on the machine only slows a run down, and a burst of it hits one round of
  // every shape rather than every round of one shape. A noisy fit earns more
  // rounds while the time budget lasts.
  const double start = steady_seconds();
  auto fit = [&] {
    std::vector<std::pair<double, double>> samples;
    for (const Shape& s : shapes) samples.emplace_back(2.0 * s.m * s.n * s.k, s.best);
    return fit_line(std::move(samples));
  };
  for (int round = 0;; ++round) {
    for (Shape& s : shapes) {
      const double t0 = steady_seconds();
      for (int r = 0; r < s.reps; ++r) s.call();
      s.best = std::min(s.best, (steady_seconds() - t0) / s.reps);
    }
    if (round + 1 < std::max(1, options.samples_per_shape)) continue;
    if (steady_seconds() - start > options.max_seconds || fit().r2 >= options.good_r2) break;
  }
  if (options.threads > 0) openblas_set_num_threads(saved_threads);
  return fit();
}

}  // namespace xd
