// Subcommands of the kvcache CLI, one file each. Each adds itself to the app; its callback throws
// kvc::error (reported by main with exit status 1) on bad input.
#pragma once

#include <CLI/CLI.hpp>

namespace kvc::cli {

void add_types_command(CLI::App& app);
void add_size_command(CLI::App& app);

}  // namespace kvc::cli
