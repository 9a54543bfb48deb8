// Forced into the fuzz build's product sources when clang lacks two things
// the product's fp16 codec uses (compression/detail/number_formats.*), as
// clang 14 does on x86 (clang 15 has both):
//  - _Float16. With -D_Float16=xd_fuzz_float16, a 2-byte trivially copyable
//    stand-in over clang's storage-only __fp16, converting to and from float
//    as _Float16 does (IEEE binary16, round to nearest even; only a
//    signalling NaN widens to a signalling NaN, where GCC quiets it). The
//    conversions come from compiler-rt's builtins.
//  - __builtin_cpu_supports("f16c"). Answered from CPUID here; other
//    features go to the builtin.
#pragma once

#include <cpuid.h>

struct xd_fuzz_float16 {
  __fp16 value;
  xd_fuzz_float16() = default;
  explicit xd_fuzz_float16(float f) : value(f) {}
  explicit operator float() const { return value; }
};
static_assert(sizeof(xd_fuzz_float16) == 2);

inline bool xd_fuzz_cpu_supports(const char* feature) {
  if (__builtin_strcmp(feature, "f16c") == 0) {
    unsigned a, b, c, d;
    return __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C);
  }
  if (__builtin_strcmp(feature, "avx") == 0) return __builtin_cpu_supports("avx");
  return false;
}
#define __builtin_cpu_supports(feature) xd_fuzz_cpu_supports(feature)
