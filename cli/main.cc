#include <cstdio>
#include <string>

#include "cli/commands.h"
#include "common/log.h"

namespace xd::cli {
namespace {
std::string g_log_level_flag;
}
const std::string& log_level_flag() { return g_log_level_flag; }
}  // namespace xd::cli

int main(int argc, char** argv) {
  CLI::App app{"xdmoe: Mixture-of-Experts training across datacenters over ZeroMQ"};
  app.require_subcommand(1);
  app.fallthrough();  // --log-level may come after the subcommand too
  app.add_option("--log-level", xd::cli::g_log_level_flag,
                 "Log level of every component: debug, info, warn, error or off "
                 "(default: $XDMOE_LOG_LEVEL, else info)")
      ->check(CLI::IsMember({"debug", "info", "warn", "error", "off"}))
      ->each([](const std::string& v) { xd::set_log_level(*xd::parse_log_level(v)); });
  int exit_code = 0;
  xd::cli::add_train_command(app, &exit_code);
  xd::cli::add_forward_command(app, &exit_code);
  xd::cli::add_topology_command(app, &exit_code);
  xd::cli::add_plan_command(app, &exit_code);
  xd::cli::add_simulate_command(app, &exit_code);
  xd::cli::add_coordinator_command(app, &exit_code);
  xd::cli::add_worker_command(app, &exit_code);
  xd::cli::add_launch_command(app, &exit_code);
  xd::cli::add_keygen_command(app, &exit_code);
  xd::cli::add_monitor_commands(app, &exit_code);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  return exit_code;
}
