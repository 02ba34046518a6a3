// kvcache tiny-model FILE [--arch llama|mamba|jamba]: writes a built-in tiny model (deterministic weights)
// as GGUF, to try the runtime, the demo or other engines on. The defaults give the workplace llama-peer's
// tiny_llama.gguf, tiny_mamba.gguf or tiny_jamba.gguf.
#include <memory>
#include <string>

#include <fmt/format.h>
#include <kvcache/runtime/tiny_model.h>

#include "commands.h"

namespace kvc::cli {

void add_tiny_model_command(CLI::App& app) {
    struct options {
        std::string path, weights = "f32", arch = "llama";
        tiny_model_options m;
    };
    auto opt = std::make_shared<options>();
    CLI::App* cmd = app.add_subcommand(
        "tiny-model", "Write a tiny llama, mamba or jamba model with deterministic weights (GGUF)");
    cmd->add_option("FILE", opt->path, "output file")->required();
    cmd->add_option("--arch", opt->arch, "llama, mamba (Mamba-1) or jamba (Mamba + attention)")
        ->capture_default_str();
    cmd->add_option("--n-embd", opt->m.n_embd, "embedding length")->capture_default_str();
    cmd->add_option("--n-layer", opt->m.n_layer, "layers")->capture_default_str();
    cmd->add_option("--n-head", opt->m.n_head, "attention heads")->capture_default_str();
    cmd->add_option("--n-head-kv", opt->m.n_head_kv, "key/value heads")->capture_default_str();
    cmd->add_option("--n-ff", opt->m.n_ff, "feed-forward length")->capture_default_str();
    cmd->add_option("--n-vocab", opt->m.n_vocab, "vocabulary size")->capture_default_str();
    cmd->add_option("--weights", opt->weights, "type of the weight matrices: f32, f16, bf16, q8_0, q4_0")
        ->capture_default_str();
    cmd->add_option("--d-inner", opt->m.d_inner, "Mamba inner width (0: 2 x n_embd)")->capture_default_str();
    cmd->add_option("--d-state", opt->m.d_state, "Mamba state per channel")->capture_default_str();
    cmd->callback([opt, cmd] {
        if (opt->arch != "llama") {
            if (opt->arch != "mamba" && opt->arch != "jamba")
                throw CLI::ValidationError("--arch",
                                           fmt::format("'{}' is not llama, mamba or jamba", opt->arch));
            // the peer's shapes, then what the command line gave
            tiny_model_options m =
                opt->arch == "mamba" ? tiny_model_options::mamba() : tiny_model_options::jamba();
            const auto take = [&](const char* name, uint32_t tiny_model_options::*field) {
                if (cmd->count(name) > 0) m.*field = opt->m.*field;
            };
            take("--n-embd", &tiny_model_options::n_embd);
            take("--n-layer", &tiny_model_options::n_layer);
            take("--n-head", &tiny_model_options::n_head);
            take("--n-head-kv", &tiny_model_options::n_head_kv);
            take("--n-ff", &tiny_model_options::n_ff);
            take("--n-vocab", &tiny_model_options::n_vocab);
            take("--d-inner", &tiny_model_options::d_inner);
            take("--d-state", &tiny_model_options::d_state);
            opt->m = m;
        }
        opt->m.weight_type = parse_dtype(opt->weights);
        const uint64_t bytes = write_tiny_model(opt->path, opt->m);
        fmt::print("wrote {} ({} bytes)\n", opt->path, bytes);
    });
}

}  // namespace kvc::cli
