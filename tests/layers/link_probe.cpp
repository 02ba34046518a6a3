// A program of the core layer that calls a function of the runtime library (KVC_PROBE_RUNTIME) or of the
// core (otherwise), linked against the core library alone (tests/layers/CMakeLists.txt): the first must
// fail to link, the second must link and run.
#include <cstdint>
#include <vector>

#include <kvcache/dtype.h>

#ifdef KVC_PROBE_RUNTIME
namespace kvc {
// <kvcache/runtime/tiny_model.h> is refused in this layer, so the probe declares what it calls.
struct tiny_model_options;
std::vector<uint8_t> tiny_model_bytes(const tiny_model_options& options);
}  // namespace kvc
#endif

int main(int argc, char** argv) {
#ifdef KVC_PROBE_RUNTIME
    if (argc > 1000)  // never true: the call only has to be linked
        return static_cast<int>(
            kvc::tiny_model_bytes(*reinterpret_cast<const kvc::tiny_model_options*>(argv)).size());
#endif
    (void)argc;
    (void)argv;
    return kvc::row_size(kvc::dtype::f16, 32) == 64 ? 0 : 1;
}
