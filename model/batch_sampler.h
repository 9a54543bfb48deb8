// BatchSampler: draws (inputs, targets) training windows from a token vector.
//
// Batch i is a pure function of (seed, i, global row): each row's window offset
// is a hash, not the output of a running RNG. That buys two promises:
//   * Resuming: set_position(p) is O(1), and the batches that follow are exactly
//     the ones an uninterrupted run would have drawn after p batches.
//   * Sharding: worker `shard` of `num_shards` draws global rows
//     shard*batch_size .. shard*batch_size + batch_size-1, so the shards' rows
//     are disjoint and their union, in shard order, is bit-identical to what one
//     sampler with batch_size*num_shards rows and num_shards = 1 draws.
// Offsets are drawn with replacement (rows of a batch may overlap by chance).
//
// The token vector is shared and never modified. One sampler is not safe for
// concurrent next() calls; const members are. Constructor preconditions are
// XD_CHECKed: call validate() first to turn bad user input into a Status.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "common/status.h"

namespace xd {

class BatchSampler {
 public:
  BatchSampler(std::shared_ptr<const std::vector<int32_t>> tokens, int batch_size, int seq_len,
               uint64_t seed, int shard = 0, int num_shards = 1);

  // invalid_argument naming the offending value, or ok when the constructor's
  // preconditions hold (positive sizes, 0 <= shard < num_shards, and at least
  // seq_len + 1 tokens so one window fits).
  static Status validate(size_t num_tokens, int batch_size, int seq_len, int shard,
                         int num_shards);

  // Resizes both outputs to batch_size * seq_len (row-major, one row per window)
  // and advances position(). targets[r][t] = inputs[r][t + 1] within a window of
  // seq_len + 1 tokens, i.e. next-token prediction targets.
  void next(std::vector<int32_t>* inputs, std::vector<int32_t>* targets);

  // Number of batches drawn so far; checkpoint it and set_position() on resume.
  uint64_t position() const { return position_; }
  void set_position(uint64_t position) { position_ = position; }

  // Start of the window that local row `local_row` of batch `batch_index` reads.
  size_t window_offset(uint64_t batch_index, int local_row) const;


 private:
  std::shared_ptr<const std::vector<int32_t>> tokens_;
  int batch_size_;
  int seq_len_;
  uint64_t seed_;
  int shard_;
  int num_shards_;
  uint64_t position_ = 0;
};

}  // namespace xd
