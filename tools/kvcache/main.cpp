// kvcache: command-line tools around the library.
#include <algorithm>
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <kvcache/types.h>
#include <kvcache/version.h>

#include "commands.h"

namespace {

size_t edit_distance(const std::string& a, const std::string& b) {
    std::vector<size_t> row(b.size() + 1);
    for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
    for (size_t i = 1; i <= a.size(); ++i) {
        size_t diag = row[0];
        row[0] = i;
        for (size_t j = 1; j <= b.size(); ++j) {
            const size_t up = row[j];
            row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
            diag = up;
        }
    }
    return row[b.size()];
}

// The nearest of `names` to a mistyped `given` ("" if none is near): a few edits away, or sharing a
// beginning of at least three characters after the dashes (--sequences -> --seqs).
std::string nearest(const std::string& given, const std::vector<std::string>& names) {
    std::string best;
    long best_score = 0;
    for (const std::string& name : names) {
        const size_t d = edit_distance(given, name);
        const size_t skip = given.find_first_not_of('-');
        size_t common = 0;
        while (skip != std::string::npos && skip + common < std::min(given.size(), name.size()) &&
               given[skip + common] == name[skip + common])
            ++common;
        if (d > std::max<size_t>(2, given.size() / 3) && common < 3) continue;
        const long score = static_cast<long>(d) - 2 * static_cast<long>(common);
        if (best.empty() || score < best_score) best = name, best_score = score;
    }
    return best;
}

std::string did_you_mean(const std::string& given, const std::vector<std::string>& names) {
    const std::string near = nearest(given, names);
    return near.empty() ? std::string() : fmt::format(" (did you mean '{}'?)", near);
}

// A usage error said plainly, in the order typed, with the nearest command or option; CLI11's own
// message for anything else.
int usage_error(CLI::App& app, const CLI::ParseError& e) {
    const std::vector<CLI::App*> subs = app.get_subcommands();
    if (subs.empty()) {
        std::vector<std::string> commands;
        for (const CLI::App* sub : app.get_subcommands({})) commands.push_back(sub->get_name());
        const std::vector<std::string> rest = app.remaining();
        const auto word = std::find_if(rest.begin(), rest.end(),
                                       [](const std::string& a) { return a.empty() || a[0] != '-'; });
        if (word != rest.end())
            fmt::print(stderr, "kvcache: unknown command '{}'{}; the commands: {} (kvcache --help)\n", *word,
                       did_you_mean(*word, commands), fmt::join(commands, ", "));
        else if (!rest.empty())
            fmt::print(stderr, "kvcache: unknown option '{}' (kvcache --help)\n", rest.front());
        else
            fmt::print(stderr, "kvcache: a command is needed: {} (kvcache --help)\n",
                       fmt::join(commands, ", "));
        return 2;
    }
    if (dynamic_cast<const CLI::ExtrasError*>(&e) != nullptr) {
        // The extras are the command's, or the top level's when they came before it
        CLI::App* owner = subs.back();
        if (owner->remaining().empty()) owner = &app;
        const std::string who = owner == &app ? "kvcache" : "kvcache " + owner->get_name();
        std::vector<std::string> options;
        for (const CLI::Option* opt : owner->get_options()) {
            for (const std::string& l : opt->get_lnames()) options.push_back("--" + l);
            for (const std::string& s : opt->get_snames()) options.push_back("-" + s);
        }
        for (const std::string& arg : owner->remaining()) {
            const std::string name = arg.substr(0, arg.find('='));
            const bool option = name.size() > 1 && name[0] == '-';
            fmt::print(stderr, "{0}: {1} '{2}'{3} ({0} --help lists the options)\n", who,
                       option ? "unknown option" : "unexpected argument", name,
                       option ? did_you_mean(name, options) : std::string());
            return 2;
        }
    }
    app.exit(e);
    return 2;
}

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
        return usage_error(app, e);
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
    // Line by line even into a pipe or a file (`kvcache demo | tee log`), as on a terminal
    std::setvbuf(stdout, nullptr, _IOLBF, 0);
    try {
        return run(argc, argv);
    } catch (...) {  // nothing may escape main: report and fail
        std::fprintf(stderr, "kvcache: fatal error\n");
        return 1;
    }
}
