// The submodule kvcache._kvcache.runtime: GGUF models, the tiny model, the reference runtime and its oracle
// (common.h has the map and the locking rule).
#include <pybind11/stl.h>

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <kvcache/runtime/runtime.h>
#include <kvcache/runtime/tiny_model.h>

#include "common.h"

namespace kvc::py_binding {

namespace {

// A runtime decoding through a memory: it borrows the model and the memory, which it keeps alive.
struct py_runtime {
    std::shared_ptr<const model> m;
    py_memory memory;
    py::object memory_object;  // the Python object it was given (Runtime.memory returns it)
    std::unique_ptr<runtime> rt;
};

// The oracle has no memory of the library's: its own lock.
struct py_reference {
    std::shared_ptr<const model> m;
    std::unique_ptr<reference_memory> ref;
    std::mutex mutex;

    template <class F>
    auto locked(F&& f) {
        py::gil_scoped_release nogil;
        std::lock_guard<std::mutex> lock(mutex);
        return std::forward<F>(f)();
    }
};

const char* to_string(model_arch a) {
    switch (a) {
        case model_arch::llama:
            return "llama";
        case model_arch::mamba:
            return "mamba";
        case model_arch::jamba:
            return "jamba";
    }
    return "?";
}

const char* to_string(model_memory k) {
    switch (k) {
        case model_memory::kv:
            return "kv";
        case model_memory::recurrent:
            return "recurrent";
        case model_memory::hybrid:
            return "hybrid";
    }
    return "?";
}

py::dict result_dict(const decode_result& r, uint32_t n_vocab) {
    py::dict d;
    d["status"] = r.status;
    d["n_ubatches"] = r.n_ubatches;
    d["output_ids"] = to_numpy(r.output_ids);
    py::array_t<float> logits({static_cast<py::ssize_t>(n_vocab == 0 ? 0 : r.logits.size() / n_vocab),
                               static_cast<py::ssize_t>(n_vocab)});
    std::copy(r.logits.begin(), r.logits.end(), logits.mutable_data());
    d["logits"] = logits;
    return d;
}

tiny_model_options tiny_options(const std::string& arch, const py::kwargs& kw) {
    tiny_model_options o;
    if (arch == "mamba") {
        o = tiny_model_options::mamba();
    } else if (arch == "jamba") {
        o = tiny_model_options::jamba();
    } else if (arch != "llama") {
        fail_argument("tiny model: arch '" + arch + "' is not llama, mamba or jamba");
    }
    for (const auto& [k, v] : kw) {
        const auto name = k.cast<std::string>();
        uint32_t* field = nullptr;
        if (name == "n_vocab") field = &o.n_vocab;
        if (name == "n_embd") field = &o.n_embd;
        if (name == "n_head") field = &o.n_head;
        if (name == "n_head_kv") field = &o.n_head_kv;
        if (name == "n_layer") field = &o.n_layer;
        if (name == "n_ff") field = &o.n_ff;
        if (name == "n_ctx_train") field = &o.n_ctx_train;
        if (name == "d_inner") field = &o.d_inner;
        if (name == "d_state") field = &o.d_state;
        if (name == "attn_period") field = &o.attn_period;
        if (field != nullptr) {
            *field = v.cast<uint32_t>();
        } else if (name == "seed") {
            o.seed = v.cast<uint64_t>();
        } else if (name == "weight_type") {
            o.weight_type = v.cast<dtype>();
        } else if (name == "rope_freq_base") {
            o.rope_freq_base = v.cast<float>();
        } else {
            fail_argument("tiny model: no option '" + name + "'");
        }
    }
    return o;
}

}  // namespace

void bind_runtime(py::module_& parent) {
    py::module_ m =
        parent.def_submodule("runtime", "The reference runtime: GGUF models decoded through a memory.");

    m.def(
        "write_tiny_model",
        [](const std::string& path, const std::string& arch, const py::kwargs& kw) {
            const tiny_model_options o = tiny_options(arch, kw);
            py::gil_scoped_release nogil;
            return write_tiny_model(path, o);
        },
        py::arg("path"), py::arg("arch") = "llama",
        "Writes the tiny test model (deterministic weights) as GGUF; arch llama, mamba or jamba; keyword "
        "arguments override its shape (n_vocab, n_embd, n_head, n_head_kv, n_layer, n_ff, seed, weight_type, "
        "...). Returns the file size.");
    m.def(
        "tiny_model_bytes",
        [](const std::string& arch, const py::kwargs& kw) {
            const tiny_model_options o = tiny_options(arch, kw);
            std::vector<uint8_t> b;
            {
                py::gil_scoped_release nogil;
                b = tiny_model_bytes(o);
            }
            return py::bytes(reinterpret_cast<const char*>(b.data()), b.size());
        },
        py::arg("arch") = "llama", "The tiny model's GGUF bytes (see write_tiny_model).");

    py::class_<model_hparams>(m, "ModelHParams", "A model's hyper-parameters, as its GGUF file states them.")
        .def_property_readonly("arch", [](const model_hparams& h) { return to_string(h.arch); })
        .def_readonly("name", &model_hparams::name)
        .def_readonly("n_vocab", &model_hparams::n_vocab)
        .def_readonly("n_ctx_train", &model_hparams::n_ctx_train)
        .def_readonly("n_embd", &model_hparams::n_embd)
        .def_readonly("n_layer", &model_hparams::n_layer)
        .def_readonly("n_ff", &model_hparams::n_ff)
        .def_readonly("n_head", &model_hparams::n_head)
        .def_readonly("n_head_kv", &model_hparams::n_head_kv)
        .def_readonly("n_embd_head", &model_hparams::n_embd_head)
        .def_readonly("rope", &model_hparams::rope)
        .def_readonly("weight_type", &model_hparams::weight_type)
        .def_readonly("recurrent", &model_hparams::recurrent);

    py::class_<model, std::shared_ptr<model>>(m, "Model", "A GGUF model, memory-mapped.")
        .def(py::init([](const std::string& path) {
                 py::gil_scoped_release nogil;
                 return std::make_shared<model>(model::load(path));
             }),
             py::arg("path"), "Loads and checks a GGUF file (raises naming the key or tensor that is wrong).")
        .def_static(
            "load",
            [](const std::string& path) {
                py::gil_scoped_release nogil;
                return std::make_shared<model>(model::load(path));
            },
            py::arg("path"))
        .def_property_readonly("hparams", &model::hparams, py::return_value_policy::reference_internal)
        .def_property_readonly(
            "memory_kind", [](const model& md) { return to_string(md.memory_kind()); },
            "'kv' (llama), 'recurrent' (mamba) or 'hybrid' (jamba).")
        .def("layers", &model::layers, "The layers as a KV cache sees them.")
        .def(
            "cache_params",
            [](const model& md, uint32_t kv_size, uint32_t n_seq_max) {
                kv_cache_params p = md.cache_params(kv_size, n_seq_max);
                p.auto_update = true;  // as KVCacheParams() in Python
                return p;
            },
            py::arg("kv_size"), py::arg("n_seq_max") = 1,
            "KVCacheParams for this model (f16 K/V, one stream, auto_update; adjust before creating the "
            "cache).")
        .def("recr_params", &model::recr_params, py::arg("n_seq_max") = 1,
             "RecurrentParams for a Mamba model.")
        .def(
            "hybrid_params",
            [](const model& md, uint32_t kv_size, uint32_t n_seq_max) {
                memory_hybrid_params p = md.hybrid_params(kv_size, n_seq_max);
                p.attn.auto_update = true;
                return p;
            },
            py::arg("kv_size"), py::arg("n_seq_max") = 1, "MemoryHybridParams for a Jamba model.");

    py::class_<py_runtime>(
        m, "Runtime",
        "Decodes batches with a model through a memory (KVCache, KVCacheISWA, MemoryRecurrent "
        "or MemoryHybrid), as an engine's llama_decode does.")
        .def(py::init([](const std::shared_ptr<model>& md, const py::object& memory, uint32_t n_threads,
                         uint32_t n_ubatch, bool embd_all) {
                 const auto& mem = memory.cast<const py_memory&>();
                 auto r = std::make_unique<py_runtime>();
                 r->m = md;
                 r->memory = mem;
                 r->memory_object = memory;
                 runtime_params p;
                 p.n_threads = n_threads;
                 p.n_ubatch = n_ubatch;
                 p.embd_all = embd_all;
                 r->rt = mem.locked([&] { return std::make_unique<runtime>(*md, *mem.mem, p); });
                 return r;
             }),
             py::arg("model"), py::arg("memory"), py::kw_only(), py::arg("n_threads") = 0,
             py::arg("n_ubatch") = 512, py::arg("embd_all") = false)
        .def(
            "decode",
            [](const py_runtime& r, const py_batch& b) {
                const batch view = b.view();
                const decode_result res = r.memory.locked([&] { return r.rt->decode(view); });
                return result_dict(res, r.m->hparams().n_vocab);
            },
            py::arg("batch"),
            "Decodes a batch: a dict of status, n_ubatches, output_ids (batch index of each output row) and "
            "logits [n_outputs, n_vocab] (float32), in batch order. An invalid batch raises, memory "
            "unchanged; "
            "status failed_prepare: no room, nothing changed.")
        .def_property_readonly("model", [](const py_runtime& r) { return r.m; })
        .def_property_readonly("memory", [](const py_runtime& r) { return r.memory_object; });

    py::class_<py_reference>(
        m, "ReferenceMemory",
        "The oracle: plain f32 keys and values per sequence, attention recomputed from them.")
        .def(py::init([](const std::shared_ptr<model>& md, uint32_t n_seq_max, uint32_t n_threads) {
                 auto r = std::make_unique<py_reference>();
                 r->m = md;
                 r->ref = std::make_unique<reference_memory>(*md, n_seq_max, n_threads);
                 return r;
             }),
             py::arg("model"), py::arg("n_seq_max") = 1, py::arg("n_threads") = 0)
        .def(
            "decode",
            [](py_reference& r, const py_batch& b) {
                const batch view = b.view();
                const decode_result res = r.locked([&] { return r.ref->decode(view); });
                return result_dict(res, r.m->hparams().n_vocab);
            },
            py::arg("batch"), "As Runtime.decode, recomputed.")
        .def(
            "set_swa",
            [](py_reference& r, uint32_t n_swa, swa_type t, std::vector<bool> layers) {
                r.locked([&] { r.ref->set_swa(n_swa, t, std::move(layers)); });
            },
            py::arg("n_swa"), py::arg("type"), py::arg("swa_layers") = std::vector<bool>{})
        .def("clear", [](py_reference& r) { r.locked([&] { r.ref->clear(); }); })
        .def(
            "seq_rm",
            [](py_reference& r, seq_id_t s, pos_t p0, pos_t p1) {
                return r.locked([&] { return r.ref->seq_rm(s, p0, p1); });
            },
            py::arg("seq_id"), py::arg("p0") = -1, py::arg("p1") = -1)
        .def(
            "seq_cp",
            [](py_reference& r, seq_id_t a, seq_id_t b, pos_t p0, pos_t p1) {
                r.locked([&] { r.ref->seq_cp(a, b, p0, p1); });
            },
            py::arg("src"), py::arg("dst"), py::arg("p0") = -1, py::arg("p1") = -1)
        .def(
            "seq_keep", [](py_reference& r, seq_id_t s) { r.locked([&] { r.ref->seq_keep(s); }); },
            py::arg("seq_id"))
        .def(
            "seq_add",
            [](py_reference& r, seq_id_t s, pos_t p0, pos_t p1, pos_t d) {
                r.locked([&] { r.ref->seq_add(s, p0, p1, d); });
            },
            py::arg("seq_id"), py::arg("p0"), py::arg("p1"), py::arg("shift"))
        .def(
            "seq_div",
            [](py_reference& r, seq_id_t s, pos_t p0, pos_t p1, int d) {
                r.locked([&] { r.ref->seq_div(s, p0, p1, d); });
            },
            py::arg("seq_id"), py::arg("p0"), py::arg("p1"), py::arg("d"))
        .def(
            "seq_pos_min",
            [](py_reference& r, seq_id_t s) { return r.locked([&] { return r.ref->seq_pos_min(s); }); },
            py::arg("seq_id"))
        .def(
            "seq_pos_max",
            [](py_reference& r, seq_id_t s) { return r.locked([&] { return r.ref->seq_pos_max(s); }); },
            py::arg("seq_id"));

    m.def("logits_tolerance", &logits_tolerance, py::arg("type"),
          "The documented bound on max |cache - reference| / max |reference| for K/V stored as type.");
    m.def(
        "relative_diff",
        [](const py::array_t<float, py::array::c_style | py::array::forcecast>& a,
           const py::array_t<float, py::array::c_style | py::array::forcecast>& ref) {
            if (a.size() != ref.size()) fail_argument("relative_diff: arrays of different sizes");
            return relative_diff({a.data(), static_cast<size_t>(a.size())},
                                 {ref.data(), static_cast<size_t>(ref.size())});
        },
        py::arg("a"), py::arg("ref"), "max |a - ref| / max |ref|.");
}

}  // namespace kvc::py_binding
