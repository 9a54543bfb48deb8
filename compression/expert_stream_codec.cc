#include "compression/expert_stream_codec.h"

#include <algorithm>
#include <cstring>

#include "common/check.h"

namespace xd {

namespace {

// delta: a float's bits as an unsigned integer in the floats' order (every
// negative below every positive, -0 just below +0), so a small change of
// the value is a small difference of integers; and back. Branch-free, so
// the loops over a tensor vectorize.
inline uint32_t ordered_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u ^ (static_cast<uint32_t>(static_cast<int32_t>(u) >> 31) | 0x80000000u);
}
inline float from_ordered_bits(uint32_t o) {
  const uint32_t u = o ^ (static_cast<uint32_t>(static_cast<int32_t>(~o) >> 31) | 0x80000000u);
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}
// The difference (mod 2^32) zigzag-coded: small either way, few high bits.
inline uint32_t zigzag(uint32_t d) { return (d << 1) ^ static_cast<uint32_t>(static_cast<int32_t>(d) >> 31); }
inline uint32_t unzigzag(uint32_t z) { return (z >> 1) ^ (0u - (z & 1u)); }

// `n` 32-bit words as four byte planes (every word's lowest byte first,
// then the next), and back: zstd then sees the runs of zero high bytes.
// Plane by plane, so the loops vectorize.
void to_byte_planes(const float* words, size_t n, uint8_t* planes) {
  for (size_t b = 0; b < 4; ++b) {
    uint8_t* plane = planes + b * n;
    for (size_t i = 0; i < n; ++i) {
      uint32_t u;
      std::memcpy(&u, words + i, sizeof u);
      plane[i] = static_cast<uint8_t>(u >> (8 * b));
    }
  }
}
void from_byte_planes(const uint8_t* planes, size_t n, float* words) {
  for (size_t i = 0; i < n; ++i) {
    const uint32_t u = uint32_t(planes[i]) | uint32_t(planes[n + i]) << 8 | uint32_t(planes[2 * n + i]) << 16 |
                       uint32_t(planes[3 * n + i]) << 24;
    std::memcpy(words + i, &u, sizeof u);
  }
}

// held = the float whose ordered bits are held's plus the zigzag-coded
// difference d: the same integer steps on the sender and the receivers.
void advance_bits(float* held, const float* d, size_t n) {
  for (size_t k = 0; k < n; ++k) {
    uint32_t z;
    std::memcpy(&z, d + k, sizeof z);
    held[k] = from_ordered_bits(ordered_bits(held[k]) + unzigzag(z));
  }
}

}  // namespace

ExpertStreamCodec::ExpertStreamCodec(ExpertCodecSpec spec, Traffic traffic, size_t tensor_floats)
    : spec_(std::move(spec)), traffic_(traffic), n_(tensor_floats) {
  XD_CHECK(!spec_.predict || (spec_.feedback && traffic_ == Traffic::kWeights));
  XD_CHECK_MSG(!spec_.bit_delta || traffic_ == Traffic::kWeights, "delta: is for expert weights only");
  gain_ = spec_.predict ? spec_.velocity_gain() : 0.0f;
}

float* ExpertStreamCodec::velocity(uint64_t key) {
  if (!spec_.predict) return nullptr;
  std::vector<float>& v = velocity_[key];
  if (v.empty()) v.assign(n_, 0.0f);
  return v.data();
}

void ExpertStreamCodec::predict(float* held, const float* velocity) const {
  for (size_t k = 0; velocity && k < n_; ++k) held[k] += velocity[k];
}

void ExpertStreamCodec::advance(float* held, float* velocity, const float* d, bool fresh) const {
  predict(held, velocity);
  for (size_t k = 0; k < n_; ++k) correct(held, velocity, k, d[k], fresh);
}

std::vector<float>& ExpertStreamCodec::state(uint64_t key) {
  std::vector<float>& s = state_[key];
  if (s.empty()) s.assign(n_, 0.0f);
  return s;
}

const std::vector<float>* ExpertStreamCodec::find_state(uint64_t key) const {
  auto it = state_.find(key);
  return it == state_.end() ? nullptr : &it->second;
}

void ExpertStreamCodec::pack(const ExpertTensorRef& t, size_t from, size_t count, float* row, PackSums* sums) const {
  const float* x = t.data + from;
  const std::vector<float>* s = spec_.feedback ? find_state(t.key) : nullptr;
  const float* st = s ? s->data() + from : nullptr;
  const auto v = spec_.predict && s ? velocity_.find(t.key) : velocity_.end();
  const float* vt = v != velocity_.end() ? v->second.data() + from : nullptr;
  double signal = 0, residual = 0;
  if (spec_.bit_delta) {
    // Against +0.0 where the receivers hold nothing yet.
    const std::vector<float>* held = find_state(t.key);
    const float* h = held ? held->data() + from : nullptr;
    for (size_t k = 0; k < count; ++k) {
      const uint32_t d = zigzag(ordered_bits(x[k]) - ordered_bits(h ? h[k] : 0.0f));
      std::memcpy(row + k, &d, sizeof d);
      signal += double(x[k]) * x[k];
    }
  } else if (traffic_ == Traffic::kWeights) {
    // The same float operations, in the same order, wherever this runs: the
    // fused and the separate pass pack the same bits.
    const float* base = spec_.against_base && t.base ? t.base + from : nullptr;
    for (size_t k = 0; k < count; ++k) {
      float r = x[k];
      if (base) r -= base[k];
      if (st) r -= st[k];
      if (vt) r -= vt[k];
      row[k] = r;
      signal += double(x[k]) * x[k];
      residual += double(r) * r;
    }
  } else {
    for (size_t k = 0; k < count; ++k) {
      const float r = st ? x[k] + st[k] : x[k];
      row[k] = r;
      residual += double(r) * r;
    }
    signal = residual;
  }
  sums->signal += signal;
  sums->residual += residual;
}

Status ExpertStreamCodec::encode(const std::vector<ExpertTensorRef>& tensors, std::vector<float>* packed,
                                 EncodedTensor* out, ReconstructionError* err, const PackSums* prepacked,
                                 uint64_t step) {
  const bool weights = traffic_ == Traffic::kWeights;
  // With feedback, receivers hold nothing yet the first time: that transfer
  // goes raw and exact, so replicas start from the owners' weights and only
  // changes are compressed after it (both sides see the fresh state).
  bool first = false;
  std::vector<char> fresh(tensors.size(), 0);
  for (size_t i = 0; i < tensors.size(); ++i) {
    fresh[i] = weights && spec_.feedback && !state_.count(tensors[i].key);
    first = first || fresh[i];
  }
  PackSums sums;
  if (prepacked) {
    XD_CHECK(packed->size() == tensors.size() * n_);
    sums = *prepacked;
  } else {
    packed->resize(tensors.size() * n_);
    for (size_t i = 0; i < tensors.size(); ++i) pack(tensors[i], 0, n_, packed->data() + i * n_, &sums);
  }
  out->metadata.clear();
  out->payload.clear();
  if (spec_.is_raw()) return Status::ok();  // exact: no error, no state
  if (spec_.bit_delta) {
    err->signal += sums.signal;
    return encode_bit_delta(tensors, packed, out, step);
  }
  const CodecPipeline& pipeline = spec_.pipeline_at(step);
  const bool sparse = pipeline.is_sparse();
  bool as_packed = pipeline.is_raw() || first, refused = false;
  if (!as_packed) {
    Status encoded = pipeline.encode(packed->data(), {tensors.size(), n_}, out, sparse ? &sparse_ : nullptr);
    if (!encoded.is_ok()) {
      // NaN or Inf where the pipeline refuses them (a step the non-finite
      // guard will skip or stop at): the message goes raw, exactly, as a
      // first one does, and the reconstruction error leaves it out.
      if (!pipeline.refuses_non_finite(packed->data(), packed->size())) return encoded;
      out->metadata.clear();
      out->payload.clear();
      as_packed = refused = true;
    }
  }
  if (!refused) err->signal += sums.signal;
  std::vector<float*> st(tensors.size(), nullptr), vel(tensors.size(), nullptr);
  if (spec_.feedback)
    for (size_t i = 0; i < tensors.size(); ++i) {
      st[i] = state(tensors[i].key).data();
      if (weights) vel[i] = velocity(tensors[i].key);
    }
  if (as_packed) {
    // Sent as packed, exactly: the receivers hold it all, nothing is carried.
    for (size_t i = 0; i < tensors.size() && spec_.feedback; ++i) {
      const float* row = packed->data() + i * n_;
      if (weights)
        advance(st[i], vel[i], row, fresh[i]);
      else
        std::fill(st[i], st[i] + n_, 0.0f);
    }
    return Status::ok();
  }
  // The error-feedback state must be the receivers' to the bit, and the
  // reconstruction error is measured here: a top-k pipeline hands back the
  // entries it kept as the receivers will decode them; anything else the
  // sender decodes from what it sent.
  const float* r = packed->data();
  // A message that keeps every entry (every sign) is its own dense decode:
  // the dense bookkeeping below, without an entry-by-entry walk.
  const bool every_entry = sparse && sparse_.index.size() == packed->size();
  if (sparse && !every_entry) {
    if (!weights)
      for (size_t i = 0; i < tensors.size() && spec_.feedback; ++i) std::copy(r + i * n_, r + (i + 1) * n_, st[i]);
    // The prediction moves every entry; the kept ones are corrected after.
    for (size_t i = 0; i < tensors.size(); ++i) predict(st[i], vel[i]);
    // Only the kept entries differ from dropping everything: the error is
    // the residual's energy less what each kept entry took away.
    double taken = 0;
    for (size_t j = 0; j < sparse_.index.size(); ++j) {
      const uint32_t at = sparse_.index[j];
      const float v = sparse_.value[j];
      const double left = double(r[at]) - v;
      taken += double(r[at]) * r[at] - left * left;
      if (!spec_.feedback) continue;
      const size_t i = at / n_;
      if (weights) correct(st[i], vel[i], at % n_, v, fresh[i]);
      else st[i][at % n_] = r[at] - v;
    }
    err->error += std::max(0.0, sums.residual - taken);
    return Status::ok();
  }
  const float* decoded = sparse_.value.data();
  if (!every_entry) {
    decoded_.resize(packed->size());
    XD_RETURN_IF_ERROR(decode_tensor(out->metadata, out->payload.data(), out->payload.size(), decoded_.data(),
                                     decoded_.size()));
    decoded = decoded_.data();
  }
  for (size_t i = 0; i < tensors.size(); ++i) {
    const float* d = decoded + i * n_;
    const float* row = r + i * n_;
    for (size_t k = 0; k < n_; ++k) {
      const double left = double(row[k]) - d[k];
      err->error += left * left;
      if (spec_.feedback && !weights) st[i][k] = row[k] - d[k];
    }
    if (spec_.feedback && weights) advance(st[i], vel[i], d, fresh[i]);
  }
  return Status::ok();
}

// The receivers will hold exactly the packed weights: move the state there
// by the same integer steps they take, then lay out the byte planes.
Status ExpertStreamCodec::encode_bit_delta(const std::vector<ExpertTensorRef>& tensors, std::vector<float>* packed,
                                           EncodedTensor* out, uint64_t step) {
  for (size_t i = 0; i < tensors.size(); ++i) advance_bits(state(tensors[i].key).data(), packed->data() + i * n_, n_);
  scratch_.resize(packed->size());
  to_byte_planes(packed->data(), packed->size(), reinterpret_cast<uint8_t*>(scratch_.data()));
  const CodecPipeline& pipeline = spec_.pipeline_at(step);
  if (!pipeline.is_raw()) return pipeline.encode(scratch_.data(), {tensors.size(), n_}, out);
  packed->swap(scratch_);  // the planes are the message
  return Status::ok();
}

Status ExpertStreamCodec::receive(const std::vector<ExpertTensorRef>& tensors, const std::vector<float>& packed,
                                  const EncodedTensor& out) {
  if (out.payload.empty() && out.metadata.empty()) {
    if (packed.size() != tensors.size() * n_) return Status::invalid_argument("a raw message of the wrong size");
    apply(tensors, packed.data());
    return Status::ok();
  }
  auto record = parse_codec_record(out.metadata);
  if (!record) return record.status();
  return apply_encoded(tensors, *record, out.payload.data(), out.payload.size());
}

void ExpertStreamCodec::apply(const std::vector<ExpertTensorRef>& tensors, const float* decoded) {
  if (spec_.bit_delta) {
    scratch_.resize(tensors.size() * n_);
    from_byte_planes(reinterpret_cast<const uint8_t*>(decoded), scratch_.size(), scratch_.data());
    for (size_t i = 0; i < tensors.size(); ++i) {
      std::vector<float>& held = state(tensors[i].key);
      advance_bits(held.data(), scratch_.data() + i * n_, n_);
      std::memcpy(tensors[i].data, held.data(), n_ * sizeof(float));
    }
    return;
  }
  for (size_t i = 0; i < tensors.size(); ++i) {
    const ExpertTensorRef& t = tensors[i];
    const float* d = decoded + i * n_;
    if (traffic_ == Traffic::kGradients) {
      for (size_t k = 0; k < n_; ++k) t.data[k] += d[k];
      continue;
    }
    const float* base = spec_.against_base ? t.base : nullptr;
    if (spec_.feedback) {
      const bool fresh = !state_.count(t.key);
      std::vector<float>& s = state(t.key);
      advance(s.data(), velocity(t.key), d, fresh);
      for (size_t k = 0; k < n_; ++k) t.data[k] = (base ? base[k] : 0.0f) + s[k];
      rebuilt_[t.key] = t.base_version + 1;
    } else if (base) {
      for (size_t k = 0; k < n_; ++k) t.data[k] = base[k] + d[k];
    } else {
      std::memcpy(t.data, d, n_ * sizeof(float));
    }
  }
}

void ExpertStreamCodec::apply_sparse(const std::vector<ExpertTensorRef>& tensors, const SparseTensor& decoded) {
  const size_t entries = decoded.index.size();
  if (traffic_ == Traffic::kGradients) {
    for (size_t j = 0; j < entries; ++j)
      tensors[decoded.index[j] / n_].data[decoded.index[j] % n_] += decoded.value[j];
    return;
  }
  std::vector<float*> st(tensors.size(), nullptr), vel(tensors.size(), nullptr);
  if (spec_.feedback) {
    std::vector<char> fresh(tensors.size(), 0);
    for (size_t i = 0; i < tensors.size(); ++i) {
      fresh[i] = !state_.count(tensors[i].key);
      st[i] = state(tensors[i].key).data();
      vel[i] = velocity(tensors[i].key);
      predict(st[i], vel[i]);  // every entry, as the sender's encode did
    }
    for (size_t j = 0; j < entries; ++j) {
      const size_t i = decoded.index[j] / n_;
      correct(st[i], vel[i], decoded.index[j] % n_, decoded.value[j], fresh[i]);
    }
    // A replica last rebuilt against this base changes only where `held`
    // did (with pred:, everywhere).
    std::vector<char> current(tensors.size(), 0);
    for (size_t i = 0; i < tensors.size(); ++i) {
      const ExpertTensorRef& t = tensors[i];
      uint64_t& at = rebuilt_[t.key];
      current[i] = at == t.base_version + 1 && !vel[i];
      if (current[i]) continue;
      const float* base = spec_.against_base ? t.base : nullptr;
      for (size_t k = 0; k < n_; ++k) t.data[k] = (base ? base[k] : 0.0f) + st[i][k];
      at = t.base_version + 1;
    }
    for (size_t j = 0; j < entries; ++j) {
      const size_t i = decoded.index[j] / n_, k = decoded.index[j] % n_;
      if (!current[i]) continue;
      const float* base = spec_.against_base ? tensors[i].base : nullptr;
      tensors[i].data[k] = (base ? base[k] : 0.0f) + st[i][k];
    }
    return;
  }
  for (size_t i = 0; i < tensors.size(); ++i) {
    const ExpertTensorRef& t = tensors[i];
    if (spec_.against_base && t.base) {
      // base + 0.0f, as the dense path adds a decoded zero (a -0.0 base entry becomes +0.0).
      for (size_t k = 0; k < n_; ++k) t.data[k] = t.base[k] + 0.0f;
    } else {
      std::memset(t.data, 0, n_ * sizeof(float));
    }
  }
  for (size_t j = 0; j < entries; ++j) {
    const ExpertTensorRef& t = tensors[decoded.index[j] / n_];
    const size_t k = decoded.index[j] % n_;
    const float* base = spec_.against_base ? t.base : nullptr;
    t.data[k] = (base ? base[k] : 0.0f) + decoded.value[j];
  }
}

Status ExpertStreamCodec::apply_encoded(const std::vector<ExpertTensorRef>& tensors, const CodecRecord& record,
                                        const uint8_t* payload, size_t payload_bytes) {
  if (record.shape.rows != tensors.size() || record.shape.cols != n_)
    return Status::invalid_argument("an encoded message of " + std::to_string(record.shape.rows) + "x" +
                                    std::to_string(record.shape.cols) + " for " + std::to_string(tensors.size()) +
                                    " tensors of " + std::to_string(n_));
  // A top-k message that keeps every entry takes the dense path, which
  // applies the same float operations to every entry.
  if (is_sparse(record) && record.stages.front().kept < record.shape.elements()) {
    XD_RETURN_IF_ERROR(decode_sparse(record, payload, payload_bytes, &sparse_));
    apply_sparse(tensors, sparse_);
    return Status::ok();
  }
  decoded_.resize(tensors.size() * n_);
  XD_RETURN_IF_ERROR(decode_tensor(record, payload, payload_bytes, decoded_.data(), decoded_.size()));
  apply(tensors, decoded_.data());
  return Status::ok();
}

}  // namespace xd
