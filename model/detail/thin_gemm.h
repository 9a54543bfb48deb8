// thin_gemm: C = alpha * A * B + beta * C (row-major, A untransposed) for the
// model's thin products on AVX2 cores whose OpenBLAS has no small-matrix
// kernels (docs/model.md, "Thin GEMMs on AVX2 cores"). OpenBLAS packs both
// operands of every product into panels first; where B is one small weight
// (at most kThinGemmMaxB entries) and A a few thousand token rows, that
// packing and its separate beta pass over C are a large share of the time.
// This kernel reads A and B where they are: 6 rows of C by 16 columns at a
// time in 12 AVX2 registers, one fused multiply-add per element of the sum
// over k, in order, so each element of C gets the same bits whichever rows
// share its call. A beta of 0 never reads C; an alpha of 0 never reads A or B.
// Pure functions; thread-safe.
#pragma once

namespace xd::detail {

// The largest op(B), in entries (a 64 x 128 weight), this kernel takes: 32
// KB, about a core's L1 data cache, which every block of A's rows passes over.
inline constexpr long kThinGemmMaxB = 8192;
// The fewest columns of C it takes: a narrower product (a router's logits,
// one per expert) fills too few of a tile's 16 lanes, and OpenBLAS is faster.
inline constexpr int kThinGemmMinColumns = 16;

// Whether this CPU has AVX2 and FMA and XDMOE_THIN_GEMM is not "0"; asked
// once, then cached.
bool thin_gemm_available();

// Requires thin_gemm_available(); ldb >= n, lda >= k, ldc >= n.
void thin_gemm(int m, int n, int k, float alpha, const float* a, int lda, const float* b,
               int ldb, float beta, float* c, int ldc);

}  // namespace xd::detail
