// Subcommands of the xdmoe binary. Each add_* registers its options on the
// CLI11 app and returns the exit code through `*exit_code` when it ran.
#pragma once

#include <CLI/CLI.hpp>

namespace xd::cli {

void add_train_command(CLI::App& app, int* exit_code);
void add_forward_command(CLI::App& app, int* exit_code);

}  // namespace xd::cli
