#include "model/batch_sampler.h"

#include <string>
#include <utility>

#include "common/check.h"
#include "common/rng.h"

namespace xd {

Status BatchSampler::validate(size_t num_tokens, int batch_size, int seq_len, int shard,
                              int num_shards) {
  if (batch_size <= 0) {
    return Status::invalid_argument("batch_size must be positive, got " +
                                    std::to_string(batch_size));
  }
  if (seq_len <= 0) {
    return Status::invalid_argument("seq_len must be positive, got " + std::to_string(seq_len));
  }
  if (num_shards <= 0) {
    return Status::invalid_argument("num_shards must be positive, got " +
                                    std::to_string(num_shards));
  }
  if (shard < 0 || shard >= num_shards) {
    return Status::invalid_argument("shard " + std::to_string(shard) + " is outside 0.." +
                                    std::to_string(num_shards - 1));
  }
  // A window holds seq_len inputs plus the one extra token the last target needs.
  if (num_tokens < static_cast<size_t>(seq_len) + 1) {
    return Status::invalid_argument("need at least seq_len + 1 = " +
                                    std::to_string(static_cast<int64_t>(seq_len) + 1) + " tokens, have " +
                                    std::to_string(num_tokens));
  }
  return Status::ok();
}

BatchSampler::BatchSampler(std::shared_ptr<const std::vector<int32_t>> tokens, int batch_size,
                           int seq_len, uint64_t seed, int shard, int num_shards)
    : tokens_(std::move(tokens)),
      batch_size_(batch_size),
      seq_len_(seq_len),
      seed_(seed),
      shard_(shard),
      num_shards_(num_shards) {
  XD_CHECK_MSG(tokens_ != nullptr, "BatchSampler needs a token vector");
  const Status status = validate(tokens_->size(), batch_size, seq_len, shard, num_shards);
  XD_CHECK_MSG(status.is_ok(), status.message().c_str());
}

size_t BatchSampler::window_offset(uint64_t batch_index, int local_row) const {
  XD_CHECK(local_row >= 0 && local_row < batch_size_);
  // The global row, not (shard, local row), enters the hash: that is what makes
  // G shards of B rows identical to one sampler of G*B rows. The hash is chained
  // because a flat seed ^ batch ^ row would give (batch 1, row 0) and
  // (batch 0, row 1) the same window.
  const uint64_t global_row =
      static_cast<uint64_t>(shard_) * static_cast<uint64_t>(batch_size_) +
      static_cast<uint64_t>(local_row);
  const uint64_t hash = splitmix64(splitmix64(splitmix64(seed_) ^ batch_index) ^ global_row);
  // Offsets 0 .. size - seq_len - 1 keep the whole seq_len + 1 window in range.
  const uint64_t num_offsets = tokens_->size() - static_cast<size_t>(seq_len_);
  return static_cast<size_t>(hash % num_offsets);
}

void BatchSampler::next(std::vector<int32_t>* inputs, std::vector<int32_t>* targets) {
  XD_CHECK(inputs != nullptr && targets != nullptr);
  const size_t row_len = static_cast<size_t>(seq_len_);
  inputs->resize(static_cast<size_t>(batch_size_) * row_len);
  targets->resize(inputs->size());
  const int32_t* data = tokens_->data();
  for (int row = 0; row < batch_size_; ++row) {
    const int32_t* window = data + window_offset(position_, row);
    int32_t* input_row = inputs->data() + static_cast<size_t>(row) * row_len;
    int32_t* target_row = targets->data() + static_cast<size_t>(row) * row_len;
    for (size_t t = 0; t < row_len; ++t) {
      input_row[t] = window[t];
      target_row[t] = window[t + 1];
    }
  }
  ++position_;
}

}  // namespace xd
