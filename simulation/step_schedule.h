// StepSchedule: what one worker does in one training step, in order -- compute
// spans, the communications it starts, and where it waits for them -- taken
// from the code that runs the job rather than written out a second time.
//
// record_step_schedule() runs MoeTransformer's real forward and backward on a
// miniature of the job's model (same layers, connectivity, gating, shared
// experts, pipeline degree; tiny widths) through a recording ExpertExchange,
// with the trainer's backward hooks and its expert resolver. Every exchange
// start and finish, every compute span the model marks and the first
// gathered-expert lookup of each layer land in the schedule in the order the
// runtime makes them. The trainer's own part of a step is added around it as
// DistributedTrainer does it: the expert all-gathers of every layer start
// before the forward, a layer's replica gradients leave when its expert
// backward is done (overlapped with replicas, the owned experts'
// weight gradients wait until the end of backward), dense-gradient buckets leave as backward finishes them
// (at the end when not overlapped), and the expert gradients' norm is summed
// once the replica gradients are home, beside the buckets. Durations and bytes are not part of the schedule: the
// simulator (simulation/simgrid_replay.h) prices them from the planner's
// Workload. The same miniature run therefore changes whenever the model's
// schedule does, and a test compares it with a traced real run.
// Pure function; thread-safe (each call builds its own miniature model).
#pragma once

#include <string>
#include <vector>

#include "common/status.h"
#include "model/model_config.h"
#include "model/param_layout.h"

namespace xd {

// What a communication moves. Values are stable (they appear in output).
enum class CommKind : int {
  kDispatch = 0,          // tokens to experts (forward)
  kCombine = 1,           // expert outputs back (forward)
  kCombineBackward = 2,   // output gradients to experts
  kDispatchBackward = 3,  // input gradients back
  kExpertGather = 4,      // HybridEP all-gather of a layer's experts
  kReplicaGradients = 5,  // their gradients back to the owners
  kDenseBucket = 6,       // one bucket of the dense-gradient all-reduce
  kNormSum = 7,           // the expert gradients' norm, summed over every worker
};
const char* comm_kind_name(CommKind k);

// Which thread of the worker moves it. Each is first in, first out, as the
// runtime's comm threads are: HybridExpertExchange's two, ExpertCommunicator's,
// the dense buckets' (bucket b on kDenseStream + b mod kDenseBucketThreads),
// and the norm's sum (a collective thread of its own).
constexpr int kToExpertsStream = 0, kToSourcesStream = 1, kExpertsStream = 2, kDenseStream = 3;
constexpr int kNormStream = kDenseStream + kDenseBucketThreads;
constexpr int kNumCommStreams = kNormStream + 1;

// The compute a span stands for; the simulator gives each a duration.
enum class ComputeKind : int {
  kAttentionA = 0,       // norm, q/k/v projections (FarSkip's part (a))
  kRouter = 1,           // post-attention norm and router
  kAttentionB = 2,       // attention core and o_proj
  kRoutedExperts = 3,    // one chunk of the routed experts (forward)
  kSharedExperts = 4,
  kHead = 5,             // final norm, LM head, loss
  kHeadBackward = 6,
  kAttentionBackward = 7,
  kRouterBackward = 8,
  kExpertsInputBackward = 9,   // one chunk: input gradients
  kExpertsWeightBackward = 10, // one chunk: weight gradients
  kSharedBackward = 11,
  kOptimizer = 12,             // the update, once every gradient is in
  kOwnedExpertsWeightBackward = 13,  // overlapped HybridEP: every layer's owned experts'
                                     // weight gradients, after the embedding's; EP: layer 0's
  kReplicaExpertsWeightBackward = 14,  // late replica weight gradients: one layer's (before
                                       // its send), after the embedding's, before the owned ones
};
const char* compute_kind_name(ComputeKind k);

struct StepOp {
  enum class Type : int { kCompute = 0, kStart = 1, kWait = 2 };
  Type type = Type::kCompute;
  ComputeKind compute = ComputeKind::kAttentionA;  // kCompute
  int comm = -1;                                   // kStart, kWait: index into StepSchedule::comms
  int layer = -1;
};

struct ScheduledComm {
  CommKind kind = CommKind::kDispatch;
  int layer = -1;   // -1: not a layer's (the head's or the embedding's bucket)
  int chunk = 0;    // pipeline chunk of an A2A; bucket index of a dense bucket
  int stream = 0;   // kToExpertsStream ..
  int span = 1;     // a backward A2A: the forward chunks it carries (chunk..chunk+span-1)
};

struct StepSchedule {
  std::vector<StepOp> ops;
  std::vector<ScheduledComm> comms;
  int pipeline_degree = 1;
  int backward_pipeline_degree = 1;
  bool overlapped = false;
  bool gathers_experts = false;
  bool defers_owned_expert_weights = false;  // kOwnedExpertsWeightBackward at the end of backward
  bool defers_replica_expert_weights = false;  // kReplicaExpertsWeightBackward before it
  // Overlapped without replicas: layer 0's weight gradients are its
  // kOwnedExpertsWeightBackward after the embedding's, not its chunks'.
  bool defers_first_layer_expert_weights = false;
  std::string describe() const;  // one op per line, for `xdmoe simulate --show-schedule`
};

struct ScheduleShape {
  ModelConfig model;            // layers, connectivity, gating, shared experts count
  int pipeline_degree = 1;      // r
  bool overlapped = false;      // farskip.overlapped
  bool gathers_experts = false; // some domain size > 1 (HybridEP): AG and replica gradients
  // Overlapped, the runtime computes the owned experts' weight gradients
  // after the embedding's (DistributedTrainer): with replicas (a domain size
  // > 1) every layer's, without them layer 0's (MoeTransformer::BackwardHooks).
  bool defers_owned_expert_weights = false;
  // expert_parallel.replica_weight_gradients: late (with the above): the
  // replicas' weight gradients too, before the owned ones.
  bool defers_replica_expert_weights = false;
  int backward_pipeline_degree = 0;  // a divisor of r; 0: r
};

// Errors: the model config does not validate, r < 1, a backward r that
// does not divide r.
Expected<StepSchedule> record_step_schedule(const ScheduleShape& shape);

}  // namespace xd
