// Feeds arbitrary bytes to the safetensors reader (model/safetensors.h) as a
// file's contents: SafetensorsFile::parse, and SafetensorsFile::open on the
// same bytes through an in-memory file (memfd, opened by its /proc/self/fd
// path). On a file that opens, lists the tensors and the metadata and reads
// every floating-point tensor as f32. Checks that open and parse agree, that
// every listed tensor is found by its name inside the data buffer, and that
// read_f32 accepts every floating-point tensor at its own shape.
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "model/safetensors.h"

namespace {

// The input as a file; its path stays valid while the descriptor is open.
class MemFile {
 public:
  MemFile(const uint8_t* data, size_t size) : fd_(memfd_create("fuzz_safetensors", 0)) {
    if (fd_ < 0) std::abort();
    for (size_t done = 0; done < size;) {
      const ssize_t n = write(fd_, data + done, size - done);
      if (n <= 0) std::abort();
      done += static_cast<size_t>(n);
    }
  }
  ~MemFile() { close(fd_); }
  std::string path() const { return "/proc/self/fd/" + std::to_string(fd_); }

 private:
  int fd_;
};

bool is_float(xd::Dtype d) {
  return d == xd::Dtype::kF32 || d == xd::Dtype::kF64 || d == xd::Dtype::kF16 || d == xd::Dtype::kBF16;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace xd;
  Expected<SafetensorsFile> parsed =
      SafetensorsFile::parse(std::string(reinterpret_cast<const char*>(data), size), "fuzz.safetensors");
  MemFile file(data, size);
  Expected<SafetensorsFile> opened = SafetensorsFile::open(file.path());
  if (parsed.has_value() != opened.has_value()) std::abort();
  if (!parsed) return 0;
  const SafetensorsFile& f = *parsed;
  if (f.names() != opened->names() || f.metadata() != opened->metadata()) std::abort();

  const std::vector<std::string> names = f.names();
  for (const std::string& name : names) {
    const TensorInfo* t = f.find(name);
    if (!t || t->name != name || t->end < t->begin) std::abort();
    if (t->nbytes() != 0 && static_cast<size_t>(t->numel()) * dtype_size(t->dtype) != t->nbytes()) std::abort();
    if (!is_float(t->dtype)) {
      std::vector<float> none;
      if (f.read_f32(name, t->shape, none.data()).is_ok()) std::abort();  // integers are refused
      continue;
    }
    std::vector<float> out(t->nbytes() / dtype_size(t->dtype));
    Status st = f.read_f32(name, t->shape, out.data());
    if (!st.is_ok()) {
      std::fprintf(stderr, "read_f32 refused a listed tensor: %s\n", st.to_string().c_str());
      std::abort();
    }
  }
  return 0;
}
