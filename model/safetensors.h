// The safetensors file format (https://github.com/huggingface/safetensors):
// u64 little-endian header length N, N bytes of JSON header
//   {"__metadata__": {str: str}, name: {"dtype", "shape", "data_offsets": [b, e]}}
// padded with spaces so the data starts 8-byte aligned, then the byte buffer.
//
// write_safetensors lays tensors out back to back in the order given (no gaps, as
// the reference reader demands) and writes atomically (common/atomic_file.h).
// Tensors are only naturally aligned if the caller orders them so; readers here
// never assume alignment.
//
// SafetensorsFile owns the whole file in memory, validated on open: header JSON,
// dtypes, shapes, offsets inside the buffer and consistent with dtype * shape, no
// overlaps. Copies share the immutable bytes; TensorInfo::data stays valid for as
// long as any copy lives. All const methods are safe to call concurrently.
// Every error is a Status naming the file and the offending tensor or key.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/status.h"

namespace xd {

enum class Dtype : int { kF64, kF32, kF16, kBF16, kI64, kI32, kI16, kI8, kU8, kBool };

const char* dtype_name(Dtype d);                       // "F32", "BF16", ...
Expected<Dtype> parse_dtype(const std::string& name);  // inverse of dtype_name
size_t dtype_size(Dtype d);                            // bytes per element

// "[2, 3]"; used in error messages.
std::string shape_string(const std::vector<int64_t>& shape);

// One tensor to write. `data` holds numel(shape) elements of `dtype`, little-endian,
// and must stay valid until write_safetensors returns.
struct SafetensorsEntry {
  std::string name;
  Dtype dtype = Dtype::kF32;
  std::vector<int64_t> shape;
  const void* data = nullptr;
};

Status write_safetensors(const std::string& path, const std::vector<SafetensorsEntry>& tensors,
                         const std::map<std::string, std::string>& metadata = {});

struct TensorInfo {
  std::string name;
  Dtype dtype = Dtype::kF32;
  std::vector<int64_t> shape;
  size_t begin = 0, end = 0;     // byte offsets inside the data buffer
  const void* data = nullptr;    // start of this tensor's bytes; maybe unaligned
  size_t nbytes() const { return end - begin; }
  int64_t numel() const;
};

class SafetensorsFile {
 public:
  static Expected<SafetensorsFile> open(const std::string& path);
  // Parses bytes already in memory; `path` only labels error messages.
  static Expected<SafetensorsFile> parse(std::string bytes, const std::string& path);

  const std::string& path() const { return path_; }
  std::vector<std::string> names() const;  // in data-buffer order
  const TensorInfo* find(const std::string& name) const;  // nullptr if absent
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  // Copies tensor `name` into `out` (numel(expected_shape) floats), converting
  // F64 / F16 / BF16 to float. not_found if absent; invalid_argument on a shape
  // other than `expected_shape` or a non-floating dtype.
  Status read_f32(const std::string& name, const std::vector<int64_t>& expected_shape,
                  float* out) const;

 private:
  SafetensorsFile() = default;

  std::string path_;
  std::shared_ptr<const std::string> bytes_;  // the whole file; heap-pinned for `data`
  std::vector<TensorInfo> tensors_;           // sorted by offset
  std::unordered_map<std::string, size_t> index_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace xd
