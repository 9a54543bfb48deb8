// safetensors files: every dtype, alignment, damaged and hostile files, and
// files exchanged with PyTorch both ways.
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <gtest/gtest.h>
#include <limits>
#include <set>

#include "common/atomic_file.h"
#include "model/checkpoint.h"
#include "model/hf_config.h"
#include "model/param_layout.h"
#include "model/safetensors.h"
#include "test_util.h"

namespace xd {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using namespace test_util;

// ---------------------------------------------------------------- safetensors

TEST(Safetensors, EveryDtypeRoundTripsBitForBitWithMetadata) {
  TempDir tmp;
  const std::vector<float> f32 = {1.5f, -0.0f, 3.25f, 1e-40f, 7.0f, -8.5f};
  const std::vector<double> f64 = {1.0 / 3.0, -2.5e300};
  const std::vector<uint16_t> bf16 = {0x3fc0, 0xc010, 0x4040};  // 1.5, -2.25, 3.0
  const std::vector<int64_t> i64 = {1, -2, INT64_MAX};
  const std::string path = tmp / "t.safetensors";
  ASSERT_TRUE(write_safetensors(path,
                                {{"b", Dtype::kBF16, {3}, bf16.data()},
                                 {"a", Dtype::kF32, {2, 3}, f32.data()},
                                 {"d", Dtype::kF64, {1, 2}, f64.data()},
                                 {"i", Dtype::kI64, {3}, i64.data()},
                                 {"empty", Dtype::kF32, {0, 4}, nullptr}},
                                {{"format", "pt"}, {"note", "hi"}})
                  .is_ok());
  Expected<SafetensorsFile> f = SafetensorsFile::open(path);
  ASSERT_TRUE(f) << f.status().to_string();
  EXPECT_EQ(f->names(), (std::vector<std::string>{"b", "a", "d", "i", "empty"}));
  EXPECT_EQ(f->metadata().at("format"), "pt");
  EXPECT_EQ(f->metadata().at("note"), "hi");
  const TensorInfo* a = f->find("a");
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->dtype, Dtype::kF32);
  EXPECT_EQ(a->shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(std::memcmp(a->data, f32.data(), 24), 0);
  EXPECT_EQ(std::memcmp(f->find("d")->data, f64.data(), 16), 0);
  EXPECT_EQ(std::memcmp(f->find("b")->data, bf16.data(), 6), 0);
  EXPECT_EQ(std::memcmp(f->find("i")->data, i64.data(), 24), 0);
  EXPECT_EQ(f->find("empty")->numel(), 0);
  EXPECT_EQ(f->find("nope"), nullptr);
}

TEST(Safetensors, DataBufferStartsEightByteAligned) {
  TempDir tmp;
  const float x = 1.0f;
  const std::string path = tmp / "t.safetensors";
  ASSERT_TRUE(write_safetensors(path, {{"x", Dtype::kF32, {}, &x}}).is_ok());
  std::string bytes = slurp(path);
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  EXPECT_EQ((8 + n) % 8, 0u);
  EXPECT_EQ(bytes.size(), 8 + n + 4);
  EXPECT_EQ(bytes[8], '{');
}

TEST(Safetensors, ReadF32ConvertsBf16F16AndF64) {
  TempDir tmp;
  const std::vector<uint16_t> bf16 = {0x3fc0, 0xc010};
  const std::vector<uint16_t> f16 = {0x3e00, 0xc100, 0x0001, 0x7c00};  // 1.5 -2.5 2^-24 inf
  const std::vector<double> f64 = {0.25, -1e10};
  const std::string path = tmp / "t.safetensors";
  ASSERT_TRUE(write_safetensors(path, {{"b", Dtype::kBF16, {2}, bf16.data()},
                                       {"h", Dtype::kF16, {4}, f16.data()},
                                       {"d", Dtype::kF64, {2}, f64.data()}})
                  .is_ok());
  SafetensorsFile f = SafetensorsFile::open(path).value();
  float out[4];
  ASSERT_TRUE(f.read_f32("b", {2}, out).is_ok());
  EXPECT_EQ(out[0], 1.5f);
  EXPECT_EQ(out[1], -2.25f);
  ASSERT_TRUE(f.read_f32("h", {4}, out).is_ok());
  EXPECT_EQ(out[0], 1.5f);
  EXPECT_EQ(out[1], -2.5f);
  EXPECT_EQ(out[2], std::ldexp(1.0f, -24));
  EXPECT_TRUE(std::isinf(out[3]));
  ASSERT_TRUE(f.read_f32("d", {2}, out).is_ok());
  EXPECT_EQ(out[0], 0.25f);
  EXPECT_EQ(out[1], -1e10f);
}

TEST(Safetensors, TruncatedFileIsRejectedWithAReason) {
  TempDir tmp;
  const std::vector<float> v(16, 2.0f);
  const std::string path = tmp / "t.safetensors";
  ASSERT_TRUE(write_safetensors(path, {{"weight", Dtype::kF32, {16}, v.data()}}).is_ok());
  std::string bytes = slurp(path);
  spit(path, bytes.substr(0, bytes.size() - 5));
  Status st = SafetensorsFile::open(path).status();
  EXPECT_EQ(st.code(), Status::Code::kCorruption);
  EXPECT_TRUE(has_message(st, {path, "\"weight\"", "truncated"}));

  spit(path, bytes.substr(0, 20));  // cut inside the header
  EXPECT_TRUE(has_message(SafetensorsFile::open(path).status(), {path, "truncated"}));
  spit(path, bytes.substr(0, 3));  // cut inside the length field
  EXPECT_TRUE(has_message(SafetensorsFile::open(path).status(), {path, "truncated"}));
}

TEST(Safetensors, CorruptHeaderJsonIsRejectedWithAReason) {
  TempDir tmp;
  const std::string path = tmp / "t.safetensors";
  spit(path, raw_file("{\"a\": {\"dtype\": \"F32\", ", std::string(8, '\0')));
  EXPECT_TRUE(has_message(SafetensorsFile::open(path).status(), {path, "bad header JSON"}));
  spit(path, raw_file("[1, 2]", ""));
  EXPECT_TRUE(has_message(SafetensorsFile::open(path).status(), {path, "not an object"}));
  uint64_t huge = uint64_t{1} << 62;
  spit(path, std::string(reinterpret_cast<const char*>(&huge), 8) + "{}");
  EXPECT_TRUE(has_message(SafetensorsFile::open(path).status(), {path, "header length"}));
}

TEST(Safetensors, MalformedTensorEntriesAreRejectedNamingTheTensor) {
  TempDir tmp;
  const std::string path = tmp / "t.safetensors";
  const std::string data(16, '\0');
  struct Case {
    const char* header;
    std::vector<std::string> expect;
  } cases[] = {
      {R"({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 16]}})", {"\"w\"", "needs 12"}},
      {R"({"w": {"dtype": "F32", "shape": [8], "data_offsets": [0, 32]}})", {"\"w\"", "past"}},
      {R"({"w": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 8]}})", {"\"w\"", "Q4"}},
      {R"({"w": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}})", {"\"w\"", "shape"}},
      {R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [8]}})", {"\"w\"", "data_offsets"}},
      {R"({"w": {"shape": [2], "data_offsets": [0, 8]}})", {"\"w\"", "dtype"}},
      {R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
           "v": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})",
       {"\"w\"", "\"v\"", "overlap"}},
      {R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
           "w": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}})",
       {"\"w\"", "twice"}},
      {R"({"__metadata__": {"step": 3}})", {"\"step\"", "not a string"}},
      {R"({"w": {"dtype": "F32", "shape": [1e30], "data_offsets": [0, 8]}})", {"\"w\"", "shape"}},
  };
  for (const Case& c : cases) {
    spit(path, raw_file(c.header, data));
    Status st = SafetensorsFile::open(path).status();
    EXPECT_EQ(st.code(), Status::Code::kCorruption) << c.header;
    EXPECT_TRUE(has_message(st, {path})) << c.header;
    for (const std::string& e : c.expect) EXPECT_TRUE(has_message(st, {e})) << c.header;
  }
}

TEST(Safetensors, WrongShapeNamesBothShapes) {
  TempDir tmp;
  const std::vector<float> v(6, 1.0f);
  const std::string path = tmp / "t.safetensors";
  ASSERT_TRUE(write_safetensors(path, {{"w", Dtype::kF32, {2, 3}, v.data()}}).is_ok());
  SafetensorsFile f = SafetensorsFile::open(path).value();
  float out[6];
  Status st = f.read_f32("w", {3, 2}, out);
  EXPECT_EQ(st.code(), Status::Code::kInvalidArgument);
  EXPECT_TRUE(has_message(st, {path, "\"w\"", "[2, 3]", "[3, 2]"}));
}

TEST(Safetensors, MissingTensorIsNotFoundAndNamed) {
  TempDir tmp;
  const std::string path = tmp / "t.safetensors";
  ASSERT_TRUE(write_safetensors(path, {}).is_ok());
  float out;
  Status st = SafetensorsFile::open(path).value().read_f32("lm_head.weight", {}, &out);
  EXPECT_EQ(st.code(), Status::Code::kNotFound);
  EXPECT_TRUE(has_message(st, {path, "lm_head.weight"}));
}

TEST(Safetensors, IntegerTensorIsNotReadAsFloat) {
  TempDir tmp;
  const int64_t v[2] = {1, 2};
  const std::string path = tmp / "t.safetensors";
  ASSERT_TRUE(write_safetensors(path, {{"ids", Dtype::kI64, {2}, v}}).is_ok());
  float out[2];
  Status st = SafetensorsFile::open(path).value().read_f32("ids", {2}, out);
  EXPECT_TRUE(has_message(st, {"\"ids\"", "I64"}));
}

TEST(Safetensors, MissingFileIsNotFound) {
  TempDir tmp;
  Status st = SafetensorsFile::open(tmp / "absent.safetensors").status();
  EXPECT_EQ(st.code(), Status::Code::kNotFound);
  EXPECT_TRUE(has_message(st, {"absent.safetensors"}));
}

TEST(Safetensors, WriterRefusesDuplicateAndReservedNames) {
  TempDir tmp;
  const float x = 0;
  EXPECT_TRUE(has_message(write_safetensors(tmp / "t", {{"a", Dtype::kF32, {}, &x},
                                                         {"a", Dtype::kF32, {}, &x}}),
                          {"\"a\"", "duplicate"}));
  EXPECT_FALSE(write_safetensors(tmp / "t", {{"__metadata__", Dtype::kF32, {}, &x}}).is_ok());
  EXPECT_FALSE(fs::exists(tmp / "t"));
}

// ---------------------------------------------------------------- python interop

// Skips the calling test unless python3 with torch can run.
bool python_with_torch() {
  return ::access("/usr/bin/python3", X_OK) == 0 &&
         std::system("/usr/bin/python3 -c 'import torch' >/dev/null 2>&1") == 0;
}

int run_python(const TempDir& tmp, const std::string& script, const std::string& arg) {
  spit(tmp / "script.py", script);
  std::string cmd = "/usr/bin/python3 '" + (tmp / "script.py") + "' '" + arg + "'";
  int rc = std::system(cmd.c_str());
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

// A hand-written safetensors writer: json + struct, tensors from torch, the BF16
// one first so the F32 after it is not 4-byte aligned.
constexpr const char* kPythonWriter = R"PY(
import json, struct, sys, torch
tensors = {
    "bf": torch.tensor([1.5, -2.25, 3.0], dtype=torch.bfloat16),
    "w": (torch.arange(6, dtype=torch.float32) * 0.5 - 1.0).reshape(2, 3),
    "d": torch.tensor([[1e-3, -7.25]], dtype=torch.float64),
    "ids": torch.tensor([1, -2, 3], dtype=torch.int64),
}
names = {torch.bfloat16: "BF16", torch.float32: "F32", torch.float64: "F64", torch.int64: "I64"}
header, blobs, off = {"__metadata__": {"format": "pt", "who": "python"}}, [], 0
for name, t in tensors.items():
    b = t.contiguous().view(torch.uint8).numpy().tobytes()
    header[name] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + len(b)]}
    blobs.append(b)
    off += len(b)
h = json.dumps(header).encode()
h += b" " * (-(8 + len(h)) % 8)
with open(sys.argv[1], "wb") as f:
    f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))
)PY";

TEST(PythonInterop, FileWrittenByPythonIsReadable) {
  if (!python_with_torch()) GTEST_SKIP() << "needs /usr/bin/python3 with torch importable";
  TempDir tmp;
  const std::string path = tmp / "py.safetensors";
  ASSERT_EQ(run_python(tmp, kPythonWriter, path), 0);
  Expected<SafetensorsFile> f = SafetensorsFile::open(path);
  ASSERT_TRUE(f) << f.status().to_string();
  EXPECT_EQ(f->metadata().at("who"), "python");
  float w[6], bf[3], d[2];
  ASSERT_TRUE(f->read_f32("w", {2, 3}, w).is_ok());
  for (int i = 0; i < 6; ++i) EXPECT_EQ(w[i], i * 0.5f - 1.0f);
  ASSERT_TRUE(f->read_f32("bf", {3}, bf).is_ok());
  EXPECT_EQ(bf[0], 1.5f);
  EXPECT_EQ(bf[1], -2.25f);
  EXPECT_EQ(bf[2], 3.0f);
  ASSERT_TRUE(f->read_f32("d", {1, 2}, d).is_ok());
  EXPECT_EQ(d[0], 1e-3f);
  EXPECT_EQ(d[1], -7.25f);
  const TensorInfo* ids = f->find("ids");
  ASSERT_NE(ids, nullptr);
  int64_t v[3];
  std::memcpy(v, ids->data, sizeof(v));
  EXPECT_EQ(v[1], -2);
}

// A hand-written reader that checks a checkpoint of ours, byte-exact, from python.
constexpr const char* kPythonReader = R"PY(
import json, struct, sys, torch
d = sys.argv[1]
def load(path):
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    assert (8 + n) % 8 == 0, "data not aligned"
    header = json.loads(raw[8:8 + n])
    meta = header.pop("__metadata__", {})
    dt = {"F32": torch.float32, "F64": torch.float64, "BF16": torch.bfloat16, "I64": torch.int64}
    out, spans = {}, []
    for name, info in header.items():
        b, e = info["data_offsets"]
        spans.append((b, e))
        t = torch.frombuffer(bytearray(raw[8 + n + b:8 + n + e]), dtype=dt[info["dtype"]])
        out[name] = t.reshape(info["shape"])
    spans.sort()
    assert spans[0][0] == 0 and spans[-1][1] == len(raw) - 8 - n, "buffer not covered"
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])), "gaps between tensors"
    return out, meta
model, meta = load(d + "/model.safetensors")
assert meta == {"format": "pt"}, meta
cfg = json.load(open(d + "/config.json"))
assert cfg["model_type"] == "mixtral" and cfg["architectures"] == ["MixtralForCausalLM"]
h, ff = cfg["hidden_size"], cfg["intermediate_size"]
assert model["model.embed_tokens.weight"].shape == (cfg["vocab_size"], h)
assert model["model.layers.1.block_sparse_moe.experts.3.w2.weight"].shape == (h, ff)
# The test wrote params[i] = i * 0.25 in ParamLayout order, embed_tokens first.
emb = model["model.embed_tokens.weight"].flatten()
assert torch.equal(emb, torch.arange(emb.numel(), dtype=torch.float32) * 0.25)
opt, ometa = load(d + "/optimizer.safetensors")
assert ometa["step"] == "7", ometa
assert set(opt) == {p + k for p in ("exp_avg.", "exp_avg_sq.") for k in model}
assert torch.equal(opt["exp_avg.lm_head.weight"], -model["lm_head.weight"])
st = json.load(open(d + "/trainer_state.json"))
assert st == {"step": 3, "data_position": 17, "seed": 9, "last_loss": 1.25}, st
)PY";

TEST(PythonInterop, CheckpointWrittenByUsIsReadableByPython) {
  if (!python_with_torch()) GTEST_SKIP() << "needs /usr/bin/python3 with torch importable";
  TempDir tmp;
  ParamLayout layout(small_config());
  std::vector<float> p(layout.size()), m(layout.size()), v(layout.size(), 1.0f);
  for (size_t i = 0; i < p.size(); ++i) {
    p[i] = static_cast<float>(i) * 0.25f;
    m[i] = -p[i];
  }
  const std::string dir = tmp / "ck";
  ASSERT_TRUE(
      save_checkpoint(dir, layout, p.data(), m.data(), v.data(), 7, {3, 17, 9, 1.25}).is_ok());
  EXPECT_EQ(run_python(tmp, kPythonReader, dir), 0);
}

}  // namespace
}  // namespace xd
