#include "model/detail/thin_gemm.h"

#include <cstdlib>
#include <string>

#include "common/check.h"
#include "model/detail/vector_exp.h"

#ifdef XD_VECTOR_AVX2
#include <immintrin.h>
#endif

// Every loop over a tile's rows must unroll, or the accumulators live in
// memory instead of registers (a third of the speed).
#if defined(__clang__)
#define XD_UNROLL _Pragma("unroll")
#else
#define XD_UNROLL _Pragma("GCC unroll 8")
#endif

namespace xd::detail {

#ifdef XD_VECTOR_AVX2
namespace {

constexpr int kTileRows = 6;   // MR: 6 x 2 accumulators, 2 of B, 1 of A: 15 of 16 registers
constexpr int kTileCols = 16;  // NR: two 8-lane registers

#define XD_AVX2_INLINE __attribute__((target("avx2,fma"), always_inline)) inline

// 8 floats at p, or only the lanes `mask` sets (the others read as 0, and no
// memory behind them is touched).
template <bool kMasked>
XD_AVX2_INLINE __m256 load_lanes(const float* p, const __m256i& mask) {
  return kMasked ? _mm256_maskload_ps(p, mask) : _mm256_loadu_ps(p);
}

// out = alpha * acc + beta * out on 8 lanes, or only those `mask` sets; out
// is read only when beta is not 0.
template <bool kMasked>
XD_AVX2_INLINE void finish_lanes(float* out, const __m256i& mask, const __m256& acc,
                                 const __m256& alpha, float beta) {
  __m256 v = _mm256_mul_ps(acc, alpha);
  if (beta != 0.0f) v = _mm256_fmadd_ps(_mm256_set1_ps(beta), load_lanes<kMasked>(out, mask), v);
  if (kMasked)
    _mm256_maskstore_ps(out, mask, v);
  else
    _mm256_storeu_ps(out, v);
}

// C[0:R, 0:kLanes) = alpha * A[0:R, 0:k) * B[0:k, 0:kLanes) + beta * C, in
// one 8-lane register per row (kLanes 8) or two (16). With kMasked, the last
// register keeps only the lanes `mask` sets: there a lane of B reads as 0,
// and a lane of C is neither read nor written. No address past the tile's
// columns is formed (AMD leaves faults on masked-off lanes to the
// implementation).
template <int R, int kLanes, bool kMasked>
__attribute__((target("avx2,fma"))) inline void tile(int k, const float* a, long lda,
                                                     const float* b, long ldb, float* c,
                                                     long ldc, float alpha, float beta,
                                                     const __m256i& mask) {
  static_assert(kLanes == 8 || kLanes == 16, "a tile is one or two 8-lane registers wide");
  constexpr bool kHigh = kLanes == 16;
  constexpr bool kLowMasked = kMasked && !kHigh;  // the last register is the only one
  __m256 acc_low[R], acc_high[R];
  XD_UNROLL
  for (int r = 0; r < R; ++r) acc_low[r] = acc_high[r] = _mm256_setzero_ps();
  for (int p = 0; p < k; ++p) {
    const float* row = b + p * ldb;
    const __m256 b_low = load_lanes<kLowMasked>(row, mask);
    const __m256 b_high = kHigh ? load_lanes<kMasked>(row + 8, mask) : _mm256_setzero_ps();
    XD_UNROLL
    for (int r = 0; r < R; ++r) {
      const __m256 a_rp = _mm256_broadcast_ss(a + r * lda + p);
      acc_low[r] = _mm256_fmadd_ps(a_rp, b_low, acc_low[r]);
      if (kHigh) acc_high[r] = _mm256_fmadd_ps(a_rp, b_high, acc_high[r]);
    }
  }
  const __m256 alpha_v = _mm256_set1_ps(alpha);
  XD_UNROLL
  for (int r = 0; r < R; ++r) {
    finish_lanes<kLowMasked>(c + r * ldc, mask, acc_low[r], alpha_v, beta);
    if (kHigh) finish_lanes<kMasked>(c + r * ldc + 8, mask, acc_high[r], alpha_v, beta);
  }
}

// One block of R rows of C across every column: 16-column tiles, then the
// tail (1-15 columns) in the narrowest tile that holds it.
template <int R>
__attribute__((target("avx2,fma"))) void row_block(int n, int k, float alpha, const float* a,
                                                   long lda, const float* b, long ldb, float beta,
                                                   float* c, long ldc) {
  const __m256i none = _mm256_setzero_si256();
  int j = 0;
  for (; j + kTileCols <= n; j += kTileCols)
    tile<R, 16, false>(k, a, lda, b + j, ldb, c + j, ldc, alpha, beta, none);
  const int left = n - j;
  if (left == 0) return;
  if (left == 8) {
    tile<R, 8, false>(k, a, lda, b + j, ldb, c + j, ldc, alpha, beta, none);
    return;
  }
  // The last register keeps lane i where i < its share of the tail: a set sign bit.
  const int in_last = left > 8 ? left - 8 : left;
  const __m256i mask =
      _mm256_cmpgt_epi32(_mm256_set1_epi32(in_last), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  if (left > 8)
    tile<R, 16, true>(k, a, lda, b + j, ldb, c + j, ldc, alpha, beta, mask);
  else
    tile<R, 8, true>(k, a, lda, b + j, ldb, c + j, ldc, alpha, beta, mask);
}

__attribute__((target("avx2,fma"))) void thin_gemm_avx2(int m, int n, int k, float alpha,
                                                        const float* a, long lda, const float* b,
                                                        long ldb, float beta, float* c, long ldc) {
  int i = 0;
  for (; i + kTileRows <= m; i += kTileRows)
    row_block<kTileRows>(n, k, alpha, a + i * lda, lda, b, ldb, beta, c + i * ldc, ldc);
  const float* a_rest = a + i * lda;
  float* c_rest = c + i * ldc;
  switch (m - i) {
    case 0: break;
    case 1: row_block<1>(n, k, alpha, a_rest, lda, b, ldb, beta, c_rest, ldc); break;
    case 2: row_block<2>(n, k, alpha, a_rest, lda, b, ldb, beta, c_rest, ldc); break;
    case 3: row_block<3>(n, k, alpha, a_rest, lda, b, ldb, beta, c_rest, ldc); break;
    case 4: row_block<4>(n, k, alpha, a_rest, lda, b, ldb, beta, c_rest, ldc); break;
    case 5: row_block<5>(n, k, alpha, a_rest, lda, b, ldb, beta, c_rest, ldc); break;
    default: XD_CHECK(false);
  }
}

bool decide_available() {
  if (const char* forced = std::getenv("XDMOE_THIN_GEMM"); forced && std::string(forced) == "0")
    return false;
  return have_avx2_fma();
}

}  // namespace

bool thin_gemm_available() {
  static const bool yes = decide_available();
  return yes;
}

void thin_gemm(int m, int n, int k, float alpha, const float* a, int lda, const float* b, int ldb,
               float beta, float* c, int ldc) {
  XD_CHECK(thin_gemm_available());
  XD_CHECK(m >= 0 && n >= 0 && k >= 0 && lda >= k && ldb >= n && ldc >= n);
  if (alpha == 0.0f) {
    // As in BLAS, A and B are not read (a NaN there does not reach C).
    for (int i = 0; i < m; ++i)
      for (int j = 0; j < n; ++j) {
        float& out = c[static_cast<long>(i) * ldc + j];
        out = beta == 0.0f ? 0.0f : beta * out;
      }
    return;
  }
  thin_gemm_avx2(m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

#else  // not x86: OpenBLAS takes every product

bool thin_gemm_available() { return false; }

void thin_gemm(int, int, int, float, const float*, int, const float*, int, float, float*, int) {
  XD_CHECK(false);
}

#endif

}  // namespace xd::detail
