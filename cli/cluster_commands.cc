// xdmoe coordinator / worker: the two processes of a distributed job.
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>

#include "actors/worker_process.h"
#include "cli/commands.h"
#include "cluster/hostfile.h"
#include "coordinator/coordinator.h"

namespace xd::cli {

namespace {
struct CoordinatorFlags {
  std::string config, hostfile, netns, mode, worker_endpoint = "tcp://127.0.0.1:7371",
                           cli_endpoint = "tcp://127.0.0.1:7370", summary, endpoints_file, name = "xdmoe";
  std::vector<int> domains;
  int http_port = 7372;
  int64_t steps = 0;
  bool hold = false, flat_ep = false, no_probe = false, no_replan = false;
  ScheduleOverrides schedule;
  std::string resume, checkpoint_dir;
  int64_t checkpoint_every = -1;
};

int run_coordinator(const CoordinatorFlags& f) {
  JobConfig job = default_job_config();
  if (!f.config.empty()) {
    auto parsed = load_job_config(f.config);
    if (!parsed) {
      std::fprintf(stderr, "xdmoe coordinator: %s\n", parsed.status().message().c_str());
      return 2;
    }
    job = *parsed;
  }
  if (!f.hostfile.empty()) {
    auto hosts = load_hostfile(f.hostfile);
    if (!hosts) {
      std::fprintf(stderr, "xdmoe coordinator: %s\n", hosts.status().message().c_str());
      return 2;
    }
    job.cluster.hosts = *hosts;
    if (Status st = job.cluster.validate(); !st.is_ok()) {
      std::fprintf(stderr, "xdmoe coordinator: hostfile %s: %s\n", f.hostfile.c_str(), st.message().c_str());
      return 2;
    }
  }
  if (f.steps > 0) job.train.steps = f.steps;
  if (!f.checkpoint_dir.empty()) job.train.checkpoint_dir = f.checkpoint_dir;
  if (f.checkpoint_every >= 0) job.train.checkpoint_every = f.checkpoint_every;
  if (Status st = override_schedule(&job, f.schedule); !st.is_ok()) {
    std::fprintf(stderr, "xdmoe coordinator: %s\n", st.message().c_str());
    return 2;
  }
  if (Status st = override_expert_parallel(&job, f.mode, f.domains); !st.is_ok()) {
    std::fprintf(stderr, "xdmoe coordinator: %s\n", st.message().c_str());
    return 2;
  }
  CoordinatorOptions o;
  o.worker_endpoint = f.worker_endpoint;
  o.cli_endpoint = f.cli_endpoint;
  o.http_port = f.http_port;
  o.job_name = f.name;
  o.hold = f.hold;
  o.summary_path = f.summary;
  o.endpoints_path = f.endpoints_file;
  o.flat_ep = f.flat_ep;
  o.probe_links = !f.no_probe;
  o.netns_state = f.netns;
  o.replan = !f.no_replan;
  o.resume = f.resume;
  Coordinator c(job, o);
  Status st = c.run();
  if (!st.is_ok()) {
    std::fprintf(stderr, "xdmoe coordinator: %s\n", st.message().c_str());
    return 1;
  }
  return 0;
}
}  // namespace

CLI::Option* add_trace_steps_option(CLI::App* cmd, std::vector<int64_t>* steps, const std::string& help) {
  return cmd->add_option("--trace-steps", *steps, help)->delimiter(',')->check(
      CLI::Range(int64_t{1}, int64_t{1000000000}));
}

void add_schedule_options(CLI::App* cmd, ScheduleOverrides* o) {
  cmd->add_flag("--farskip", o->farskip, "FarSkip connectivity on every layer (farskip.enabled)");
  cmd->add_flag("--no-overlap", o->no_overlap,
                "The simple schedule: the same math, token exchanges and the dense all-reduce in series with compute "
                "(farskip.overlapped: false; docs/overlap.md)");
  cmd->add_option("--pipeline-degree", o->pipeline_degree,
                  "Override cluster.expert_parallel.pipeline_degree: A2A chunks r (0: the planner's choice)")
      ->check(CLI::Range(0, 64));
  cmd->add_option("--backward-pipeline-degree", o->backward_pipeline_degree,
                  "Override cluster.expert_parallel.backward_pipeline_degree: the backward's A2A exchanges, a "
                  "divisor of r (0: the planner's choice; -1: r when r is set, else the planner's)")
      ->check(CLI::Range(-1, 64));
  cmd->add_option("--replica-weight-gradients", o->replica_weight_gradients,
                  "Override cluster.expert_parallel.replica_weight_gradients: when an overlapped HybridEP backward "
                  "computes the replicas' weight gradients: early (with each layer's experts), late (after the "
                  "embedding's, so the last dense buckets leave sooner) or auto (the planner's choice)")
      ->check(CLI::IsMember({"auto", "early", "late"}));
  cmd->add_flag("--sr-codecs", o->sr_codecs,
                std::string("Compress the outermost link class's expert traffic and dense gradients: expert_gather ") +
                    kSrCodecs.expert_gather + ", expert_grad " + kSrCodecs.expert_grad + ", dense_grad " +
                    kSrCodecs.dense_grad + ", the SR base every " + std::to_string(kSrCodecs.base_sync_every) +
                    " steps (docs/compression.md)");
  cmd->add_flag("--delta-weights", o->delta_weights,
                std::string("Send the outermost link class's expert all-gather as exact bit differences from what "
                            "the receivers hold: expert_gather ") +
                    kDeltaWeights + " (lossless; docs/compression.md)");
  cmd->add_option("--tokens-once-per-worker", o->tokens_once_per_worker,
                  "Set cluster.expert_parallel.tokens_once_per_worker: true (the option alone) sends a token routed "
                  "to several experts of one worker to it once, and that worker sums their outputs; false sends a "
                  "row per expert; auto lets the planner choose. Not given: the config's, auto by default "
                  "(docs/overlap.md)")
      ->expected(0, 1)
      ->default_str("true")
      ->check(CLI::IsMember({"auto", "true", "false"}));
  add_trace_steps_option(cmd, &o->trace_steps, "Steps whose timeline each worker writes as a Chrome trace, e.g. 20,21");
  cmd->add_option("--trace-dir", o->trace_dir, "Where traces go (default train.trace_dir, runs/trace)");
}

void add_coordinator_command(CLI::App& app, int* exit_code) {
  auto f = std::make_shared<CoordinatorFlags>();
  CLI::App* cmd = app.add_subcommand("coordinator", "Run a job's coordinator: registration, plan, heartbeats, metrics");
  cmd->add_option("--config", f->config, "Job YAML (model, train, data, cluster); default: built-in")->check(CLI::ExistingFile);
  cmd->add_option("--hostfile", f->hostfile, "The job's hosts ('HOST slots=N [dc=NAME]' lines); sets cluster.hosts")
      ->check(CLI::ExistingFile);
  cmd->add_option("--netns", f->netns,
                  "The state file of a namespace cluster (scripts/netns-cluster.sh): `xdmoe throttle` of the "
                  "outermost link class changes its kernel tbf");
  cmd->add_option("--mode", f->mode, "Override cluster.expert_parallel.mode: ep, hybrid, auto");
  cmd->add_flag("--flat-ep", f->flat_ep, "With mode ep: one all-to-all hop to the owner instead of one per level");
  cmd->add_option("--domains", f->domains, "Override the domain sizes (one per level), e.g. --domains 2 1")->delimiter(',');
  cmd->add_option("--steps", f->steps, "Override train.steps");
  add_schedule_options(cmd, &f->schedule);
  cmd->add_option("--bind", f->worker_endpoint, "Endpoint workers connect to")->capture_default_str();
  cmd->add_option("--cli-bind", f->cli_endpoint, "Endpoint for xdmoe status/top/metrics/stop/throttle")->capture_default_str();
  cmd->add_option("--http-port", f->http_port, "Prometheus /metrics port (0: any free port, -1: off)")->capture_default_str();
  cmd->add_option("--name", f->name, "Job name shown in status and metrics")->capture_default_str();
  cmd->add_option("--summary", f->summary, "Write a JSON summary here at the end");
  cmd->add_option("--endpoints-file", f->endpoints_file, "Write the bound endpoints (JSON) here");
  cmd->add_flag("--no-probe", f->no_probe, "Plan with the spec's link figures instead of probing each shaped class at start-up");
  cmd->add_flag("--no-replan", f->no_replan,
                "Keep the start-up plan and its prediction even when a link's measured bandwidth, or the "
                "workers' measured compute or routing imbalance, moves far from what it assumed");
  cmd->add_option("--resume", f->resume,
                  "Start from a checkpoint: a step_<N> directory, or a directory of them (the newest complete one; "
                  "torn or corrupt ones are skipped)");
  cmd->add_option("--checkpoint-dir", f->checkpoint_dir, "Override train.checkpoint_dir");
  cmd->add_option("--checkpoint-every", f->checkpoint_every, "Override train.checkpoint_every (0: only at the end)");
  cmd->add_flag("--hold", f->hold, "Workers register and stay idle until `xdmoe stop` (no training)");
  cmd->callback([f, exit_code] { *exit_code = run_coordinator(*f); });
}

void add_worker_command(CLI::App& app, int* exit_code) {
  auto o = std::make_shared<WorkerOptions>();
  CLI::App* cmd = app.add_subcommand("worker", "Run one worker of a job; it registers with the coordinator");
  cmd->add_option("--coordinator", o->coordinator, "The coordinator's worker endpoint")->capture_default_str();
  cmd->add_option("--rank", o->rank, "Rank to ask for (default: from OMPI/PMI/SLURM env, else any)");
  cmd->add_option("--bind-host", o->bind_host, "Address to bind the data socket on (0.0.0.0: every interface)")
      ->capture_default_str();
  cmd->add_option("--advertise-host", o->advertise_host,
                  "The address peers reach this worker at (default: the bound address; needed with 0.0.0.0)");
  cmd->add_option("--host-label", o->host_label, "Name shown by xdmoe status (default: hostname)");
  if (const char* k = std::getenv("XDMOE_KEY")) o->key_file = k;
  if (const char* k = std::getenv("XDMOE_COORDINATOR_KEY")) o->coordinator_key = k;
  cmd->add_option("--key", o->key_file,
                  "This worker's CURVE secret key file (xdmoe keygen; default $XDMOE_KEY); with --coordinator-key "
                  "every link is encrypted and authenticated");
  cmd->add_option("--coordinator-key", o->coordinator_key,
                  "The coordinator's public key: its .pub file or the Z85 key (default $XDMOE_COORDINATOR_KEY)");
  cmd->add_option("--kernel-shaped", o->kernel_shaped,
                  "Link classes whose bandwidth the kernel shapes (scripts/netns-cluster.sh): only their latency "
                  "is added in the process")
      ->delimiter(',');
  cmd->callback([o, exit_code] {
    WorkerOptions w = *o;
    if (w.rank < 0) {
      w.rank = rank_from_environment();
      w.check_launcher_world = w.rank >= 0;
    }
    *exit_code = run_worker(w);
  });
}

}  // namespace xd::cli
