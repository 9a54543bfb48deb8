// gemm: C = alpha * op(A) * op(B) + beta * C on row-major matrices, through
// OpenBLAS (sgemm/dgemm); where OpenBLAS has small-matrix kernels, the float
// path cuts thin products into pieces for them (gemm_in_pieces below).
// gemm_reference is the naive triple loop the tests compare the fast path
// against. All are thread-safe: the only state is the choice of pieces, made
// once, and a per-thread buffer of at most 8192 floats for a thin op(B)
// transposed.
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

template <typename T>
void gemm_reference(bool trans_a, bool trans_b, int m, int n, int k, T alpha, const T* a,
                    int lda, const T* b, int ldb, T beta, T* c, int ldc);

}  // namespace xd
