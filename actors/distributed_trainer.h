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
//
// Overlap (docs/overlap.md): the exchange runs Dispatch/Combine on its comm
// threads while the model computes (job.train.farskip.overlapped), each
// layer's replica gradients leave as soon as its expert backward is done, and
// the dense gradients are all-reduced in per-layer buckets as backward
// finishes them. Each step reports, per direction, the time the links were
// busy, the time compute waited for them, and the step's bound.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "actors/expert_communicator.h"
#include "actors/hybrid_exchange.h"
#include "cluster/job_config.h"
#include "cluster/protocol.h"
#include "model/adamw.h"
#include "model/batch_sampler.h"
#include "model/distributed_checkpoint.h"
#include "model/moe_transformer.h"
#include "common/timeline.h"
#include "transport/communicator.h"

namespace xd {

namespace detail {
class GradientBuckets;
}

struct DistributedOptions {
  int rank = 0;
  std::vector<int> level_sizes;
  std::vector<int> domain_sizes;     // S^l; all 1 = EP
  bool flat_ep = false;              // one-hop all-to-all instead of per level (EP only)
  std::vector<std::string> link_names;  // per level, for the byte counters
  double predicted_step_s = 0;
  double memory_cap_bytes = 0;       // 0: no cap
  // Polled at every step boundary, on the trainer's thread: a plan update the
  // coordinator sent (thread-safe on the caller's side); empty: none.
  std::function<std::optional<PlanUpdate>()> take_plan;
  std::chrono::milliseconds timeout = std::chrono::seconds(120);
  // A checkpoint (either kind, any world size) to start from: this worker
  // takes its experts' slices, the dense parameters, the AdamW moments, the
  // step and the data position. Empty: a fresh start.
  std::string resume_dir;
};

// One worker's step, cut where its link figures are cut. Window 1 runs from
// the previous step's optimizer step (which sends this step's expert
// all-gather) to the end of the forward pass; window 2 from there to this
// step's optimizer step. Times are seconds.
struct StepPhases {
  double previous_optimizer_s = 0;  // the previous step's optimizer step (0 on the first)
  double forward_compute_s = 0;     // the forward pass less its waits
  double forward_link_s = 0;        // the busiest link class's transmit time in window 1
  double backward_compute_s = 0;    // the rest of the step less its waits, optimizer included
  double optimizer_s = 0;           // this step's optimizer step
  double backward_link_s = 0;       // the busiest link class's transmit time in window 2
};

// The step's floor by phase. A phase's traffic cannot use the other phase's
// idle link: the all-gather needs the optimizer step's weights, the replica
// gradients and dense buckets exist only once backward has made them. So
// window 1 lasts at least max(previous optimizer + forward compute, its link
// time), window 2 at least max(backward compute less the optimizer, its link
// time), and the step is window 1 + window 2 - the previous optimizer step +
// this one. Never below max(compute, link); above it when one phase's traffic
// outlasts that phase's compute while the other's link idles.
double phase_floor_seconds(const StepPhases& p);

class DistributedTrainer {
 public:
  static Expected<std::unique_ptr<DistributedTrainer>> create(const JobConfig& job,
                                                              const DistributedOptions& options,
                                                              Transport* transport);
  ~DistributedTrainer();

  // One training step; the metrics are this worker's. A non-finite loss or
  // gradient stops with an error naming the tensor, or with nan_policy
  // "skip" leaves the weights unchanged (StepMetrics::skipped); every worker
  // decides alike, from the all-reduced gradient norm.
  Expected<StepMetrics> step();
  int64_t current_step() const { return step_; }
  uint64_t data_position() const { return sampler_->position(); }
  // Writes this worker's shard of a distributed checkpoint into `dir`
  // (model/distributed_checkpoint.h): its experts, the dense parameters on
  // rank 0, and their AdamW moments.
  Expected<ShardRecord> save_checkpoint_shard(const std::string& dir) const;
  MoeTransformer<float>& model() { return *model_; }
  size_t replica_bytes() const { return comm_->replica_bytes(); }
  ExpertCommunicator& expert_communicator() { return *comm_; }
  // Whether backward now computes the replicas' weight gradients late.
  bool replica_weights_late() const {
    return job_.cluster.expert_parallel.replica_weight_gradients == ReplicaWeightGradients::kLate;
  }

 private:
  DistributedTrainer() = default;
  // Builds the exchange and the expert communicator for `topo`'s domains and
  // wires them into the model (at creation, and at a plan switch that
  // changes the domains).
  Status wire_experts(const Topology& topo);
  // The model's backward hooks for communicator `c` and the job's
  // replica_weight_gradients.
  void wire_backward_hooks(ExpertCommunicator* c);
  // A plan update that keeps the domains keeps the exchange and the
  // communicator, and with them the lossy codecs' state (error feedback,
  // the SR base): only the schedule changes, so the math does not.
  bool rebuilds_experts(const PlanUpdate& plan) const { return plan.domain_sizes != opts_.domain_sizes; }
  // Runs the next steps with a plan update's domains and schedule.
  Status switch_plan(const PlanUpdate& plan);
  // Waits for the replica gradients, sums the owned experts' squared norm
  // over the world (hierarchical_sum) beside the dense buckets, unless
  // backward started that already, waits for both and scales everything by
  // 1/G.
  Status reduce_dense_gradients(double* expert_norm_sq);
  // Starts the sum of the owned experts' squared norm, once a step: from
  // backward when nothing comes back to the owned experts (no replicas) and
  // the schedule overlaps, as soon as the last layer's are final; otherwise
  // from reduce_dense_gradients. A non-finite local loss (loss_finite_)
  // makes the sum NaN on every worker.
  void start_norm_sum();
  static constexpr uint16_t kNormSumPhase = 3;  // the norm's tag, apart from the buckets' and the SR base's
  // Bytes per link class and operation, and total communication time, of
  // the step just taken: from the last step's `now` to this one's, taken
  // before the optimizer step (which sends the next step's all-gather);
  // `mid` is the one taken when backward began.
  // Returns the busiest link class's transmit time before and after `mid`.
  std::pair<double, double> record_link_figures(const TransportStats& mid, TransportStats now, StepMetrics* m);
  void record_codec_figures(StepMetrics* m);  // bytes before the codecs, codec time and NMSE
  // Takes this worker's share of a checkpoint (options.resume_dir).
  Status resume(const std::string& dir);
  // Names the tensors whose gradient is not finite on this worker (for the log).
  std::string non_finite_gradients() const;
  // Whether step (1-based) is one of train.trace_steps.
  bool traces(int64_t step) const;
  // Writes the traced step's spans as a Chrome trace (trace_dir).
  void write_trace(int64_t step);

  JobConfig job_;
  DistributedOptions opts_;
  Transport* transport_ = nullptr;
  Timeline timeline_;  // before every thread that records into it
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
  std::vector<std::pair<size_t, size_t>> expert_ranges_;
  std::unique_ptr<detail::GradientBuckets> buckets_;  // after inner_/outer_: it uses them
  int64_t step_ = 0;
  int skipped_in_a_row_ = 0;
  double norm_wait_s_ = 0;  // reduce_dense_gradients' wait for the norm's sum, this step
  double last_optimizer_s_ = 0;  // the previous step's optimizer step (StepPhases)
  std::vector<int> cpus_;        // the CPUs this process may run on, read at creation (StepMetrics::cpus)
  std::string machine_;          // this machine's id (StepMetrics::machine)
  bool loss_finite_ = true;     // this step's local loss
  bool norm_sum_started_ = false;  // this step's; step() clears it before backward
  double norm_sum_ = 0;         // the local squared norm, then the sum (norm_sum_handle_)
  CollectiveHandle norm_sum_handle_;
  std::vector<int32_t> inputs_, targets_;
  std::vector<double> gather_wait_;
  TransportStats last_stats_;
  std::optional<PlanUpdate> next_plan_;
};

}  // namespace xd
