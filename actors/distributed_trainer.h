// DistributedTrainer: one worker's share of an EP / HybridEP training job.
// Experts are sharded (E/G per worker, worker r owns [r E/G, (r+1) E/G));
// dense parameters are replicated and their gradients all-reduced
// hierarchically; each worker reads its own shard of every global batch.
// Dispatch/Combine go through a HybridExpertExchange, gathered experts and
// their gradients through an ExpertCommunicator. The arithmetic is the one of
// a single process on the global batch: per-worker losses are means over local
// tokens, gradients are summed and divided by G. (Router load-balancing
// statistics are per worker batch, as in Megatron, so the aux loss is the one
// of the local batch.) Runs on the worker's compute thread; not thread-safe.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "actors/expert_communicator.h"
#include "actors/hybrid_exchange.h"
#include "cluster/job_config.h"
#include "cluster/protocol.h"
#include "model/adamw.h"
#include "model/batch_sampler.h"
#include "model/moe_transformer.h"
#include "transport/communicator.h"

namespace xd {

struct DistributedOptions {
  int rank = 0;
  std::vector<int> level_sizes;
  std::vector<int> domain_sizes;     // S^l; all 1 = EP
  bool flat_ep = false;              // one-hop all-to-all instead of per level (EP only)
  std::vector<std::string> link_names;  // per level, for the byte counters
  double predicted_step_s = 0;
  double memory_cap_bytes = 0;       // 0: no cap
  std::chrono::milliseconds timeout = std::chrono::seconds(120);
};

class DistributedTrainer {
 public:
  static Expected<std::unique_ptr<DistributedTrainer>> create(const JobConfig& job,
                                                              const DistributedOptions& options,
                                                              Transport* transport);
  ~DistributedTrainer();

  // One training step; the metrics are this worker's.
  Expected<StepMetrics> step();
  int64_t current_step() const { return step_; }
  // Writes this worker's parameters -- the replicated dense ones and its own
  // experts, under their HF names -- to <dir>/shard-<rank>-of-<G>.safetensors.
  Status save_shard(const std::string& dir) const;
  MoeTransformer<float>& model() { return *model_; }
  size_t replica_bytes() const { return comm_->replica_bytes(); }
  ExpertCommunicator& expert_communicator() { return *comm_; }

 private:
  DistributedTrainer() = default;
  Status reduce_dense_gradients(double* expert_norm_sq);
  // Bytes per link class and operation, and total communication time, of
  // the step just taken (one transport snapshot).
  void record_link_figures(StepMetrics* m);

  JobConfig job_;
  DistributedOptions opts_;
  Transport* transport_ = nullptr;
  int world_ = 1;
  std::unique_ptr<ParamLayout> layout_;
  std::unique_ptr<MoeTransformer<float>> model_;
  std::unique_ptr<AdamW<float>> optimizer_;
  std::unique_ptr<BatchSampler> sampler_;
  // Before comm_: its thread runs the SR base all-reduce on them.
  std::unique_ptr<Communicator> inner_, outer_;
  std::unique_ptr<HybridExpertExchange> exchange_;
  std::unique_ptr<ExpertCommunicator> comm_;
  std::vector<std::pair<size_t, size_t>> dense_ranges_;  // [begin, end) of replicated params
  size_t dense_count_ = 0;
  std::vector<std::pair<size_t, size_t>> expert_ranges_;
  std::vector<float> dense_buffer_;
  bool dense_inner_bf16_ = false, dense_outer_bf16_ = false;  // dense_grad codecs (bf16 or fp32)
  int64_t step_ = 0;
  std::vector<int32_t> inputs_, targets_;
  std::vector<double> gather_wait_;
  TransportStats last_stats_;
};

}  // namespace xd
