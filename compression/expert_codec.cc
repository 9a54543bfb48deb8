#include "compression/expert_codec.h"

#include <algorithm>

namespace xd {

Expected<ExpertCodecSpec> ExpertCodecSpec::parse(const std::string& spec) {
  const std::string form =
      " (the form is [sr:][ef:][pred:]PIPELINE[@STEP:PIPELINE]..., e.g. sr:topk:0.02+zstd;"
      " pred: needs ef: before it; or delta:PIPELINE with a lossless PIPELINE, e.g. delta:zstd:1)";
  ExpertCodecSpec out;
  if (spec.rfind("delta:", 0) == 0) {
    auto p = CodecPipeline::parse(spec.substr(6));
    if (!p) return Status::invalid_argument("expert codec '" + spec + "': " + p.status().message() + form);
    if (!p->is_lossless())
      return Status::invalid_argument("expert codec '" + spec +
                                      "': delta: sends exact bit differences; its pipeline must be lossless (raw "
                                      "values, then zstd)" + form);
    out.bit_delta = true;
    out.pipeline = std::move(*p);
    return out;
  }
  const size_t at = spec.find('@');
  std::string rest = spec.substr(0, at);
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
  if (rest.empty())
    return Status::invalid_argument("expert codec '" + spec + "': " +
                                    (at == 0 ? "a pipeline must come before the first '@'" : "no pipeline") + form);
  auto p = CodecPipeline::parse(rest);
  if (!p) return Status::invalid_argument("expert codec '" + spec + "': " + p.status().message() + form);
  out.pipeline = std::move(*p);
  // The schedule: "@STEP:PIPELINE" after the first pipeline, steps increasing.
  for (size_t from = at; from != std::string::npos;) {
    const size_t next = spec.find('@', from + 1);
    const std::string part = spec.substr(from + 1, next == std::string::npos ? std::string::npos : next - from - 1);
    from = next;
    const size_t colon = part.find(':');
    const std::string step = part.substr(0, colon);
    const bool digits = !step.empty() && step.size() <= 12 &&
                        std::all_of(step.begin(), step.end(), [](char c) { return c >= '0' && c <= '9'; });
    const uint64_t from_step = digits ? std::stoull(step) : 0;
    const uint64_t previous = out.later.empty() ? 0 : out.later.back().from_step;
    if (colon == std::string::npos || from_step <= previous) {
      const std::string why = colon == std::string::npos ? "a pipeline after the colon"
                              : !digits                    ? "STEP a training step (up to 12 digits)"
                              : out.later.empty()          ? "STEP a training step of at least 1"
                                                  : "STEP after the previous switch's step " + std::to_string(previous);
      return Status::invalid_argument("expert codec '" + spec + "': '@" + part + "' must be @STEP:PIPELINE with " +
                                      why + form);
    }
    auto later = CodecPipeline::parse(part.substr(colon + 1));
    if (!later)
      return Status::invalid_argument("expert codec '" + spec + "': from step " + step + ": " +
                                      later.status().message() + form);
    out.later.push_back({from_step, std::move(*later)});
  }
  if (out.predict && !out.later.empty())
    return Status::invalid_argument("expert codec '" + spec +
                                    "': pred: takes one pipeline (its velocity gain is that pipeline's density)");
  return out;
}

std::string ExpertCodecSpec::spec() const {
  std::string s = std::string(bit_delta ? "delta:" : "") + (against_base ? "sr:" : "") + (feedback ? "ef:" : "") +
                  (predict ? "pred:" : "") + pipeline.spec();
  for (const Switch& w : later) s += "@" + std::to_string(w.from_step) + ":" + w.pipeline.spec();
  return s;
}

bool ExpertCodecSpec::is_raw() const {
  if (bit_delta || against_base || feedback || !pipeline.is_raw()) return false;
  return std::all_of(later.begin(), later.end(), [](const Switch& w) { return w.pipeline.is_raw(); });
}

const CodecPipeline& ExpertCodecSpec::pipeline_at(uint64_t step) const {
  const CodecPipeline* p = &pipeline;
  for (const Switch& w : later)
    if (step >= w.from_step) p = &w.pipeline;
  return *p;
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
