// gemm: C = alpha * op(A) * op(B) + beta * C on row-major matrices, through
// OpenBLAS (sgemm/dgemm); the float path cuts thin products into pieces for
// OpenBLAS's small-matrix kernels (docs/model.md, "Thin GEMMs in pieces").
// gemm_reference is the naive triple loop the tests compare the fast path
// against. Both are thread-safe: the only state is a per-thread buffer of at
// most 32768 floats, which holds a thin op(B) transposed.
#pragma once

namespace xd {

template <typename T>
void gemm(bool trans_a, bool trans_b, int m, int n, int k, T alpha, const T* a, int lda,
          const T* b, int ldb, T beta, T* c, int ldc);

template <typename T>
void gemm_reference(bool trans_a, bool trans_b, int m, int n, int k, T alpha, const T* a,
                    int lda, const T* b, int ldb, T beta, T* c, int ldc);

}  // namespace xd
