// kvcache size: how much memory a KV cache of a given shape takes, per element type.
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <utility>

#include <fmt/format.h>
#include <kvcache/dtype.h>
#include <kvcache/memory_budget.h>
#include <kvcache/types.h>

#include "commands.h"

namespace kvc::cli {
namespace {

struct size_options {
    int64_t layers = 32;
    int64_t n_head_kv = 8;
    int64_t head_dim = 128;
    int64_t ctx = 4096;
    std::string type_k = "f16";
    std::string type_v = "f16";
};

std::string human(double bytes) {
    const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB", "ZiB", "YiB"};
    int u = 0;
    while (bytes >= 1024.0 && u < 8) {
        bytes /= 1024.0;
        ++u;
    }
    return fmt::format("{:.2f} {}", bytes, units[u]);
}

void run_size(const size_options& o) {
    // The limits of a kv_cache (cells are uint32, positions int32); within them no product overflows.
    const auto in_range = [](int64_t v, const char* name, int64_t max) {
        if (v <= 0 || v > max)
            throw error(errc::invalid_argument, fmt::format("{} must be in [1, {}], got {}", name, max, v));
    };
    in_range(o.layers, "--layers", 1 << 16);
    in_range(o.n_head_kv, "--n-head-kv", 1 << 16);
    in_range(o.head_dim, "--head-dim", 1 << 16);
    in_range(o.ctx, "--ctx", std::numeric_limits<int32_t>::max());
    const dtype tk = parse_dtype(o.type_k);
    const dtype tv = parse_dtype(o.type_v);
    const int64_t n_embd = o.n_head_kv * o.head_dim;  // values per token per layer
    // As the cache checks: a quantised head must be whole blocks (say which option to change).
    for (auto [t, name] : {std::pair{tk, "--type-k"}, std::pair{tv, "--type-v"}})
        if (o.head_dim % block_size(t) != 0)
            throw error(
                errc::invalid_argument,
                fmt::format("{} {}: a head of {} values is not a whole number of its blocks of {} values",
                            name, to_string(t), o.head_dim, block_size(t)));
    const double k_tok = static_cast<double>(row_size(tk, n_embd)) * static_cast<double>(o.layers);
    const double v_tok = static_cast<double>(row_size(tv, n_embd)) * static_cast<double>(o.layers);
    const double n = static_cast<double>(o.ctx);
    fmt::print("layers {}, {} kv heads x {} dims, {} cells, K {} / V {}\n", o.layers, o.n_head_kv, o.head_dim,
               o.ctx, to_string(tk), to_string(tv));
    fmt::print("  per token:  K {:>12}  V {:>12}  total {:>12}\n", human(k_tok), human(v_tok),
               human(k_tok + v_tok));
    fmt::print("  whole cache: K {:>11}  V {:>12}  total {:>12}\n", human(k_tok * n), human(v_tok * n),
               human((k_tok + v_tok) * n));
    // host memory is reserved for the whole cache and committed as cells are used (docs/memory.md)
    const double ram = static_cast<double>(physical_memory_bytes());
    fmt::print("  memory: committed as cells are used; the default budget (this machine's {} of RAM) {}\n",
               human(ram), (k_tok + v_tok) * n <= ram ? "allows it" : "refuses it: set memory_budget");
}

}  // namespace

void add_size_command(CLI::App& app) {
    auto opt = std::make_shared<size_options>();
    CLI::App* cmd = app.add_subcommand("size", "Memory a KV cache of the given shape needs");
    cmd->add_option("--layers", opt->layers, "attention layers")->capture_default_str();
    cmd->add_option("--n-head-kv", opt->n_head_kv, "K/V heads per layer")->capture_default_str();
    cmd->add_option("--head-dim", opt->head_dim, "values per head")->capture_default_str();
    cmd->add_option("--ctx", opt->ctx, "cells (tokens the cache holds)")->capture_default_str();
    cmd->add_option("--type-k", opt->type_k, "K element type: f32, f16, bf16, q8_0, q4_0")
        ->capture_default_str();
    cmd->add_option("--type-v", opt->type_v, "V element type")->capture_default_str();
    cmd->callback([opt] { run_size(*opt); });
}

}  // namespace kvc::cli
