#include "actors/detail/dense_all_reduce.h"

#include <cmath>
#include <vector>

#include "compression/bfloat16.h"
#include "common/clock.h"
#include "compression/codec.h"

namespace xd::detail {

namespace {

std::vector<size_t> split(size_t count, int n) {
  std::vector<size_t> counts(n, count / n);
  for (size_t i = 0; i < count % n; ++i) counts[i]++;
  return counts;
}

std::vector<size_t> offsets(const std::vector<size_t>& counts) {
  std::vector<size_t> off(counts.size() + 1, 0);
  for (size_t i = 0; i < counts.size(); ++i) off[i + 1] = off[i] + counts[i];
  return off;
}

// A tag that names its own traffic kind (e.g. kExpertBase) keeps it for
// every stage, so its bytes are counted apart from the dense gradients'.
CollectiveTag stage(const CollectiveTag& tag, uint16_t n, MessageKind traffic) {
  return CollectiveTag(tag.step, tag.layer, static_cast<uint16_t>(tag.phase * 8 + n), tag.traffic.value_or(traffic));
}

// floats_to_bf16, timed; when `measured` (the values are sent), with their
// rounding error.
void cast_to_bf16(const float* in, size_t n, uint16_t* out, StageCast* cast, bool measured = true) {
  const double t0 = thread_cpu_seconds();
  double error = 0, signal = 0;
  if (measured) floats_to_bf16(in, n, out, &error, &signal);
  else floats_to_bf16(in, n, out);
  cast->seconds.encode += thread_cpu_seconds() - t0;
  cast->error += error, cast->signal += signal;
}

// bf16_to_floats, timed.
void cast_to_floats(const uint16_t* in, size_t n, float* out, StageCast* cast) {
  const double t0 = thread_cpu_seconds();
  bf16_to_floats(in, n, out);
  cast->seconds.decode += thread_cpu_seconds() - t0;
}

// Member i's block of `data` (counts[i] floats) ends, summed over the group,
// at member i. The partials cross in bf16; the own partial stays fp32.
Status bf16_reduce_scatter(Communicator* c, const CollectiveTag& tag, float* data, const std::vector<size_t>& counts,
                           StageCast* cast) {
  const int n = c->size(), me = c->index();
  const std::vector<size_t> off = offsets(counts);
  std::vector<uint16_t> send(off.back()), recv(counts[me] * n);
  // The own block is cast alike but never sent: no error counted for it.
  cast_to_bf16(data, off[me], send.data(), cast);
  cast_to_bf16(data + off[me], counts[me], send.data() + off[me], cast, /*measured=*/false);
  cast_to_bf16(data + off[me + 1], off.back() - off[me + 1], send.data() + off[me + 1], cast);
  std::vector<size_t> send_bytes(n), recv_bytes(n, counts[me] * sizeof(uint16_t));
  for (int i = 0; i < n; ++i) send_bytes[i] = counts[i] * sizeof(uint16_t);
  XD_RETURN_IF_ERROR(c->all_to_allv(tag, send.data(), send_bytes, recv.data(), recv_bytes).wait());
  float* own = data + off[me];
  std::vector<float> partial(counts[me]);
  for (int i = 0; i < n && counts[me] > 0; ++i) {  // a fixed order: the sum is the same on every run
    if (i == me) continue;
    cast_to_floats(&recv[i * counts[me]], counts[me], partial.data(), cast);
    for (size_t k = 0; k < counts[me]; ++k) own[k] += partial[k];
  }
  return Status::ok();
}

// Each member's block, rounded to bf16, goes to everyone; every member,
// the owner too, ends with the rounded values.
Status bf16_all_gather(Communicator* c, const CollectiveTag& tag, float* data, const std::vector<size_t>& counts,
                       StageCast* cast) {
  const int me = c->index();
  const std::vector<size_t> off = offsets(counts);
  std::vector<uint16_t> mine(counts[me]), all(off.back());
  cast_to_bf16(data + off[me], counts[me], mine.data(), cast);
  std::vector<size_t> bytes(counts.size());
  for (size_t i = 0; i < counts.size(); ++i) bytes[i] = counts[i] * sizeof(uint16_t);
  XD_RETURN_IF_ERROR(c->all_gatherv(tag, mine.data(), all.data(), bytes).wait());
  cast_to_floats(all.data(), all.size(), data, cast);
  return Status::ok();
}

// The one-round all-reduce (Communicator::one_shot_all_reduce) in bf16:
// every member's buffer, rounded to bf16, goes to every other, and each sums
// all of them in member order in fp32, its own rounded too: the same bits
// everywhere.
Status bf16_one_shot(Communicator* c, const CollectiveTag& tag, float* data, size_t count, StageCast* cast) {
  const int n = c->size();
  std::vector<uint16_t> mine(count), all(count * n);
  cast_to_bf16(data, count, mine.data(), cast);
  XD_RETURN_IF_ERROR(c->all_gatherv(tag, mine.data(), all.data(), std::vector<size_t>(n, count * sizeof(uint16_t))).wait());
  std::vector<float> member(count);
  cast_to_floats(all.data(), count, data, cast);
  for (int i = 1; i < n; ++i) {
    cast_to_floats(&all[i * count], count, member.data(), cast);
    for (size_t k = 0; k < count; ++k) data[k] += member[k];
  }
  return Status::ok();
}

// The outer stage with sign-coded changes (dense_all_reduce.h, outer_sign).
// `cast` gains the coding's time and, as its error, how far the copy the
// members hold of this member's partial is from it.
Status sign_delta_exchange(Communicator* c, const CollectiveTag& tag, float* data, size_t count, SignDeltaState* s,
                           StageCast* cast) {
  const int n = c->size(), me = c->index();
  if (s->held.size() != static_cast<size_t>(n) || s->held[me].size() != count) {
    // The first exchange: every partial exactly.
    std::vector<float> all(count * n);
    XD_RETURN_IF_ERROR(c->all_gatherv(tag, data, all.data(), std::vector<size_t>(n, count * sizeof(float))).wait());
    s->held.assign(n, {});
    for (int i = 0; i < n; ++i) s->held[i].assign(all.begin() + i * count, all.begin() + (i + 1) * count);
  } else if (count > 0) {
    constexpr size_t kCols = 1024;  // a scale per 1024 entries
    const size_t rows = (count + kCols - 1) / kCols;
    std::vector<float> change(rows * kCols, 0.0f);
    // A non-finite change is sent as 0, so that no member's encode fails
    // alone and leaves the others waiting in the exchange (a non-finite
    // weight reaches the base through the exact first exchange, on every
    // member alike, as in the bf16 path).
    for (size_t k = 0; k < count; ++k) {
      const float d = data[k] - s->held[me][k];
      change[k] = std::isfinite(d) ? d : 0.0f;
    }
    static const CodecPipeline kSigns = *CodecPipeline::parse("block_sign:1:1024");
    EncodedTensor mine;
    double t0 = thread_cpu_seconds();
    XD_RETURN_IF_ERROR(kSigns.encode(change.data(), {rows, kCols}, &mine));
    cast->seconds.encode += thread_cpu_seconds() - t0;
    // Every member's message has this shape, so this record and size.
    auto record = parse_codec_record(mine.metadata);
    if (!record) return record.status();
    const size_t bytes = mine.payload.size();
    std::vector<uint8_t> all(bytes * n);
    XD_RETURN_IF_ERROR(c->all_gatherv(tag, mine.payload.data(), all.data(), std::vector<size_t>(n, bytes)).wait());
    std::vector<float> decoded(change.size());
    t0 = thread_cpu_seconds();
    for (int i = 0; i < n; ++i) {
      XD_RETURN_IF_ERROR(decode_tensor(*record, all.data() + i * bytes, bytes, decoded.data(), decoded.size()));
      float* held = s->held[i].data();
      for (size_t k = 0; k < count; ++k) held[k] += decoded[k];
    }
    cast->seconds.decode += thread_cpu_seconds() - t0;
  }
  double error = 0, signal = 0;
  for (size_t k = 0; k < count; ++k) {
    if (!std::isfinite(data[k])) continue;
    const double d = double(data[k]) - s->held[me][k];
    error += d * d;
    signal += double(data[k]) * data[k];
  }
  cast->error += error;
  cast->signal += signal;
  for (size_t k = 0; k < count; ++k) {  // member order: the same bits everywhere
    float sum = 0.0f;
    for (int i = 0; i < n; ++i) sum += s->held[i][k];
    data[k] = sum;
  }
  return Status::ok();
}

// Copies half updated by a failed exchange must not be used again: the next
// call starts over with an exact exchange.
Status sign_delta_one_shot(Communicator* c, const CollectiveTag& tag, float* data, size_t count, SignDeltaState* s,
                           StageCast* cast) {
  Status st = sign_delta_exchange(c, tag, data, count, s, cast);
  if (!st.is_ok()) s->held.clear();
  return st;
}

}  // namespace

Status dense_all_reduce(Communicator* inner, Communicator* outer, DenseWirePrecision p, const CollectiveTag& tag,
                        float* data, size_t count, CastFigures* figures) {
  CastFigures unused;
  StageCast* inner_cast = figures ? &figures->inner : &unused.inner;
  StageCast* outer_cast = figures ? &figures->outer : &unused.outer;
  if (!p.inner_bf16 && !p.outer_bf16 && !p.outer_sign)
    return hierarchical_all_reduce(inner, outer, tag, data, count).wait();
  // Nothing across: the inner group's all-reduce, in one round when it pays.
  if (outer->size() == 1 && inner->size() > 1 && Communicator::one_shot_all_reduce(inner->size(), count * sizeof(float)))
    return p.inner_bf16 ? bf16_one_shot(inner, stage(tag, 4, MessageKind::kAllReduce), data, count, inner_cast)
                        : inner->ring_all_reduce_now(tag, 10, data, count);
  const std::vector<size_t> counts = split(count, inner->size());
  const std::vector<size_t> off = offsets(counts);
  if (inner->size() > 1) {
    if (p.inner_bf16)
      XD_RETURN_IF_ERROR(
          bf16_reduce_scatter(inner, stage(tag, 0, MessageKind::kReduceScatter), data, counts, inner_cast));
    else XD_RETURN_IF_ERROR(inner->reduce_scatter_now(tag, 10, data, counts));
  }
  float* shard = data + off[inner->index()];
  const size_t shard_count = counts[inner->index()];
  if (outer->size() > 1) {
    if (p.outer_sign) {
      XD_RETURN_IF_ERROR(sign_delta_one_shot(outer, stage(tag, 5, MessageKind::kAllReduce), shard, shard_count,
                                             p.outer_sign, outer_cast));
    } else if (p.outer_bf16 && Communicator::one_shot_all_reduce(outer->size(), shard_count * sizeof(float))) {
      XD_RETURN_IF_ERROR(bf16_one_shot(outer, stage(tag, 1, MessageKind::kAllReduce), shard, shard_count, outer_cast));
    } else if (p.outer_bf16) {
      const std::vector<size_t> parts = split(shard_count, outer->size());
      XD_RETURN_IF_ERROR(
          bf16_reduce_scatter(outer, stage(tag, 1, MessageKind::kReduceScatter), shard, parts, outer_cast));
      XD_RETURN_IF_ERROR(bf16_all_gather(outer, stage(tag, 2, MessageKind::kAllReduce), shard, parts, outer_cast));
    } else {
      XD_RETURN_IF_ERROR(outer->ring_all_reduce_now(tag, 6, shard, shard_count));
    }
  }
  if (inner->size() > 1) {
    if (p.inner_bf16) return bf16_all_gather(inner, stage(tag, 3, MessageKind::kAllReduce), data, counts, inner_cast);
    std::vector<size_t> bytes(counts.size());
    for (size_t i = 0; i < counts.size(); ++i) bytes[i] = counts[i] * sizeof(float);
    return inner->all_gatherv_now(tag, 11, MessageKind::kAllReduce, data, bytes);
  }
  return Status::ok();
}

}  // namespace xd::detail
