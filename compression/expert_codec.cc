#include "compression/expert_codec.h"

#include <algorithm>

namespace xd {

Expected<ExpertCodecSpec> ExpertCodecSpec::parse(const std::string& spec) {
  ExpertCodecSpec out;
  std::string rest = spec;
  for (;;) {
    if (rest.rfind("sr:", 0) == 0 && !out.against_base && !out.feedback) {
      out.against_base = true;
      rest = rest.substr(3);
    } else if (rest.rfind("ef:", 0) == 0 && !out.feedback) {
      out.feedback = true;
      rest = rest.substr(3);
    } else if (rest.rfind("pred:", 0) == 0 && out.feedback && !out.predict) {
      out.predict = true;
      rest = rest.substr(5);
    } else {
      break;
    }
  }
  auto p = CodecPipeline::parse(rest);
  if (!p) return Status::invalid_argument("expert codec '" + spec + "': " + p.status().message() +
                                          " (the form is [sr:][ef:][pred:]PIPELINE, e.g. sr:topk:0.02+zstd;"
                                          " pred: needs ef: before it)");
  out.pipeline = std::move(*p);
  return out;
}

std::string ExpertCodecSpec::spec() const {
  return std::string(against_base ? "sr:" : "") + (feedback ? "ef:" : "") + (predict ? "pred:" : "") +
         pipeline.spec();
}

float ExpertCodecSpec::velocity_gain() const {
  for (const CodecStage& s : pipeline.stages())
    if (s.kind == CodecKind::kTopK || s.kind == CodecKind::kTopKSign || s.kind == CodecKind::kBlockSign)
      return static_cast<float>(s.density);
  return 1.0f;
}

Expected<ExpertResidualCodec> ExpertResidualCodec::create(const std::string& residual) {
  auto p = CodecPipeline::parse(residual);
  if (!p) return p.status();
  return ExpertResidualCodec(std::move(*p));
}

void ExpertResidualCodec::mean_expert(const std::vector<const float*>& experts, size_t n, float* base) {
  if (experts.empty()) {
    std::fill(base, base + n, 0.0f);
    return;
  }
  const double inv = 1.0 / static_cast<double>(experts.size());
  for (size_t i = 0; i < n; ++i) {
    double sum = 0;
    for (const float* e : experts) sum += e[i];
    base[i] = static_cast<float>(sum * inv);
  }
}

Status ExpertResidualCodec::encode(const float* expert, const float* base, TensorShape shape,
                                   EncodedTensor* out) const {
  const size_t n = shape.elements();
  thread_local std::vector<float> residual;
  residual.resize(n);
  for (size_t i = 0; i < n; ++i) residual[i] = expert[i] - base[i];
  return residual_.encode(residual.data(), shape, out);
}

Status ExpertResidualCodec::decode(const std::string& metadata, const uint8_t* payload, size_t payload_bytes,
                                   const float* base, float* out, size_t n) const {
  XD_RETURN_IF_ERROR(decode_tensor(metadata, payload, payload_bytes, out, n));
  for (size_t i = 0; i < n; ++i) out[i] += base[i];
  return Status::ok();
}

}  // namespace xd
