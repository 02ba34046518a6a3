// Subcommands of the kvcache CLI, one file each. Each adds itself to the app; its callback throws
// kvc::error (reported by main with exit status 1) on bad input.
#pragma once

#include <CLI/CLI.hpp>

namespace kvc::cli {

void add_types_command(CLI::App& app);
void add_size_command(CLI::App& app);
void add_tiny_model_command(CLI::App& app);
void add_bench_command(CLI::App& app);
void add_replay_command(CLI::App& app, int& exit_code);  // exit_code: 0, or 2 on a script error
void add_inspect_command(CLI::App& app, int& exit_code);
// kvcache sim: replays a trace through the prefix cache and the policies it is compared with
void add_sim_command(CLI::App& app);
void add_demo_command(
    CLI::App& app,
    int& exit_code);  // exit_code: 1 when cache != recompute  // exit_code: 0, or 1 for an invalid file

}  // namespace kvc::cli
