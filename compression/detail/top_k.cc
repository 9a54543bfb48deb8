#include "compression/detail/top_k.h"

#include <algorithm>
#include <bit>
#include <functional>

namespace xd::detail {

namespace {

inline uint32_t magnitude_key(float f) { return std::bit_cast<uint32_t>(f) & 0x7fffffffu; }

// Takes every index whose key is above `threshold` and, at the threshold, the
// lowest `ties` of them, scanning `candidates` (ascending indices) in order.
void take(const float* x, const uint32_t* candidates, size_t count, uint32_t threshold, size_t ties,
          std::vector<uint32_t>* indices) {
  for (size_t c = 0; c < count; ++c) {
    const uint32_t i = candidates[c];
    const uint32_t key = magnitude_key(x[i]);
    if (key > threshold || (key == threshold && ties > 0)) {
      if (key == threshold) --ties;
      indices->push_back(i);
    }
  }
}

}  // namespace

void TopKSelector::select(const float* x, size_t n, size_t k, std::vector<uint32_t>* indices) {
  indices->clear();
  if (k == 0 || n == 0) return;
  if (k >= n) {
    indices->resize(n);
    for (size_t i = 0; i < n; ++i) (*indices)[i] = static_cast<uint32_t>(i);
    return;
  }
  indices->reserve(k);
  // Fast path for a small k of a large tensor: estimate from a strided
  // sample a key that about 1.5 k + 64 elements exceed, collect those in one
  // pass, and select exactly among them. If fewer than k pass the estimate,
  // fall through to the exact radix select.
  if (n >= 16384 && k <= n / 8) {
    constexpr size_t kSample = 4096;
    const size_t stride = n / kSample;
    sample_.clear();
    for (size_t s = 0; s < kSample; ++s) sample_.push_back(magnitude_key(x[s * stride]));
    const double want = std::min<double>(kSample - 1, (1.5 * double(k) + 64.0) * kSample / double(n));
    const size_t rank = static_cast<size_t>(want);
    std::nth_element(sample_.begin(), sample_.begin() + rank, sample_.end(), std::greater<uint32_t>());
    const uint32_t bound = sample_[rank];
    // Branch-free: every index is written, and the cursor moves past it only
    // when it passes (about one in 8 to 60 does: a branch would mispredict).
    // The buffer only grows, so no pass re-fills it.
    if (candidates_.size() < n) candidates_.resize(n);
    uint32_t* out = candidates_.data();
    size_t found = 0;
    for (size_t i = 0; i < n; ++i) {
      out[found] = static_cast<uint32_t>(i);
      found += magnitude_key(x[i]) >= bound;
    }
    if (found >= k) {
      keys_.resize(found);
      for (size_t c = 0; c < found; ++c) keys_[c] = magnitude_key(x[out[c]]);
      std::nth_element(keys_.begin(), keys_.begin() + (k - 1), keys_.end(), std::greater<uint32_t>());
      const uint32_t threshold = keys_[k - 1];
      size_t above = 0;
      for (uint32_t key : keys_) above += key > threshold;
      take(x, out, found, threshold, k - above, indices);
      return;
    }
  }
  // Exact radix select on the 31 magnitude bits, 16 then 15 at a time.
  histogram_.assign(1 << 16, 0);
  for (size_t i = 0; i < n; ++i) ++histogram_[magnitude_key(x[i]) >> 16];
  size_t above = 0;  // elements in bins above the threshold's bin
  uint32_t high = 0xffff;
  for (;; --high) {
    if (above + histogram_[high] >= k) break;
    above += histogram_[high];
  }
  histogram_.assign(1 << 16, 0);
  for (size_t i = 0; i < n; ++i) {
    const uint32_t key = magnitude_key(x[i]);
    if ((key >> 16) == high) ++histogram_[key & 0xffff];
  }
  uint32_t low = 0xffff;
  for (;; --low) {
    if (above + histogram_[low] >= k) break;
    above += histogram_[low];
  }
  const uint32_t threshold = (high << 16) | low;
  size_t ties = k - above;
  for (size_t i = 0; i < n; ++i) {
    const uint32_t key = magnitude_key(x[i]);
    if (key > threshold || (key == threshold && ties > 0)) {
      if (key == threshold) --ties;
      indices->push_back(static_cast<uint32_t>(i));
    }
  }
}

}  // namespace xd::detail
