// Thin float products cut into pieces for OpenBLAS's small-matrix kernels
// (docs/model.md, "Thin GEMMs in pieces"). gemm<float> (model/gemm.h) calls
// sgemm_in_pieces where thin_products_in_pieces() holds, else one
// cblas_sgemm. Thread-safe: the only state is a per-thread buffer of at most
// 32768 floats for a transposed thin op(B), and the choice, made once.
#pragma once

namespace xd::detail {

// C = alpha op(A) op(B) + beta C on row-major matrices, as cblas_sgemm, with
// thin products cut into pieces of at most 100^3 multiply-adds (the rest in
// one call). The result differs from one call only in the order fp32 sums add.
void sgemm_in_pieces(bool trans_a, bool trans_b, int m, int n, int k, float alpha,
                     const float* a, int lda, const float* b, int ldb, float beta, float* c,
                     int ldc);

// True where OpenBLAS runs a core with small-matrix sgemm kernels (SkylakeX,
// Cooperlake, SapphireRapids: openblas_get_corename()); elsewhere a piece is
// packed like a whole product and pieces lose. XDMOE_GEMM_PIECES=0 or 1 in
// the environment overrides the choice. Decided on the first call.
bool thin_products_in_pieces();

}  // namespace xd::detail
