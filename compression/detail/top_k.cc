#include "compression/detail/top_k.h"

#include <algorithm>
#include <bit>
#include <functional>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

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

// Writes to out, ascending, the indices i < n with magnitude_key(x[i]) >=
// bound, and returns how many; out has room for n + 4. Branch-free: about
// one element in 8 to 60 passes, so a branch would mispredict.
size_t indices_at_least(const float* x, size_t n, uint32_t bound, uint32_t* out) {
  size_t i = 0, found = 0;
#if defined(__SSE2__)
  if (bound > 0) {
    // Four keys at a time: the mask of those that pass picks, from a table,
    // their lane numbers packed to the front; base + lanes is one store.
    struct Lanes {
      alignas(16) uint32_t of[16][4];
      uint8_t count[16];  // a table, not std::popcount: x86-64's baseline has no popcnt
      constexpr Lanes() : of(), count() {
        for (int m = 0; m < 16; ++m)
          for (int k = 0; k < 4; ++k)
            if ((m >> k) & 1) of[m][count[m]++] = static_cast<uint32_t>(k);
      }
    };
    static constexpr Lanes kLanes;
    const __m128i magnitude = _mm_set1_epi32(0x7fffffff);
    const __m128i below = _mm_set1_epi32(static_cast<int>(bound - 1));  // keys < 2^31: a signed compare is exact
    for (; i + 4 <= n; i += 4) {
      const __m128i key = _mm_and_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i)), magnitude);
      const int mask = _mm_movemask_ps(_mm_castsi128_ps(_mm_cmpgt_epi32(key, below)));
      const __m128i lanes = _mm_load_si128(reinterpret_cast<const __m128i*>(kLanes.of[mask]));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + found),
                       _mm_add_epi32(_mm_set1_epi32(static_cast<int>(i)), lanes));
      found += kLanes.count[mask];
    }
  }
#endif
  for (; i < n; ++i) {
    out[found] = static_cast<uint32_t>(i);
    found += magnitude_key(x[i]) >= bound;
  }
  return found;
}

// The k-th largest of `keys` (31-bit magnitude keys; 1 <= k <= size): a
// histogram of their top 12 bits (16 bins an octave) finds the key's bin,
// then an nth_element among that bin's keys alone, a few percent of them.
uint32_t kth_largest(const std::vector<uint32_t>& keys, size_t k, std::vector<uint32_t>* histogram,
                     std::vector<uint32_t>* in_bin) {
  constexpr int kShift = 19;
  histogram->assign(size_t{1} << (31 - kShift), 0);
  uint32_t* h = histogram->data();
  for (uint32_t key : keys) ++h[key >> kShift];
  size_t above = 0;
  uint32_t bin = (1u << (31 - kShift)) - 1;
  for (;; --bin) {
    if (above + h[bin] >= k) break;
    above += h[bin];
  }
  // Branch-free: every key is written, the cursor moves past the bin's only.
  in_bin->resize(keys.size());
  uint32_t* out = in_bin->data();
  size_t found = 0;
  for (uint32_t key : keys) {
    out[found] = key;
    found += (key >> kShift) == bin;
  }
  const size_t rank = k - above - 1;  // 0-based, descending, within the bin
  std::nth_element(out, out + rank, out + found, std::greater<uint32_t>());
  return out[rank];
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
    const uint32_t bound = kth_largest(sample_, rank + 1, &histogram_, &bin_);
    // The buffer only grows, so no pass re-fills it; 4 more for the last
    // group's whole-vector store.
    if (candidates_.size() < n + 4) candidates_.resize(n + 4);
    uint32_t* out = candidates_.data();
    const size_t found = indices_at_least(x, n, bound, out);
    if (found >= k) {
      keys_.resize(found);
      for (size_t c = 0; c < found; ++c) keys_[c] = magnitude_key(x[out[c]]);
      const uint32_t threshold = kth_largest(keys_, k, &histogram_, &bin_);
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
