// kvcache tiny-model FILE: writes the built-in tiny llama model (deterministic weights) as GGUF, to try the
// runtime, the demo or other engines on. The defaults give the workplace llama-peer's tiny_llama.gguf.
#include <memory>
#include <string>

#include <fmt/format.h>
#include <kvcache/runtime/tiny_model.h>

#include "commands.h"

namespace kvc::cli {

void add_tiny_model_command(CLI::App& app) {
    struct options {
        std::string path, weights = "f32";
        tiny_model_options m;
    };
    auto opt = std::make_shared<options>();
    CLI::App* cmd =
        app.add_subcommand("tiny-model", "Write a tiny llama model with deterministic weights (GGUF)");
    cmd->add_option("FILE", opt->path, "output file")->required();
    cmd->add_option("--n-embd", opt->m.n_embd, "embedding length")->capture_default_str();
    cmd->add_option("--n-layer", opt->m.n_layer, "layers")->capture_default_str();
    cmd->add_option("--n-head", opt->m.n_head, "attention heads")->capture_default_str();
    cmd->add_option("--n-head-kv", opt->m.n_head_kv, "key/value heads")->capture_default_str();
    cmd->add_option("--n-ff", opt->m.n_ff, "feed-forward length")->capture_default_str();
    cmd->add_option("--n-vocab", opt->m.n_vocab, "vocabulary size")->capture_default_str();
    cmd->add_option("--weights", opt->weights, "type of the weight matrices: f32, f16, bf16, q8_0, q4_0")
        ->capture_default_str();
    cmd->callback([opt] {
        opt->m.weight_type = parse_dtype(opt->weights);
        const uint64_t bytes = write_tiny_model(opt->path, opt->m);
        fmt::print("wrote {} ({} bytes)\n", opt->path, bytes);
    });
}

}  // namespace kvc::cli
