// Subcommands of the xdmoe binary. Each add_* registers its options on the
// CLI11 app and returns the exit code through `*exit_code` when it ran.
#pragma once

#include <CLI/CLI.hpp>

#include "cluster/job_config.h"

namespace xd::cli {

void add_train_command(CLI::App& app, int* exit_code);
void add_forward_command(CLI::App& app, int* exit_code);
void add_topology_command(CLI::App& app, int* exit_code);
void add_plan_command(CLI::App& app, int* exit_code);
void add_simulate_command(CLI::App& app, int* exit_code);
void add_coordinator_command(CLI::App& app, int* exit_code);
void add_worker_command(CLI::App& app, int* exit_code);
void add_launch_command(CLI::App& app, int* exit_code);
void add_keygen_command(CLI::App& app, int* exit_code);
void add_monitor_commands(CLI::App& app, int* exit_code);  // status, top, metrics, stop, throttle

// The CLI endpoint of the coordinator to talk to: --coordinator, else
// $XDMOE_COORDINATOR, else the default tcp://127.0.0.1:7370.
std::string coordinator_cli_endpoint(const std::string& flag);

// --farskip, --no-overlap, --pipeline-degree, --trace-steps, --trace-dir
// (ScheduleOverrides), shared by the coordinator and `xdmoe plan`.
void add_schedule_options(CLI::App* cmd, ScheduleOverrides* o);

// --trace-steps: comma-separated steps, each at least 1.
CLI::Option* add_trace_steps_option(CLI::App* cmd, std::vector<int64_t>* steps, const std::string& help);

// True when the YAML file has a top-level `cluster:` key: a distributed
// job's config (cluster/job_config.h) rather than a one-process one.
Expected<bool> has_cluster_section(const std::string& path);

// The --log-level given on the command line, or "" when none was (then the
// level comes from $XDMOE_LOG_LEVEL, else info). `xdmoe launch` hands it on.
const std::string& log_level_flag();

}  // namespace xd::cli
