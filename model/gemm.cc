#include "model/gemm.h"

#include <cblas.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <string>
#include <vector>

#include "model/detail/thin_gemm.h"

namespace xd {

namespace {

void sgemm_call(bool ta, bool tb, int m, int n, int k, float alpha, const float* a, int lda,
                const float* b, int ldb, float beta, float* c, int ldc) {
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, m,
              n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

// OpenBLAS multiplies a product of at most 100^3 multiply-adds with its
// small-matrix kernels, which read the operands in place, and a larger one by
// packing both operands into panels first. The model's products are thin
// (64- to 128-wide weights against a few thousand rows), so the packing is a
// large share of their time. With op(B) untransposed, cutting such a product
// into row pieces under that size runs 14-25% faster on one core when B has
// at most 8192 entries (a 64 x 64 or 64 x 128 weight); from 128 x 128 on the
// pieces mostly lose, by up to 9%. With op(B) transposed the small kernel is slower than
// packing, but B is one weight matrix against many rows: transposing it
// first and taking the row pieces gains as much, under the same limit. A
// weight gradient (A^T B, a sum over rows) gains 5-45% in pieces up to a
// 256 x 128 C. Wider or deeper products go whole (bench/gemm_pieces_bench.cc
// measures each case against one call).
// Only the AVX-512 cores have the small-matrix kernels; on the others a piece
// is packed like a whole product and the pieces lose up to 29% (OpenBLAS's
// Haswell kernels on an AMD Zen 4 core), hence gemm_uses_pieces(). There,
// the thin products with op(A) untransposed go to our own AVX2 kernel
// instead (model/detail/thin_gemm.h), which packs nothing.
constexpr long kSmallProduct = 1000000;
constexpr long kMaxRowPieceOperand = 8192;   // n * k, op(B)'s entries, for row pieces
constexpr long kMaxSumPieceOperand = 32768;  // m * n, C's entries, for sum pieces
constexpr int kMaxWidthForRowPieces = 256;
constexpr int kMaxWidthToTranspose = 128;

int piece_count(long whole, long per_unit) {
  long units = std::max(1L, kSmallProduct / std::max(1L, per_unit));
  return static_cast<int>((whole + units - 1) / units);
}

// B is (n, k); op(B) = B^T is (k, n), written out row-major into this
// thread's buffer (valid until its next call on this thread).
const float* transposed(const float* b, int ldb, int n, int k) {
  thread_local std::vector<float> buffer;
  const long b_elements = static_cast<long>(n) * k;
  if (static_cast<long>(buffer.size()) < b_elements) buffer.resize(b_elements);
  float* bt = buffer.data();
  for (int j = 0; j < n; ++j) {
    const float* row = b + static_cast<long>(j) * ldb;
    for (int p = 0; p < k; ++p) bt[static_cast<long>(p) * n + j] = row[p];
  }
  return bt;
}

bool decide_pieces() {
  if (const char* forced = std::getenv("XDMOE_GEMM_PIECES")) {
    if (std::string(forced) == "0") return false;
    if (std::string(forced) == "1") return true;
  }
  const char* name = openblas_get_corename();
  std::string core = name ? name : "";
  for (char& ch : core) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  return core == "skylakex" || core == "cooperlake" || core == "sapphirerapids";
}

}  // namespace

bool gemm_uses_pieces() {
  static const bool pieces = decide_pieces();
  return pieces;
}

void gemm_in_pieces(bool ta, bool tb, int m, int n, int k, float alpha, const float* a, int lda,
                    const float* b, int ldb, float beta, float* c, int ldc) {
  if (m == 0 || n == 0) return;
  const long product = static_cast<long>(m) * n * k;
  const long b_elements = static_cast<long>(n) * k;
  const bool rows_fit = n <= kMaxWidthForRowPieces && b_elements <= kMaxRowPieceOperand;
  if (product <= kSmallProduct || (ta && tb)) {
    sgemm_call(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  } else if (tb) {
    if (!rows_fit || n > kMaxWidthToTranspose) {
      sgemm_call(false, true, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
      return;
    }
    gemm_in_pieces(false, false, m, n, k, alpha, a, lda, transposed(b, ldb, n, k), n, beta, c,
                   ldc);
  } else if (!ta) {
    if (!rows_fit) {
      sgemm_call(false, false, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
      return;
    }
    // Rows of C are independent: split them evenly, each piece its own product.
    const int pieces = piece_count(m, b_elements);
    const int rows = (m + pieces - 1) / pieces;
    for (int i = 0; i < m; i += rows)
      sgemm_call(false, false, std::min(rows, m - i), n, k, alpha, a + static_cast<long>(i) * lda,
                 lda, b, ldb, beta, c + static_cast<long>(i) * ldc, ldc);
  } else {
    const long c_elements = static_cast<long>(m) * n;
    if (c_elements > kMaxSumPieceOperand) {
      sgemm_call(true, false, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
      return;
    }
    // C = A^T B sums over the rows of A and B (a weight gradient over tokens):
    // split that sum, the first piece scaling C by beta and the rest adding on.
    const int pieces = piece_count(k, c_elements);
    const int span = (k + pieces - 1) / pieces;
    for (int p = 0; p < k; p += span)
      sgemm_call(true, false, m, n, std::min(span, k - p), alpha, a + static_cast<long>(p) * lda,
                 lda, b + static_cast<long>(p) * ldb, ldb, p == 0 ? beta : 1.0f, c, ldc);
  }
}

bool gemm_uses_thin_kernel(bool trans_a, int n, int k) {
  return !trans_a && !gemm_uses_pieces() && n >= detail::kThinGemmMinColumns &&
         static_cast<long>(n) * k <= detail::kThinGemmMaxB && detail::thin_gemm_available();
}

template <>
void gemm<float>(bool ta, bool tb, int m, int n, int k, float alpha, const float* a, int lda,
                 const float* b, int ldb, float beta, float* c, int ldc) {
  if (gemm_uses_pieces()) {
    gemm_in_pieces(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    return;
  }
  if (m == 0 || n == 0) return;
  if (gemm_uses_thin_kernel(ta, n, k)) {
    // With op(B) transposed, one copy of a small weight against the m rows
    // that pass over it.
    if (tb)
      detail::thin_gemm(m, n, k, alpha, a, lda, transposed(b, ldb, n, k), n, beta, c, ldc);
    else
      detail::thin_gemm(m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    return;
  }
  sgemm_call(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

template <>
void gemm<double>(bool ta, bool tb, int m, int n, int k, double alpha, const double* a, int lda,
                  const double* b, int ldb, double beta, double* c, int ldc) {
  if (m == 0 || n == 0) return;
  cblas_dgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, m,
              n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

template <typename T>
void gemm_reference(bool ta, bool tb, int m, int n, int k, T alpha, const T* a, int lda,
                    const T* b, int ldb, T beta, T* c, int ldc) {
  for (int i = 0; i < m; ++i) {
    for (int j = 0; j < n; ++j) {
      double acc = 0;
      for (int p = 0; p < k; ++p) {
        double av = ta ? a[p * lda + i] : a[i * lda + p];
        double bv = tb ? b[j * ldb + p] : b[p * ldb + j];
        acc += av * bv;
      }
      T prev = beta == T(0) ? T(0) : beta * c[i * ldc + j];
      c[i * ldc + j] = static_cast<T>(alpha * acc) + prev;
    }
  }
}

template void gemm_reference<float>(bool, bool, int, int, int, float, const float*, int,
                                    const float*, int, float, float*, int);
template void gemm_reference<double>(bool, bool, int, int, int, double, const double*, int,
                                     const double*, int, double, double*, int);

}  // namespace xd
