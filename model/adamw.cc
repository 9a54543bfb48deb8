#include "model/adamw.h"

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "common/check.h"
#include "model/detail/adamw_kernel.h"

namespace xd {

template <typename T>
AdamW<T>::AdamW(size_t n, AdamWConfig config, std::vector<std::pair<size_t, size_t>> no_decay)
    : config_(config), m_(n, T(0)), v_(n, T(0)) {
  std::vector<unsigned char> decay(n, 1);
  for (auto [b, e] : no_decay) {
    XD_CHECK(b <= e && e <= n);
    for (size_t i = b; i < e; ++i) decay[i] = 0;
  }
  for (size_t i = 0; i < n; ++i)
    if (runs_.empty() || runs_.back().decay != (decay[i] != 0)) runs_.push_back({i + 1, decay[i] != 0});
    else runs_.back().end = i + 1;
}

template <typename T>
double AdamW<T>::step(T* params, T* grads, double lr, double grad_norm_sq,
                      const std::function<void(size_t, size_t)>& after_block) {
  const size_t n = m_.size();
  if (grad_norm_sq < 0) {
    grad_norm_sq = 0;
    for (size_t i = 0; i < n; ++i) grad_norm_sq += (double)grads[i] * grads[i];
  }
  const double norm = std::sqrt(grad_norm_sq);
  const double clip = (config_.grad_clip > 0 && norm > config_.grad_clip) ? config_.grad_clip / norm : 1.0;
  ++step_count_;
  const double b1 = config_.beta1, b2 = config_.beta2;
  const double c1 = 1.0 - std::pow(b1, (double)step_count_);
  const double c2 = 1.0 - std::pow(b2, (double)step_count_);
  detail::AdamWFloatStep fs;  // the float path's constants
  fs.clip = static_cast<float>(clip);
  fs.beta1 = static_cast<float>(b1);
  fs.one_minus_beta1 = static_cast<float>(1 - b1);
  fs.beta2 = static_cast<float>(b2);
  fs.one_minus_beta2 = static_cast<float>(1 - b2);
  fs.decay_factor = static_cast<float>(1 - lr * config_.weight_decay);
  fs.step_size = static_cast<float>(lr / c1);
  fs.inv_sqrt_c2 = static_cast<float>(1 / std::sqrt(c2));
  fs.eps = static_cast<float>(config_.eps);
  // Elements [at, stop) share their weight decay.
  auto update = [&](size_t at, size_t stop, bool decay) {
    if constexpr (std::is_same_v<T, float>) {
      // SIMD lanes in float (model/detail/adamw_kernel.h).
      detail::adamw_float_span(params + at, grads + at, m_.data() + at, v_.data() + at, stop - at, decay, fs);
    } else {
      // The reference: every element in double.
      for (size_t i = at; i < stop; ++i) {
        const double g = grads[i] * clip;
        grads[i] = static_cast<T>(g);
        const double m = b1 * m_[i] + (1 - b1) * g;
        const double v = b2 * v_[i] + (1 - b2) * g * g;
        m_[i] = static_cast<T>(m);
        v_[i] = static_cast<T>(v);
        double p = params[i];
        if (decay) p -= lr * config_.weight_decay * p;
        p -= lr * (m / c1) / (std::sqrt(v / c2) + config_.eps);
        params[i] = static_cast<T>(p);
      }
    }
  };
  size_t run = 0;  // the decay run that holds the next element
  for (size_t block = 0; block < n; block += kBlock) {
    const size_t end = std::min(n, block + kBlock);
    for (size_t at = block; at < end;) {
      while (runs_[run].end <= at) ++run;
      const size_t stop = std::min(end, runs_[run].end);
      update(at, stop, runs_[run].decay);
      at = stop;
    }
    if (after_block) after_block(block, end);
  }
  return norm;
}

template class AdamW<float>;
template class AdamW<double>;

}  // namespace xd
