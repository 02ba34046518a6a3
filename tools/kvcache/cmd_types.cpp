// kvcache types: the element types K/V can be stored in, with their cost and the error they introduce
// on real-looking data, measured on this machine with the kernels in use.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <kvcache/dtype.h>
#include <kvcache/types.h>

#include "commands.h"

namespace kvc::cli {
namespace {

struct types_options {
    int64_t n = 1 << 20;
    int64_t head_dim = 128;
    std::string simd;
    bool json = false;
};

struct type_report {
    dtype type;
    double rmse = 0, max_abs = 0, encode_gbs = 0, decode_gbs = 0;
};

// Best of a few runs of fn, in GB/s of f32 data processed.
template <class F>
double throughput(int64_t n, F&& fn) {
    double best = 1e300;
    for (int rep = 0; rep < 5; ++rep) {
        const auto t0 = std::chrono::steady_clock::now();
        fn();
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        best = std::min(best, s);
    }
    return static_cast<double>(n) * sizeof(float) / best / 1e9;
}

void run_types(const types_options& opt) {
    if (opt.n <= 0 || opt.n % 32 != 0)
        throw error(errc::invalid_argument, fmt::format("--n {} must be a positive multiple of 32", opt.n));
    if (opt.head_dim <= 0 || opt.head_dim % 32 != 0)
        throw error(errc::invalid_argument,
                    fmt::format("--head-dim {} must be a positive multiple of 32", opt.head_dim));
    if (!opt.simd.empty()) {
        simd_level want = simd_level::scalar;
        if (opt.simd == "avx2")
            want = simd_level::avx2;
        else if (opt.simd == "avx512")
            want = simd_level::avx512;
        else if (opt.simd != "scalar")
            throw error(errc::invalid_argument,
                        fmt::format("--simd '{}': expected scalar, avx2 or avx512", opt.simd));
        if (set_simd_level(want) != want)
            throw error(errc::unsupported, fmt::format("--simd {}: this CPU supports at most {}", opt.simd,
                                                       to_string(simd_supported())));
    }

    // Keys and values look roughly Gaussian with a few outliers; use exactly that.
    std::mt19937 rng(42);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> x(static_cast<size_t>(opt.n)), back(x.size());
    for (size_t i = 0; i < x.size(); ++i) x[i] = normal(rng) * (i % 97 == 0 ? 8.0f : 1.0f);

    std::vector<type_report> reports;
    for (dtype t : all_dtypes) {
        std::vector<std::byte> row(row_size(t, opt.n));
        type_report r{t};
        r.encode_gbs = throughput(opt.n, [&] { from_f32(t, x.data(), row.data(), opt.n); });
        r.decode_gbs = throughput(opt.n, [&] { to_f32(t, row.data(), back.data(), opt.n); });
        double se = 0;
        for (size_t i = 0; i < x.size(); ++i) {
            const double e = std::fabs(static_cast<double>(back[i]) - x[i]);
            se += e * e;
            r.max_abs = std::max(r.max_abs, e);
        }
        r.rmse = std::sqrt(se / static_cast<double>(x.size()));
        reports.push_back(r);
    }

    if (opt.json) {
        fmt::print("{{\"simd\": \"{}\", \"n\": {}, \"head_dim\": {}, \"types\": [", to_string(simd_active()),
                   opt.n, opt.head_dim);
        for (size_t i = 0; i < reports.size(); ++i) {
            const type_report& r = reports[i];
            fmt::print(
                "{}{{\"name\": \"{}\", \"ggml_type\": {}, \"block_size\": {}, \"type_size\": {}, "
                "\"bits_per_value\": {:.4g}, \"bytes_per_head_row\": {}, \"rmse\": {:.6g}, "
                "\"max_abs_error\": "
                "{:.6g}, \"encode_gbs\": {:.3f}, \"decode_gbs\": {:.3f}}}",
                i ? ", " : "", to_string(r.type), static_cast<int>(r.type), block_size(r.type),
                type_size(r.type), 8.0 * type_size(r.type) / block_size(r.type),
                row_size(r.type, opt.head_dim), r.rmse, r.max_abs, r.encode_gbs, r.decode_gbs);
        }
        fmt::print("]}}\n");
        return;
    }

    fmt::print("kvcache {} element types (kernels: {}, CPU supports: {})\n", version_string(),
               to_string(simd_active()), to_string(simd_supported()));
    fmt::print("error measured on {} values ~ N(0,1) with 1% outliers x8; speed in GB/s of f32 data\n\n",
               opt.n);
    fmt::print("{:<6} {:>5} {:>6} {:>6} {:>9} {:>10} {:>11} {:>11} {:>9} {:>9}\n", "type", "ggml", "block",
               "bytes", "bits/val", fmt::format("row[{}]", opt.head_dim), "rmse", "max|err|", "encode",
               "decode");
    for (const type_report& r : reports)
        fmt::print("{:<6} {:>5} {:>6} {:>6} {:>9.3g} {:>10} {:>11.3e} {:>11.3e} {:>9.2f} {:>9.2f}\n",
                   to_string(r.type), static_cast<int>(r.type), block_size(r.type), type_size(r.type),
                   8.0 * type_size(r.type) / block_size(r.type), row_size(r.type, opt.head_dim), r.rmse,
                   r.max_abs, r.encode_gbs, r.decode_gbs);
    fmt::print(
        "\nrow[{}]: bytes of one head's key or value row. `kvcache size` turns this into cache sizes.\n",
        opt.head_dim);
}

}  // namespace

void add_types_command(CLI::App& app) {
    auto opt = std::make_shared<types_options>();
    CLI::App* cmd =
        app.add_subcommand("types", "Element types for K/V: layout, size, measured error and speed");
    cmd->add_option("--n", opt->n, "values to convert (multiple of 32)")->capture_default_str();
    cmd->add_option("--head-dim", opt->head_dim, "head size for the bytes-per-row column")
        ->capture_default_str();
    cmd->add_option("--simd", opt->simd, "force kernels: scalar, avx2 or avx512");
    cmd->add_flag("--json", opt->json, "print JSON instead of a table");
    cmd->callback([opt] { run_types(*opt); });
}

}  // namespace kvc::cli
