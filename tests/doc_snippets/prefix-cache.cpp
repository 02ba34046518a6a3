// The harness of docs/prefix-cache.md's C++ fragments (scripts/doc_snippets.py, ctest docs.snippets): each
// SNIPPET line below is replaced by the doc's next block that names this file, in the doc's order, and
// the program must exit 0.
#include <numeric>
#include <vector>

#include "doc_engine.h"

using namespace kvc;
using doc::check;
using doc::decode;

int main() {
    const model& m = doc::model();
    const uint32_t n_ctx = 256, n_seq_max = 2;
    const seq_id_t s = 1;
    std::vector<token_t> system_prompt(32);  // two blocks of 16
    std::iota(system_prompt.begin(), system_prompt.end(), 1);
    std::vector<token_t> tokens = system_prompt;
    tokens.insert(tokens.end(), {101, 102, 103, 104, 105, 106, 107, 108});

    // "The engine loop"
    // SNIPPET
    check(n == 0 && prefix.get_prefix_stats().blocks == 2,
          "the first request computes its prompt, 2 blocks stay");
    // the pin
    // SNIPPET
    check(prefix.get_prefix_stats().pinned_cells == 32, "the system prompt's cells are pinned");
    tokens.back() = 200;  // another request, another question
    check(prefix.prefix_attach(0, tokens) == 32, "the next request starts after the system prompt");

    return doc::failures == 0 ? 0 : 1;
}
