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

// C[0:R, 0:16) = alpha * A[0:R, 0:k) * B[0:k, 0:16) + beta * C, or only the
// columns whose lanes `low` and `high` keep (a masked lane of B reads as 0
// and is never touched in memory; a masked lane of C is neither read nor
// written).
template <int R, bool kMasked>
__attribute__((target("avx2,fma"))) inline void tile(int k, const float* a, long lda,
                                                     const float* b, long ldb, float* c,
                                                     long ldc, float alpha, float beta,
                                                     __m256i low, __m256i high) {
  __m256 acc_low[R], acc_high[R];
  XD_UNROLL
  for (int r = 0; r < R; ++r) {
    acc_low[r] = _mm256_setzero_ps();
    acc_high[r] = _mm256_setzero_ps();
  }
  for (int p = 0; p < k; ++p) {
    const float* row = b + p * ldb;
    const __m256 b_low = kMasked ? _mm256_maskload_ps(row, low) : _mm256_loadu_ps(row);
    const __m256 b_high = kMasked ? _mm256_maskload_ps(row + 8, high) : _mm256_loadu_ps(row + 8);
    XD_UNROLL
    for (int r = 0; r < R; ++r) {
      const __m256 a_rp = _mm256_broadcast_ss(a + r * lda + p);
      acc_low[r] = _mm256_fmadd_ps(a_rp, b_low, acc_low[r]);
      acc_high[r] = _mm256_fmadd_ps(a_rp, b_high, acc_high[r]);
    }
  }
  const __m256 alpha_v = _mm256_set1_ps(alpha);
  const __m256 beta_v = _mm256_set1_ps(beta);
  XD_UNROLL
  for (int r = 0; r < R; ++r) {
    float* out = c + r * ldc;
    __m256 out_low = _mm256_mul_ps(acc_low[r], alpha_v);
    __m256 out_high = _mm256_mul_ps(acc_high[r], alpha_v);
    if (beta != 0.0f) {
      const __m256 c_low = kMasked ? _mm256_maskload_ps(out, low) : _mm256_loadu_ps(out);
      const __m256 c_high = kMasked ? _mm256_maskload_ps(out + 8, high) : _mm256_loadu_ps(out + 8);
      out_low = _mm256_fmadd_ps(beta_v, c_low, out_low);
      out_high = _mm256_fmadd_ps(beta_v, c_high, out_high);
    }
    if (kMasked) {
      _mm256_maskstore_ps(out, low, out_low);
      _mm256_maskstore_ps(out + 8, high, out_high);
    } else {
      _mm256_storeu_ps(out, out_low);
      _mm256_storeu_ps(out + 8, out_high);
    }
  }
}

// One block of R rows of C across every column.
template <int R>
__attribute__((target("avx2,fma"))) void row_block(int n, int k, float alpha, const float* a,
                                                   long lda, const float* b, long ldb, float beta,
                                                   float* c, long ldc) {
  const __m256i none = _mm256_setzero_si256();
  int j = 0;
  for (; j + kTileCols <= n; j += kTileCols)
    tile<R, false>(k, a, lda, b + j, ldb, c + j, ldc, alpha, beta, none, none);
  if (const int left = n - j) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    // Lane i is kept where i < left (low) or i + 8 < left (high): a set sign bit.
    const __m256i low = _mm256_cmpgt_epi32(_mm256_set1_epi32(left), lane);
    const __m256i high = _mm256_cmpgt_epi32(_mm256_set1_epi32(left - 8), lane);
    tile<R, true>(k, a, lda, b + j, ldb, c + j, ldc, alpha, beta, low, high);
  }
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
  thin_gemm_avx2(m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

#else  // not x86: OpenBLAS takes every product

bool thin_gemm_available() { return false; }

void thin_gemm(int, int, int, float, const float*, int, const float*, int, float, float*, int) {
  XD_CHECK(false);
}

#endif

}  // namespace xd::detail
