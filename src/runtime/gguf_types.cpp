// The value types' names and ggml's tensor type table of include/kvcache/runtime/gguf.h (the reader and
// writer are gguf.cpp).
#include <kvcache/runtime/gguf.h>

namespace kvc {

const char* to_string(gguf_type t) {
    switch (t) {
        case gguf_type::u8:
            return "u8";
        case gguf_type::i8:
            return "i8";
        case gguf_type::u16:
            return "u16";
        case gguf_type::i16:
            return "i16";
        case gguf_type::u32:
            return "u32";
        case gguf_type::i32:
            return "i32";
        case gguf_type::f32:
            return "f32";
        case gguf_type::boolean:
            return "bool";
        case gguf_type::string:
            return "string";
        case gguf_type::array:
            return "array";
        case gguf_type::u64:
            return "u64";
        case gguf_type::i64:
            return "i64";
        case gguf_type::f64:
            return "f64";
    }
    return "unknown";
}

std::optional<ggml_type_traits> ggml_type_info(uint32_t ggml_type) {
    // ggml's type ids and block layouts (ggml.h, ggml-common.h); gaps are ids ggml has retired.
    switch (ggml_type) {
        case 0:
            return ggml_type_traits{"f32", 1, 4};
        case 1:
            return ggml_type_traits{"f16", 1, 2};
        case 2:
            return ggml_type_traits{"q4_0", 32, 18};
        case 3:
            return ggml_type_traits{"q4_1", 32, 20};
        case 6:
            return ggml_type_traits{"q5_0", 32, 22};
        case 7:
            return ggml_type_traits{"q5_1", 32, 24};
        case 8:
            return ggml_type_traits{"q8_0", 32, 34};
        case 9:
            return ggml_type_traits{"q8_1", 32, 36};
        case 10:
            return ggml_type_traits{"q2_K", 256, 84};
        case 11:
            return ggml_type_traits{"q3_K", 256, 110};
        case 12:
            return ggml_type_traits{"q4_K", 256, 144};
        case 13:
            return ggml_type_traits{"q5_K", 256, 176};
        case 14:
            return ggml_type_traits{"q6_K", 256, 210};
        case 15:
            return ggml_type_traits{"q8_K", 256, 292};
        case 16:
            return ggml_type_traits{"iq2_xxs", 256, 66};
        case 17:
            return ggml_type_traits{"iq2_xs", 256, 74};
        case 18:
            return ggml_type_traits{"iq3_xxs", 256, 98};
        case 19:
            return ggml_type_traits{"iq1_s", 256, 50};
        case 20:
            return ggml_type_traits{"iq4_nl", 32, 18};
        case 21:
            return ggml_type_traits{"iq3_s", 256, 110};
        case 22:
            return ggml_type_traits{"iq2_s", 256, 82};
        case 23:
            return ggml_type_traits{"iq4_xs", 256, 136};
        case 24:
            return ggml_type_traits{"i8", 1, 1};
        case 25:
            return ggml_type_traits{"i16", 1, 2};
        case 26:
            return ggml_type_traits{"i32", 1, 4};
        case 27:
            return ggml_type_traits{"i64", 1, 8};
        case 28:
            return ggml_type_traits{"f64", 1, 8};
        case 29:
            return ggml_type_traits{"iq1_m", 256, 56};
        case 30:
            return ggml_type_traits{"bf16", 1, 2};
        case 34:
            return ggml_type_traits{"tq1_0", 256, 54};
        case 35:
            return ggml_type_traits{"tq2_0", 256, 66};
        case 39:
            return ggml_type_traits{"mxfp4", 32, 17};
        default:
            return std::nullopt;
    }
}

}  // namespace kvc
