// Planner: the stream-based cost model of one training iteration (HybridEP
// Sec. III, Eq. 1-12, with FSMoE's alpha-beta link model, Eq. 1) and the choice
// of the expert-domain sizes S^0..S^{L-1}. docs/planner.md has the formulas.
//
// Per worker and iteration it predicts three streams:
//   compute   pre-expert (attention, router, shared experts), expert and post
//             (LM head) GEMMs, forward and backward;
//   tokens    4 A2As per MoE layer (Dispatch and Combine, forward and backward),
//             level by level; a level-l A2A moves D(1 - S^l/SF^l) bytes, times
//             the wire fraction of that level's token codec for the direction,
//             plus the codec's encode + decode time;
//   experts   the AG of replicas, outer level first, moving
//             n P_E (prod_{j<l} S^j)(S^l - 1) bytes at level l, and the
//             reduce-scatter of replica gradients, same volume;
// plus the hierarchical all-reduce of the dense gradients.
// Overlap: every transfer is a route of hops, one per level it crosses, and
// each level's link is a queue in wall time beside the compute stream (the
// runtime's token bucket): a hop holds the link for its bytes over the rate
// and lands alpha later, so transfers queued behind each other pay their
// latency once. Every layer's AG leaves when the iteration starts and its
// experts wait for it; a layer's RS leaves when its expert backward is done;
// overlapped, the dense buckets leave as backward finishes them. The step
// ends when the RS is home, the norm summed and the buckets done; not
// overlapped, the buckets then run one by one. The A2As follow the schedule
// of docs/overlap.md, each direction one chunk at a time: not overlapped
// (farskip.overlapped false), each blocks the compute stream until it lands;
// overlapped, it starts when the schedule starts it and is waited for where
// the schedule needs its result; the compute between the two is what hides
// it (attention under FarSkip, the shared experts, the expert weight
// gradients, and with r chunks the experts of earlier chunks).
// Links: a worker's egress on one link class is one token bucket shared by all
// its peers of that class, so a level's bytes cost beta * (total bytes). The
// fan-out collectives (A2A, AG, RS) send to all their level peers at once, so
// their messages' latencies overlap: alpha once per collective and level.
// The dense all-reduce is a direct reduce-scatter and all-gather per level
// (alpha once each) until its blocks reach the Communicator's ring threshold;
// then each ring step costs alpha. This is exact for two levels; with more,
// the trainer's outer stage is one flat group over all outer levels, which
// the model prices as one phase per level.
// Pure functions; thread-safe.
#pragma once

#include <array>
#include <map>
#include <string>
#include <vector>

#include "common/status.h"
#include "cluster/job_config.h"
#include "model/model_config.h"

namespace xd {

// t = alpha + bytes * beta for one message on one link class.
struct LinkModel {
  double alpha_s = 0;
  double beta_s_per_byte = 0;
};

// What the codecs of one link class cost (cluster.levels[].link.codecs): per
// traffic kind, the fraction of the raw fp32 bytes that crosses the link and
// the encode + decode seconds per raw byte. Raw: 1 and 0.
struct LinkCodecCost {
  double dispatch_fraction = 1, combine_fraction = 1;  // token rows
  double dispatch_s_per_byte = 0, combine_s_per_byte = 0;
  double gather_fraction = 1, gather_s_per_byte = 0;  // expert weights (AG)
  double grad_fraction = 1, grad_s_per_byte = 0;      // replica gradients (RS)
  double dense_fraction = 1;                          // dense-gradient all-reduce (bf16: 0.5)
  bool gather_against_base = false;                   // sr: the base all-reduce joins the step
  bool gather_delta = false;  // delta:, coded but exact: receivers rebuild the sender's bits
  // Coded on this link class (lossy, or delta:): the level codes all it sends.
  bool gather_coded() const { return gather_fraction != 1 || gather_s_per_byte != 0; }
  // What crossed this level is relayed by the raw levels inside it, as it
  // arrived (a lossy codec; delta:'s replicas go on as floats).
  bool gather_relayed() const { return gather_coded() && !gather_delta; }
};

// One level of the HybridEP all-gather of a worker's experts, per AG peer:
// the raw bytes it holds from the levels before (its own and replicas), the
// bytes on the wire and the codec seconds on the hop. A lossy level codes
// all of it; a raw level inside a lossy one sends what the worker holds
// exactly raw and relays each group that crossed a lossy level at that
// level's fraction, which its receivers decode (a third of that codec's
// encode and two decodes per raw byte; actors/expert_relay.cc).
struct GatherHop {
  double raw_bytes = 0, wire_bytes = 0, codec_s = 0;
};
// The dense all-reduce's wire fraction on `level` (link_codecs empty: 1).
// The runtime runs it in two stages (DistributedTrainer): the innermost
// level's group with its own dense_grad, and one group across every other
// level, in bf16 when any of their link classes asks for it.
double dense_wire_fraction(const std::vector<LinkCodecCost>& link_codecs, int level);

// Per level, outer first; `own_bytes` is the worker's own experts of a
// layer; link_codecs empty: raw everywhere.
std::vector<GatherHop> expert_gather_hops(double own_bytes, const std::vector<int>& domain_sizes,
                                          const std::vector<LinkCodecCost>& link_codecs);

// A GEMM of f flops takes gemm_overhead_s + f / flops_per_s. Only GEMMs are
// counted; non_gemm_factor scales every compute term to cover the rest (norms,
// softmax, router, element-wise ops), fitted by coordinator/step_probe.h.
struct ComputeModel {
  double flops_per_s = 1e10;
  double gemm_overhead_s = 0;
  double non_gemm_factor = 1;
  double optimizer_s_per_param = 0;  // AdamW's update with its clipping norm; 0: not counted
  // CPU time the transport's threads take per byte a worker sends (and
  // receives as much of), in wall time on the cores its compute runs on.
  // Overlapped, it dilates compute; 0 when the threads have cores of their own.
  double transport_cpu_s_per_byte = 0;
  double transport_cpu_s_per_message = 0;  // the same per message sent (wake-ups and hand-offs)
  // The same CPU time per byte and per message, at the worker's share of a
  // core, whoever's cores: not overlapped, each token exchange and dense
  // bucket runs it while the compute thread waits, so it adds to the step.
  double exchange_cpu_s_per_byte = 0;
  double exchange_cpu_s_per_message = 0;
  // The codecs' encode and decode (LinkCodecCost's seconds per byte) run on
  // the same cores: overlapped, they too dilate compute, whichever thread
  // runs them. Set with transport_cpu_* where the workers fill the cores.
  bool codecs_share_compute_cores = false;
};

// The routing's A2A imbalance F per level of each domain-size candidate.
using RoutedImbalance = std::map<std::vector<int>, std::vector<double>>;
// The F a candidate is planned with: `measured` when a run has measured one
// (it holds for every candidate), else the candidate's entry of `routed`,
// else empty (1 everywhere).
std::vector<double> a2a_imbalance_for(const std::vector<double>& measured, const RoutedImbalance& routed,
                                      const std::vector<int>& domain_sizes);
// F is the larger side of a hop over the mean of both sides: from 1 (even)
// to 2 (every row one way).
inline bool a2a_imbalance_in_range(double f) { return f >= 1 && f <= 2; }
inline constexpr const char* kA2aImbalanceRange =
    "an A2A imbalance must be in [1, 2] (1: uniform routing; 2: every row one way)";
// The rows a candidate's workers' routed experts compute, over the mean
// worker's, summed over layers: each layer's busiest worker's (every layer's
// exchanges wait for it), and the busiest worker's own (what a run measures
// as its slowest worker's compute; the rest of the first is that worker's
// wait for the others). 1 <= busiest_worker <= layers_busiest.
struct ExpertLoad {
  double layers_busiest = 1;
  double busiest_worker = 1;
};
using RoutedExpertLoad = std::map<std::vector<int>, ExpertLoad>;
// The candidate's entry, else 1 and 1 (every worker computes as many rows).
ExpertLoad expert_load_for(const RoutedExpertLoad& routed, const std::vector<int>& domain_sizes);

struct PlannerInputs {
  ModelConfig model;
  long long tokens_per_worker = 512;  // per step: sequences per worker * seq_len
  int seq_len = 64;                   // for the attention core; 0: not counted
  int bytes_per_element = 4;          // tokens, experts and gradients on the wire
  std::vector<int> level_sizes;       // SF^0..SF^{L-1}
  std::vector<LinkModel> links;       // one per level
  ComputeModel compute;
  ExpertParallelSpec expert_parallel;
  std::vector<LinkCodecCost> link_codecs;  // one per level; empty: raw everywhere
  // The schedule: farskip.overlapped of the job. The pipeline degrees are
  // expert_parallel.pipeline_degree and backward_pipeline_degree (0: the
  // planner picks it), the connectivity model.connectivity.
  bool overlapped = false;
  // Per level, how much longer than the mean a token A2A's hop lasts: a
  // worker sends more rows than it receives or the reverse, and the hop
  // lasts as long as the larger side (1 <= F <= 2, a run's LINK/moe_peak_raw over
  // its raw token bytes). Empty: each candidate's routed_a2a_imbalance, or
  // uniform routing (F = 1).
  std::vector<double> a2a_imbalance;
  // Per domain-size candidate, the F per level of the job's first batch at
  // its initial weights (coordinator/routing_probe.h): the start-up's.
  RoutedImbalance routed_a2a_imbalance;
  // a2a_imbalance_for(a2a_imbalance, routed_a2a_imbalance, domain_sizes).
  std::vector<double> a2a_imbalance_for(const std::vector<int>& domain_sizes) const;
  // Per domain-size candidate, how much longer than the mean worker's the
  // routed experts' compute lasts on the busiest (the same first batch).
  // Empty: 1.
  RoutedExpertLoad routed_expert_load;

  Status validate() const;
};

// alpha = latency, beta = 1 / bandwidth, per level of the spec.
std::vector<LinkModel> spec_link_models(const ClusterSpec& spec);

// How the runtime's dense all-reduce (hierarchical_all_reduce,
// dense_all_reduce) moves a shard of `shard_bytes` (fp32) at `level`: in one
// round where Communicator::one_shot_all_reduce() holds (an outer level, or
// the innermost with nothing across), round a ring of SF - 1 steps from the
// ring threshold on with more than two members, else as a direct
// reduce-scatter and all-gather. The planner and the simulator price it so.
enum class DenseStage { kOneRound, kDirect, kRing };
DenseStage dense_stage(const std::vector<int>& level_sizes, int level, double shard_bytes);
// The inputs for a job: its model, batch_size * seq_len tokens per worker, its
// levels and expert-parallel spec, and the given link and compute models.
// tokens_once_per_worker auto becomes false where the job cannot group rows
// (JobConfig::can_send_tokens_once_per_worker), so the planner never prices it.
PlannerInputs planner_inputs_for(const JobConfig& job, std::vector<LinkModel> links,
                                 ComputeModel compute);

// Per-worker quantities of one iteration that do not depend on the domain
// sizes. workload_of() derives them from the shapes; tests set them directly.
struct Workload {
  int num_moe_layers = 1;
  double experts_per_worker = 1;   // n
  double expert_bytes = 0;         // P_E: the parameters of one routed expert
  double token_bytes = 0;          // D: one A2A's data per worker and MoE layer
  // A token once per worker (expert_parallel.tokens_once_per_worker): the
  // rows to a destination shrink to one per token there, the rows toward
  // the experts widen by their expert ids and weights (grouped_row_share).
  bool grouped_rows = false;
  // tokens_once_per_worker auto: evaluate_candidate() plans both and keeps
  // grouped rows where they are clearly faster (kPlanTieMargin).
  bool grouped_rows_auto = false;
  int routed_rows_per_token = 1;   // k
  int num_experts = 1;             // E
  bool expert_choice = false;
  double hidden = 1;               // d
  double dense_param_bytes = 0;    // everything but routed experts; all-reduced
  double vocab_bytes = 0;          // one (vocab, d) matrix: the LM head's bucket and the embedding's
  double pre_expert_fwd_s = 0;     // per MoE layer
  double pre_expert_bwd_s = 0;     // per MoE layer
  double expert_fwd_s = 0;         // per MoE layer, the flops part
  double expert_bwd_s = 0;         // per MoE layer, the flops part
  double post_s = 0;               // LM head forward + backward, once
  double optimizer_s = 0;          // the update of the worker's parameters (dense, owned experts), once
  double gemm_overhead_s = 0;      // per GEMM call; held experts add 3 (fwd) + 6 (bwd) calls
  double base_syncs_per_step = 1;  // SR base all-reduces per step (1 / base_sync_every; 0: never)
  bool base_outer_sign = false;    // base_codec: sign: the outer stage sends sign-coded changes, in one round
  // Parts of pre_expert_fwd_s (the rest is the attention core, o_proj and the
  // router); backward parts scale alike (pre_expert_bwd_s / pre_expert_fwd_s).
  double attention_qkv_fwd_s = 0;  // norm and q/k/v projections: FarSkip's part (a)
  double shared_fwd_s = 0;         // shared experts
  double router_fwd_s = 0;         // the router's GEMMs (the simulator's "router" span)
  double transport_cpu_s_per_byte = 0;     // ComputeModel's
  double transport_cpu_s_per_message = 0;  // ComputeModel's
  double exchange_cpu_s_per_byte = 0;      // ComputeModel's
  double exchange_cpu_s_per_message = 0;   // ComputeModel's
  bool codecs_share_compute_cores = false;  // ComputeModel's
  std::vector<double> a2a_imbalance;    // PlannerInputs'
  RoutedImbalance routed_a2a_imbalance;  // PlannerInputs'
  RoutedExpertLoad routed_expert_load;  // PlannerInputs'
  // The schedule (docs/overlap.md).
  bool overlapped = false;
  int pipeline_degree = 1;                 // r; 0: each candidate takes the best of 1, 2, 4, 8
  // The backward's r, a divisor of the forward's; 0: each candidate takes
  // the best divisor (of 1, 2, 4, 8 and r); -1: the forward's.
  int backward_pipeline_degree = -1;
  // Overlapped with replicas: when backward computes their weight gradients
  // (auto: each candidate takes late where it is predicted faster by more
  // than kPlanTieMargin, else early).
  ReplicaWeightGradients replica_weight_gradients = ReplicaWeightGradients::kEarly;
  std::vector<Connectivity> connectivity;  // per MoE layer; empty: all regular
};
Workload workload_of(const PlannerInputs& in);
// The same workload with every compute term times `factor`: the prediction
// again once a run has measured its compute (a run's compute is slower than
// the start-up probe's: the transport's threads take CPU time beside it, and
// routing loads some workers more than others).
Workload with_compute_scaled(Workload w, double factor);
// For a compute model fitted to a run's measured compute, which holds the
// transport's threads' and the codecs' CPU time already: none on top.
void drop_core_sharing(ComputeModel* compute);
void drop_core_sharing(Workload* workload);

struct PlanCandidate {
  std::vector<int> domain_sizes;
  double compute_s = 0;       // the compute stream
  double transport_cpu_s = 0;  // part of it: the transport's threads on the compute's cores (overlapped)
  double codec_stretch_s = 0;  // part of it: the codecs on those cores (overlapped, where they share them)
  double codec_cpu_s = 0;  // a step's encode + decode seconds of the token, AG and replica-gradient codecs
  double a2a_s = 0;           // all token A2As (never overlapped)
  double ag_s = 0;            // the expert AG stream, total
  double rs_s = 0;            // the replica-gradient reduce-scatter stream, total
  double allreduce_s = 0;     // every dense bucket's all-reduce, the SR base's and the norm's sum, each alone
  double exposed_allreduce_s = 0;
  double exposed_ag_s = 0;    // AG time the compute stream waited for
  double exposed_rs_s = 0;    // RS time left after the backward pass
  double exposed_a2a_s = 0;   // A2A time compute waited for (a2a_s when not overlapped)
  double exchange_cpu_s = 0;  // not overlapped: the exchanges' CPU time compute waited out (in the exposed times)
  int pipeline_degree = 1;    // r of this candidate
  int backward_pipeline_degree = 1;  // the backward's r, a divisor of r
  bool replica_weights_late = false;  // the replicas' weight gradients after the embedding's
  bool tokens_once_per_worker = false;  // planned with a token once per worker (grouped rows)
  double iteration_s = 0;     // compute + exposed a2a + exposed AG + exposed RS + exposed all-reduce
  double gathered_bytes = 0;  // replicas held per worker: n P_E (prod S^l - 1) * layers
  std::vector<double> level_bytes;  // bytes a worker sends per level per iteration
  std::vector<double> level_messages;  // messages a worker sends per level per iteration
  std::vector<double> a2a_imbalance;  // the F per level it was planned with (empty: 1)
  double expert_imbalance = 1;        // ExpertLoad::layers_busiest it was planned with
  // Part of compute_s: what the slowest worker waits for each layer's
  // busiest (layers_busiest - busiest_worker of the routed experts' flops),
  // which a run counts as exposed time, not compute.
  double expert_wait_s = 0;
  // The compute a run measures on its slowest worker for this plan: the
  // transport's and codecs' stretch and the wait for busier workers are
  // in the run's other figures (its measured compute holds the first).
  double run_compute_s() const { return compute_s - transport_cpu_s - codec_stretch_s - expert_wait_s; }
  bool feasible = true;
  std::string why_infeasible;
};

struct Plan {
  std::vector<PlanCandidate> candidates;  // lexicographic in the domain sizes
  int chosen = 0;                         // index into candidates
  EpMode mode = EpMode::kAuto;
  const PlanCandidate& choice() const { return candidates[chosen]; }
};

// Every (S^0..S^{L-1}) with S^l a divisor of SF^l, lexicographic.
std::vector<std::vector<int>> domain_candidates(const std::vector<int>& level_sizes);

// With w.grouped_rows (a token once per worker) and uniform routing, the
// token bytes toward a destination computing `experts_at_destination`
// experts, over one row per expert: {toward the experts, back to the
// sources}, the groups' extra columns included. {1, 1} without.
std::array<double, 2> grouped_row_share(const Workload& w, double experts_at_destination);

// One candidate under a workload; memory_cap_bytes decides feasibility.
PlanCandidate evaluate_candidate(const Workload& w, const std::vector<int>& level_sizes,
                                 const std::vector<LinkModel>& links,
                                 const std::vector<int>& domain_sizes, double memory_cap_bytes,
                                 const std::vector<LinkCodecCost>& link_codecs = {});
// "4" when both directions run r = 4, "4/2" for forward 4, backward 2.
// With `replicas_late`, ", late" after: the replicas' weight gradients
// after the embedding's.
std::string pipeline_degrees_text(int forward, int backward, bool replicas_late = false);

// Two predictions closer than this fraction are a tie: the model's own error
// is larger (its live prediction is off by a few percent). Measured, a
// candidate holding more replicas ran about 4% slower where the model had it
// up to 1.6% faster (the README demo's FarSkip run, domains 2 x 2 against
// 2 x 1); of tied candidates the one with fewer replicas also uses less memory.
constexpr double kPlanTieMargin = 0.02;
// Mode auto's choice among `candidates`: of the feasible ones predicted
// within kPlanTieMargin of the least iteration time, the one with the fewest
// gathered bytes, then the faster. -1 when none is feasible.
int choose_candidate(const std::vector<PlanCandidate>& candidates);

// All candidates and the choice: ep -> all 1s; hybrid -> the spec's domain
// sizes, which must divide the level sizes (chosen even if infeasible: the
// caller reports it); auto -> choose_candidate().
Plan plan_workload(const Workload& w, const std::vector<int>& level_sizes,
                   const std::vector<LinkModel>& links, const ExpertParallelSpec& ep,
                   const std::vector<LinkCodecCost>& link_codecs = {});
// plan_workload(workload_of(in), ...). `in` must validate().
Plan plan_iteration(const PlannerInputs& in);

}  // namespace xd
