// kvcache: command-line tools around the library.
#include <cstdio>
#include <exception>

#include <kvcache/types.h>
#include <kvcache/version.h>

#include "commands.h"

namespace {

int run(int argc, char** argv) {
    CLI::App app{"kvcache " KVC_VERSION_STRING ": sequence memory for LLM inference engines", "kvcache"};
    app.set_version_flag("-V,--version", std::string("kvcache ") + kvc::version_string());
    app.require_subcommand(1);
    int exit_code = 0;
    kvc::cli::add_demo_command(app, exit_code);
    kvc::cli::add_types_command(app);
    kvc::cli::add_size_command(app);
    kvc::cli::add_tiny_model_command(app);
    kvc::cli::add_bench_command(app);
    kvc::cli::add_replay_command(app, exit_code);
    kvc::cli::add_inspect_command(app, exit_code);
    kvc::cli::add_sim_command(app);
    try {
        app.parse(argc, argv);
    } catch (const CLI::CallForHelp& e) {
        return app.exit(e);
    } catch (const CLI::CallForAllHelp& e) {
        return app.exit(e);
    } catch (const CLI::CallForVersion& e) {
        return app.exit(e);
    } catch (const CLI::ParseError& e) {
        app.exit(e);
        return 2;  // usage error
    } catch (const kvc::error& e) {
        std::fprintf(stderr, "kvcache: error: %s\n", e.what());
        return 1;
    } catch (const std::exception& e) {
        std::fprintf(stderr, "kvcache: unexpected error: %s\n", e.what());
        return 1;
    }
    return exit_code;
}

}  // namespace

int main(int argc, char** argv) {
    try {
        return run(argc, argv);
    } catch (...) {  // nothing may escape main: report and fail
        std::fprintf(stderr, "kvcache: fatal error\n");
        return 1;
    }
}
