// Finite-difference gradient checking for tests, in double precision.
#pragma once

#include <cmath>
#include <cstddef>
#include <functional>
#include <vector>

namespace xd::testing {

// Central differences of `loss` with respect to chosen entries of `x`, against
// the analytic gradient `grad`. Returns ||num - ana|| / max(||num||, ||ana||)
// over the checked entries (a norm-wise relative error).
inline double gradient_relative_error(const std::function<double()>& loss, double* x,
                                      const double* grad, const std::vector<size_t>& entries,
                                      double step = 1e-5) {
  double diff2 = 0, num2 = 0, ana2 = 0;
  for (size_t i : entries) {
    const double saved = x[i];
    x[i] = saved + step;
    const double up = loss();
    x[i] = saved - step;
    const double down = loss();
    x[i] = saved;
    const double num = (up - down) / (2 * step);
    diff2 += (num - grad[i]) * (num - grad[i]);
    num2 += num * num;
    ana2 += grad[i] * grad[i];
  }
  const double denom = std::sqrt(std::max(num2, ana2));
  return denom == 0 ? 0.0 : std::sqrt(diff2) / denom;
}

inline std::vector<size_t> all_entries(size_t n) {
  std::vector<size_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = i;
  return v;
}

}  // namespace xd::testing
