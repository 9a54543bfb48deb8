// gemm: C = alpha * op(A) * op(B) + beta * C on row-major matrices, through
// OpenBLAS (sgemm/dgemm); where OpenBLAS has small-matrix kernels, the float
// path cuts thin products into pieces for them (gemm_in_pieces below), and
// elsewhere, on AVX2 cores, it multiplies thin ones with its own kernel
// (model/detail/thin_gemm.h). gemm_reference is the naive triple loop the
// tests compare the fast paths against. All are thread-safe: the only state
// is the choice of path, made once, and a per-thread buffer of at most 8192
// floats for a thin op(B) transposed.
#pragma once

namespace xd {

template <typename T>
void gemm(bool trans_a, bool trans_b, int m, int n, int k, T alpha, const T* a, int lda,
          const T* b, int ldb, T beta, T* c, int ldc);

// Where OpenBLAS's core has small-matrix kernels, gemm<float> cuts thin
// products into pieces for them (docs/model.md, "Thin GEMMs in pieces").
// gemm_uses_pieces() says whether it does here (XDMOE_GEMM_PIECES=0 or 1
// overrides); gemm_in_pieces() always takes the pieces, for the benchmark
// that weighs them against one call on any core.
bool gemm_uses_pieces();
void gemm_in_pieces(bool trans_a, bool trans_b, int m, int n, int k, float alpha, const float* a,
                    int lda, const float* b, int ldb, float beta, float* c, int ldc);

// Elsewhere, on a core with AVX2 and FMA, gemm<float> multiplies a product
// whose op(A) is untransposed, whose op(B) holds at most 8192 entries and
// whose C is at least 16 columns wide with its own kernel, which does not
// pack (docs/model.md, "Thin GEMMs on AVX2 cores"). gemm_uses_thin_kernel()
// says whether a product of that shape takes it here (XDMOE_THIN_GEMM=0
// turns the kernel off).
bool gemm_uses_thin_kernel(bool trans_a, int n, int k);

template <typename T>
void gemm_reference(bool trans_a, bool trans_b, int m, int n, int k, T alpha, const T* a,
                    int lda, const T* b, int ldb, T beta, T* c, int ldc);

}  // namespace xd
