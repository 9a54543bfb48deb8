// ClusterSpec: the `cluster:` section of a job YAML -- the multilevel layout of
// the workers (outermost level first, HybridEP Sec. IV-A), one link class per
// level, optional hosts, and the expert-parallel choice. Parsing is strict: an
// unknown key, a bad unit or an inconsistent value (a domain size that does not
// divide its level size, ...) is an error naming file:line and the key.
// Plain data; copyable.
//
// Link classes: the link class of level l joins workers whose locations
// differ in coordinate l only; for any two workers it is the level of the
// first (outermost) coordinate where their locations differ (link_level).
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "common/status.h"

namespace xd {

// Codecs for the traffic kinds that cross a link class
// (docs/compression.md):
//   dispatch:  token rows moving toward the experts (the forward Dispatch and
//              the backward of Combine); a CodecPipeline spec (codec.h).
//   combine:   rows moving back to their sources (the forward Combine and the
//              backward of Dispatch); a CodecPipeline spec.
//   expert_gather: expert weights in the HybridEP all-gather;
//              an ExpertCodecSpec (expert_codec.h), e.g. "sr:topk:0.02+zstd".
//   expert_grad: replica gradients back to their owners; an ExpertCodecSpec
//              without "sr:", e.g. "bf16" or "ef:topk:0.1".
//   dense_grad: the dense-gradient all-reduce: "raw" (fp32) or "bf16" (bf16 on
//              the wire, fp32 sums; MegaScale-MoE Sec. 5).
struct LinkCodecs {
  std::string dispatch = "raw";
  std::string combine = "raw";
  std::string expert_gather = "raw";
  std::string expert_grad = "raw";
  std::string dense_grad = "raw";

  // Each traffic kind by its config key, for readers, writers and checks.
  std::vector<std::pair<const char*, std::string*>> by_kind();
  std::vector<std::pair<const char*, const std::string*>> by_kind() const;
};

struct LinkClassSpec {
  std::string name;                   // the level's name, e.g. "dc"
  double bandwidth_bytes_per_s = 0;   // > 0
  double latency_s = 0;               // one-way
  bool shape = true;                  // emulate it with the in-process shaper
  LinkCodecs codecs;
};

struct LevelSpec {
  std::string name;  // unique, e.g. "dc", "worker"
  int size = 1;      // SF^l
  LinkClassSpec link;
};

enum class EpMode : int { kEp = 0, kHybrid = 1, kAuto = 2 };
const char* ep_mode_name(EpMode m);  // "ep", "hybrid", "auto"
Expected<EpMode> parse_ep_mode(const std::string& s);

// When an overlapped HybridEP backward computes the weight gradients of the
// gathered replicas (docs/overlap.md, "The backward schedule"): early, with
// each layer's experts, so their gradients start home at once; late, after
// the embedding's gradients, so the last dense buckets leave sooner and the
// replicas' gradients cross beside them. auto: the planner picks whichever
// it predicts faster (early unless late is clearly so).
enum class ReplicaWeightGradients : int { kAuto = 0, kEarly = 1, kLate = 2 };
const char* replica_weight_gradients_name(ReplicaWeightGradients w);  // "auto", "early", "late"
Expected<ReplicaWeightGradients> parse_replica_weight_gradients(const std::string& s);
// What a plan resolved: late, else early.
inline ReplicaWeightGradients replica_weight_gradients_of(bool late) {
  return late ? ReplicaWeightGradients::kLate : ReplicaWeightGradients::kEarly;
}

// Whether a token routed to several experts of one worker crosses to it once
// (docs/overlap.md, "A token once per worker"): on, off, or auto, which the
// planner turns on where it predicts a clearly faster step (never for
// soft_moe or lossy token codecs, which cannot send grouped rows).
enum class TokensOncePerWorker : int { kOff = 0, kOn = 1, kAuto = 2 };
const char* tokens_once_per_worker_name(TokensOncePerWorker t);  // "false", "true", "auto"
// "auto", "true" or "false" (the JSON wire and the command line; the YAML
// reader takes any YAML boolean too).
Expected<TokensOncePerWorker> parse_tokens_once_per_worker(const std::string& s);
inline TokensOncePerWorker tokens_once_per_worker_of(bool once) {
  return once ? TokensOncePerWorker::kOn : TokensOncePerWorker::kOff;
}

struct ExpertParallelSpec {
  EpMode mode = EpMode::kAuto;
  // S^l per level; S^l divides SF^l. Only hybrid uses them; ep means all 1s and
  // auto lets the planner choose.
  std::vector<int> domain_sizes;
  // Bytes of gathered expert replicas a worker may hold (all layers). A
  // candidate above it is infeasible. +infinity: no cap.
  double memory_cap_bytes = 64e6;
  // Steps between re-synchronisations of the SR base experts (an all-reduce
  // of every layer's mean expert); 0: only once, before the first step.
  int base_sync_every = 1;
  // How the SR base's partial sums cross a link class whose all-gather codes
  // against the base: "bf16" (each sync sends them in bf16), or "sign" (the
  // first sync exact, then each member's change since the last as one sign
  // bit per entry and a scale per 1024, error feedback keeping every member's
  // copy of every partial the same; about 1/15 of bf16's bytes between two
  // DCs, less saving as the outer group grows: every member sends to all).
  std::string base_codec = "bf16";
  // Pack the compressed experts of the next all-gather (and the base's sum)
  // inside the optimizer step, from weights still in cache (HybridEP Fig. 10a);
  // false: a separate pass on the communicator's thread. Same bits either way.
  bool fused_encode = true;
  // r (FSMoE Sec. 4): each layer's Dispatch and Combine move in r chunks so
  // expert compute on one chunk overlaps the transfer of the next. 0: the
  // planner chooses (YAML `auto`).
  int pipeline_degree = 0;
  // The backward's r, a divisor of the forward's: each backward exchange
  // carries r / backward r forward chunks (the backward computes twice the
  // forward's FLOPs per row, so fewer, larger transfers can hide as well).
  // -1 (not given): the forward's when that is set by hand, else chosen;
  // 0: the planner chooses (YAML `auto`).
  int backward_pipeline_degree = -1;
  // A worker given auto (a job run without a coordinator) takes early; the
  // coordinator assigns its plan's choice.
  ReplicaWeightGradients replica_weight_gradients = ReplicaWeightGradients::kAuto;
  // A token routed to several experts of one worker crosses to it once; that
  // worker sums their weighted outputs and returns each expert's combine
  // weight gradient (docs/overlap.md, "A token once per worker"). Fewer
  // token rows on every link, the same math up to the order of sums. On
  // needs a token router (not soft_moe) and lossless token codecs (raw,
  // zstd). A worker given auto (a job run without a coordinator) takes off;
  // the coordinator assigns its plan's choice.
  TokensOncePerWorker tokens_once_per_worker = TokensOncePerWorker::kAuto;
};

struct HostSpec {
  std::string host;  // address or name
  int dc = 0;        // coordinate 0 (the outermost level) of its workers; -1 on
                     // every host: the hosts fill the ranks in order
  int slots = 1;     // workers on this host
};

// cluster.security: CURVE keys for every link (docs/operations.md). Without
// the section a job whose coordinator listens on loopback runs in plaintext
// and says so; one reachable from other hosts must either name keys or say
// `insecure: true`. Paths only: no secret ever travels in the config.
struct SecuritySpec {
  bool configured = false;             // the section is there
  bool insecure = false;               // plaintext, by explicit choice
  std::string coordinator_key;         // the coordinator's secret key file (read by the coordinator)
  std::string coordinator_public_key;  // its .pub file or Z85 key (workers and the CLI check it)
  std::string worker_key;              // the workers' secret key file, as `xdmoe launch` passes it
  std::vector<std::string> allowed_keys;  // .pub files or Z85 keys: who may join, stop and throttle
  bool read_only_any_key = false;      // status/metrics/top for any CURVE client
  bool curve() const { return configured && !insecure; }
};

struct ClusterSpec {
  std::vector<LevelSpec> levels;  // outermost first
  std::vector<HostSpec> hosts;    // optional; empty: everything on this machine
  ExpertParallelSpec expert_parallel;
  SecuritySpec security;

  int world_size() const;                // G = prod SF^l
  std::vector<int> level_sizes() const;  // SF^0..SF^{L-1}
  // Whether the SR base's sums cross level `level` as sign bits: its
  // all-gather codes against the base, base_codec is sign, and it is not the
  // innermost level (whose sums always go in bf16).
  bool base_as_signs(size_t level, bool gather_against_base) const;
  // Checks every rule the parser checks; errors name the key ("cluster.levels[1].size").
  Status validate() const;
};

// 2 DCs x 2 workers; inter-DC 100mbit/10ms, intra-DC 1gbit/0.2ms, both shaped;
// mode auto, domain sizes all 1, 64MB cap.
ClusterSpec default_cluster_spec();

// Reads the `cluster` key of the YAML document (other top-level keys belong to
// other readers and are ignored). Without a `cluster` key: the default. Keys
// left out keep the default's values; `levels`, when given, replaces the
// default levels. Sizes: "64MB" (10^6), "64MiB" (2^20), plain bytes, or
// "unlimited" for memory_cap.
Expected<ClusterSpec> parse_cluster_spec(const std::string& yaml_text, const std::string& source);


// The level of the first coordinate where workers m and n differ (their link
// class), or -1 when m == n.
int link_level(const std::vector<int>& level_sizes, int m, int n);

}  // namespace xd
