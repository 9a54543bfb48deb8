#include <cstdio>

#include "cli/commands.h"

int main(int argc, char** argv) {
  CLI::App app{"xdmoe: Mixture-of-Experts training across datacenters over ZeroMQ"};
  app.require_subcommand(1);
  int exit_code = 0;
  xd::cli::add_train_command(app, &exit_code);
  xd::cli::add_forward_command(app, &exit_code);
  xd::cli::add_topology_command(app, &exit_code);
  xd::cli::add_plan_command(app, &exit_code);
  xd::cli::add_coordinator_command(app, &exit_code);
  xd::cli::add_worker_command(app, &exit_code);
  xd::cli::add_launch_command(app, &exit_code);
  xd::cli::add_monitor_commands(app, &exit_code);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  return exit_code;
}
