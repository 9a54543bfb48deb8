// Writes the seed corpus, fuzz/corpus/<target>/, with the product's own
// encoders: wire headers, control messages (msgpack, bare and framed),
// safetensors files, encoded tensors of every codec, job configs (the
// examples and the default as JSON) and hostfiles. Built with
// -DXD_FUZZ_SEED_TOOL=ON; run as make_seeds <repo root> (README.md).
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cluster/cluster_spec.h"
#include "cluster/job_config.h"
#include "cluster/protocol.h"
#include "common/atomic_file.h"
#include "compression/codec.h"
#include "model/safetensors.h"
#include "transport/wire_format.h"

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

fs::path g_corpus;

void put(const std::string& target, const std::string& name, const std::string& bytes) {
  const fs::path dir = g_corpus / target;
  fs::create_directories(dir);
  std::ofstream(dir / name, std::ios::binary) << bytes;
}

std::string bytes_of(const std::vector<uint8_t>& v) { return std::string(v.begin(), v.end()); }

std::string header_bytes(const xd::FrameHeader& h) {
  uint8_t b[xd::kHeaderSize];
  xd::encode_header(h, b);
  return std::string(reinterpret_cast<const char*>(b), sizeof b);
}

void wire_headers() {
  xd::FrameHeader h;
  put("wire_header", "p2p", header_bytes(h));
  h.kind = xd::MessageKind::kMoeDispatch;
  h.flags = xd::kFlagCompressed;
  h.job = 0xC0FFEE;
  h.step = 17;
  h.layer = 3;
  h.phase = 1;
  h.chunk = 2 * 16 + 1;
  h.src = 1;
  h.dst = 2;
  h.meta_len = 40;
  h.payload_len = 4096;
  put("wire_header", "moe_dispatch_compressed", header_bytes(h));
  h = {};
  h.kind = xd::MessageKind::kAllReduce;
  h.step = 100;
  h.meta_len = 1;
  h.payload_len = 1 << 20;
  put("wire_header", "all_reduce", header_bytes(h));
  h = {};
  h.kind = xd::MessageKind::kControl;
  h.meta_len = 19;
  put("wire_header", "control", header_bytes(h));
}

// Byte 0 even: the body alone; odd: a control message's header and metadata.
void control(const std::string& name, const json& body) {
  const std::vector<uint8_t> meta = json::to_msgpack(body);
  put("control_protocol", name, std::string(1, '\0') + bytes_of(meta));
  xd::FrameHeader h;
  h.kind = xd::MessageKind::kControl;
  h.meta_len = static_cast<uint32_t>(meta.size());
  put("control_protocol", name + "_framed", std::string(1, '\1') + header_bytes(h) + bytes_of(meta));
}

void control_messages() {
  xd::RegisterRequest reg;
  reg.requested_rank = 1;
  reg.host = "node-a";
  reg.pid = 4242;
  reg.data_endpoint = "tcp://10.0.0.2:5601";
  control("register", xd::to_json(reg));

  xd::Assignment a;
  a.job_id = 7;
  a.job_name = "tiny";
  a.job = xd::default_job_config();
  const std::vector<int> sizes = a.job.cluster.level_sizes();
  for (int r = 0; r < a.job.cluster.world_size(); ++r)
    a.peers.push_back({r, "tcp://127.0.0.1:" + std::to_string(5600 + r), r == 0 ? 0 : xd::link_level(sizes, 0, r)});
  a.rank = 0;
  a.domain_sizes = {1, 1};
  a.predicted_step_s = 0.5;
  control("assign", xd::to_json(a));

  xd::StepMetrics m;
  m.step = 3;
  m.loss = 2.5;
  m.step_s = 0.7;
  m.bytes = {{"dc/moe_dispatch", 1e6}};
  m.nmse = {{"dc/expert_gather", 0.01}};
  m.gather_wait_s = {0.01, 0.02};
  m.waits_s = {{xd::step_waits::kForwardExpertAllGather, 0.03}, {xd::step_waits::kBackwardGradientNorm, 0.01}};
  m.link_bursts = {{"dc", {2, 1e6, 0.1}}};
  control("metrics", xd::to_json(m));

  control("error", xd::to_json(xd::ErrorReport{"worker 1 failed"}));
  control("stop", xd::to_json(xd::StopOrder{"done"}));
  control("throttle_request", xd::to_json(xd::ThrottleRequest{"dc", 1.25e7, 0.01}));
  control("throttle_order", xd::to_json(xd::ThrottleOrder{0, 1.25e7, 0.01}));
  control("plan", xd::to_json(xd::PlanUpdate{5, {2, 1}, 4, 2, 0.4, "link dc re-fitted"}));
  control("checkpoint_saved", xd::to_json(xd::CheckpointSaved{40, "runs/ckpt/step-40", "shard-1.safetensors",
                                                              640, 1 << 20, 0x1234abcd, 0.25}));
  control("heartbeat", xd::to_json(xd::Heartbeat{}));
}

void safetensors_files() {
  const std::string path = (fs::temp_directory_path() / "xd_make_seeds.safetensors").string();
  const float f32[6] = {1, -2, 3.5f, 0, 1e-3f, -7};
  const double f64[2] = {1.0, -0.25};
  const uint16_t half[4] = {0x3c00, 0xc000, 0x0001, 0x7c00};  // as F16 and as BF16
  const int64_t i64[2] = {1, -1};
  const uint8_t u8[3] = {0, 1, 255};
  struct Case {
    const char* name;
    std::vector<xd::SafetensorsEntry> tensors;
    std::map<std::string, std::string> metadata;
  };
  const Case cases[] = {
      {"f32", {{"w", xd::Dtype::kF32, {2, 3}, f32}}, {}},
      {"mixed",
       {{"a.f64", xd::Dtype::kF64, {2}, f64},
        {"b.f16", xd::Dtype::kF16, {2, 2}, half},
        {"c.bf16", xd::Dtype::kBF16, {4}, half},
        {"d.i64", xd::Dtype::kI64, {2}, i64},
        {"e.u8", xd::Dtype::kU8, {3}, u8},
        {"f.empty", xd::Dtype::kF32, {0, 4}, nullptr}},
       {{"format", "pt"}}},
  };
  for (const Case& c : cases) {
    if (!xd::write_safetensors(path, c.tensors, c.metadata).is_ok()) std::abort();
    put("safetensors", c.name, *xd::read_file(path));
  }
  fs::remove(path);
}

// Byte 0: the spec's index in fuzz_codec.cc's kSpecs; bytes 1-2: metadata length.
void codec_frames() {
  const char* specs[] = {
      "raw",          "bf16",          "fp16",      "int8_row",          "topk:0.1",
      "topk:1",       "zstd",          "raw+zstd:1", "bf16+zstd",        "fp16+zstd:19",
      "int8_row+zstd", "topk:0.02+zstd", "topk:0.5+zstd:3",
      "topk_sign:0.1", "topk_sign:0.02+zstd:1", "block_sign:0.5", "block_sign:0.25:4+zstd:1",
      "topk_sign:1+zstd:1", "int4_row", "int4_row+zstd:1", "int8_row:3", "int4_row:3+zstd:1",
  };
  std::vector<float> x(32);
  for (size_t i = 0; i < x.size(); ++i) x[i] = (i % 7 == 0 ? 2.0f : 0.1f) * (i % 2 ? -1.0f : 1.0f) * float(i + 1);
  for (size_t s = 0; s < std::size(specs); ++s) {
    xd::EncodedTensor e;
    if (!xd::CodecPipeline::parse(specs[s])->encode(x.data(), {4, 8}, &e).is_ok()) std::abort();
    std::string in(1, char(s));
    in += char(e.metadata.size() & 0xff);
    in += char(e.metadata.size() >> 8);
    put("codec", std::string("frame_") + std::to_string(s), in + e.metadata + bytes_of(e.payload));
  }
}

void job_configs(const fs::path& root) {
  for (const char* name : {"tiny.yaml", "2dc.yaml", "4dc.yaml"})
    put("job_config", name, *xd::read_file((root / "examples" / name).string()));
  put("job_config", "default.json", xd::job_config_to_json(xd::default_job_config()).dump(1));
}

void hostfiles() {
  put("hostfile", "by_dc", "# two datacenters\nnode-a slots=2 dc=east\nnode-b slots=2 dc=west\n");
  put("hostfile", "in_order", "10.0.0.1 slots=3 max_slots=8\n10.0.0.2\n\n[::1] slots=2  # loopback\n");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: make_seeds <repo root>\n");
    return 2;
  }
  const fs::path root = argv[1];
  g_corpus = root / "fuzz" / "corpus";
  wire_headers();
  control_messages();
  safetensors_files();
  codec_frames();
  job_configs(root);
  hostfiles();
  return 0;
}
