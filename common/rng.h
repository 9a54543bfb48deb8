// Portable deterministic random numbers: splitmix64 and a Box-Muller normal.
// std::*_distribution output differs between standard libraries, so
// initialisation and sampling use these instead. Not thread-safe per instance.
#pragma once

#include <cmath>
#include <cstdint>
#include <string_view>

namespace xd {

inline uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

inline uint64_t hash_string(std::string_view s, uint64_t seed) {
  uint64_t h = seed ^ 0xcbf29ce484222325ull;
  for (char c : s) h = (h ^ static_cast<unsigned char>(c)) * 0x100000001b3ull;
  return splitmix64(h);
}

class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t next_u64() { return splitmix64(state_++); }
  double uniform() { return (next_u64() >> 11) * (1.0 / 9007199254740992.0); }  // [0,1)
  double normal() {
    double u1 = uniform(), u2 = uniform();
    if (u1 < 1e-300) u1 = 1e-300;
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }

 private:
  uint64_t state_;
};

}  // namespace xd
