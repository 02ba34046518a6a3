// A source of some layer that includes one header, KVC_PROBE_HEADER (tests/layers/CMakeLists.txt):
// it must build when the header is of that layer or a lower one, and fail when it is of a higher one.
#include KVC_PROBE_HEADER

int kvc_layers_include_probe() {
    return 0;
}
