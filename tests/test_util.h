// Helpers shared by the model's file-format tests: a temporary directory per
// test, whole-file reads and writes, a small model config that sets every
// field, awkward float values, and a Status message matcher.
#pragma once

#include <unistd.h>

#include <atomic>
#include <bit>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <gtest/gtest.h>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "common/atomic_file.h"
#include "common/rng.h"
#include "common/status.h"
#include "model/model_config.h"
#include "model/param_layout.h"

namespace xd::test_util {

namespace fs = std::filesystem;

// A fresh directory per test, removed afterwards.
class TempDir {
 public:
  TempDir() {
    static std::atomic<int> seq{0};
    path_ = (fs::temp_directory_path() /
             ("xdmoe_test_" + std::to_string(::getpid()) + "_" + std::to_string(seq++)))
                .string();
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }
  std::string operator/(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

inline std::string slurp(const std::string& path) { return read_file(path).value(); }

inline void spit(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

// A hand-made safetensors file: `header` JSON verbatim, then `data`.
inline std::string raw_file(const std::string& header, const std::string& data) {
  uint64_t n = header.size();
  std::string out(reinterpret_cast<const char*>(&n), 8);
  return out + header + data;
}

inline ::testing::AssertionResult has_message(const Status& st, std::initializer_list<std::string> parts) {
  if (st.is_ok()) return ::testing::AssertionFailure() << "status is OK";
  for (const std::string& p : parts)
    if (st.message().find(p) == std::string::npos)
      return ::testing::AssertionFailure() << "\"" << st.to_string() << "\" lacks \"" << p << "\"";
  return ::testing::AssertionSuccess();
}

inline ModelConfig small_config() {
  ModelConfig c;
  c.vocab_size = 32;
  c.hidden_size = 16;
  c.num_layers = 2;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.max_seq_len = 24;
  c.num_experts = 4;
  c.top_k = 2;
  c.expert_intermediate_size = 24;
  c.num_shared_experts = 1;
  c.shared_intermediate_size = 8;
  c.gating = Gating::kSigmoidTopK;
  c.capacity_factor = 1.25;
  c.aux_loss_coef = 0.02;
  c.z_loss_coef = 1e-3 / 3;
  c.rope_theta = 1e6;
  c.rms_norm_eps = 1e-6;
  c.init_std = 0.017;
  c.connectivity = {Connectivity::kRegular, Connectivity::kFarSkip};
  return c;
}

// n byte-level tokens below `vocab`, seeded.
inline std::vector<int32_t> random_tokens(int n, int vocab, uint64_t seed) {
  Rng rng(seed);
  std::vector<int32_t> t(n);
  for (auto& x : t) x = static_cast<int32_t>(rng.next_u64() % vocab);
  return t;
}

// Overwrites every tensor whose name contains `part` with scale * N(0, 1)
// draws, seeded (e.g. GShard's noise weights, which start at 0).
template <typename T>
void randomise_tensors(const ParamLayout& layout, T* params, const std::string& part, double scale,
                       uint64_t seed) {
  Rng rng(seed);
  for (const TensorSlot& s : layout.slots())
    if (s.name.find(part) != std::string::npos)
      for (size_t i = 0; i < s.numel(); ++i) params[s.offset + i] = static_cast<T>(scale * rng.normal());
}

// Random values plus the awkward ones: -0, denormals, inf, a NaN payload.
inline std::vector<float> random_floats(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  const float special[] = {-0.0f, std::numeric_limits<float>::denorm_min(),
                           std::numeric_limits<float>::infinity(),
                           std::bit_cast<float>(0x7fc12345u)};
  for (size_t i = 0; i < std::size(special) && i < n; ++i) v[i * 7 % n] = special[i];
  return v;
}

inline bool bit_identical(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

}  // namespace xd::test_util
