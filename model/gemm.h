// gemm: C = alpha * op(A) * op(B) + beta * C on row-major matrices, through
// OpenBLAS (sgemm/dgemm). gemm_reference is the naive triple loop the tests
// compare the fast path against. Both are thread-safe (no shared state).
#pragma once

namespace xd {

template <typename T>
void gemm(bool trans_a, bool trans_b, int m, int n, int k, T alpha, const T* a, int lda,
          const T* b, int ldb, T beta, T* c, int ldc);

template <typename T>
void gemm_reference(bool trans_a, bool trans_b, int m, int n, int k, T alpha, const T* a,
                    int lda, const T* b, int ldb, T beta, T* c, int ldc);

}  // namespace xd
