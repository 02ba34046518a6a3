// Batch contexts: ubatches, K/V rows in, K/V views and masks out, the recurrent rows and the recurrent
// engine contract (common.h has the map and the locking rule).
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include <kvcache/recurrent_engine.h>

#include "common.h"

namespace kvc::py_binding {

namespace {

// A recurrent_step of a context's applied ubatch; valid until the context moves on, which `generation`
// detects (the step reads the context's history copies).
struct py_step {
    std::shared_ptr<context_state> state;
    std::unique_ptr<recurrent_step> step;
    uint64_t generation = 0;
};

py::object ubatch_pos(const ubatch& ub) {
    py::array_t<pos_t> out;
    if (ub.n_pos <= 1) {
        out = to_numpy(ub.pos);
    } else {
        out = py::array_t<pos_t>({static_cast<py::ssize_t>(ub.n_pos), static_cast<py::ssize_t>(ub.n_tokens)});
        std::copy(ub.pos.begin(), ub.pos.end(), out.mutable_data());
    }
    return out;
}

void bind_ubatch(py::module_& m) {
    py::class_<ubatch>(m, "Ubatch", "A micro-batch (a copy of the context's current one).")
        .def_readonly("n_tokens", &ubatch::n_tokens)
        .def_readonly("n_seq_tokens", &ubatch::n_seq_tokens)
        .def_readonly("n_seqs", &ubatch::n_seqs)
        .def_readonly("n_seqs_unq", &ubatch::n_seqs_unq)
        .def_readonly("n_pos", &ubatch::n_pos)
        .def_readonly("n_embd", &ubatch::n_embd)
        .def_readonly("equal_seqs", &ubatch::equal_seqs)
        .def_property_readonly("token", [](const ubatch& u) { return to_numpy(u.token); })
        .def_property_readonly(
            "embd",
            [](const ubatch& u) {
                py::array_t<float> out({static_cast<py::ssize_t>(u.n_embd == 0 ? 0 : u.n_tokens),
                                        static_cast<py::ssize_t>(u.n_embd)});
                std::copy(u.embd.begin(), u.embd.end(), out.mutable_data());
                return out;
            })
        .def_property_readonly("pos", &ubatch_pos, "[n_tokens] positions ([n_pos, n_tokens] for M-RoPE)")
        .def_property_readonly("output",
                               [](const ubatch& u) {
                                   std::vector<bool> out(u.output.begin(), u.output.end());
                                   return py::array(py::cast(out));
                               })
        .def_property_readonly("batch_idx", [](const ubatch& u) { return to_numpy(u.batch_idx); })
        .def_property_readonly("seq_id_unq", [](const ubatch& u) { return to_numpy(u.seq_id_unq); })
        .def_property_readonly("primary_seq",
                               [](const ubatch& u) {
                                   std::vector<seq_id_t> out(u.n_tokens);
                                   for (uint32_t i = 0; i < u.n_tokens; ++i) out[i] = u.primary_seq(i);
                                   return to_numpy(out);
                               })
        .def_property_readonly("seq_ids",
                               [](const ubatch& u) {
                                   std::vector<std::vector<seq_id_t>> out(u.n_tokens);
                                   for (uint32_t i = 0; i < u.n_tokens; ++i) {
                                       const auto ids = u.seq_ids(i);
                                       out[i].assign(ids.begin(), ids.end());
                                   }
                                   return out;
                               })
        .def("__len__", [](const ubatch& u) { return u.n_tokens; });
}

void bind_context(py::module_& m) {
    py::class_<py_context>(
        m, "Context",
        "The plan for one batch: apply() each ubatch, build its layers through attn(il) and "
        "recr(), next() to move on (or iterate: `for ub in ctx`).")
        .def_property_readonly("status", [](const py_context& c) { return c.state->ctx->get_status(); })
        .def_property_readonly(
            "failed", [](const py_context& c) { return is_fail(c.state->ctx->get_status()); },
            "No room: nothing changed, do not apply.")
        .def(
            "apply",
            [](const py_context& c) {
                context_state& st = *c.state;
                st.memory.locked([&] { st.ctx->apply(); });
                ++st.generation;
            },
            "Commits the current ubatch: its tokens now occupy their cells.")
        .def(
            "next",
            [](const py_context& c) {
                context_state& st = *c.state;
                const bool more = st.memory.locked([&] { return st.ctx->next(); });
                ++st.generation;
                return more;
            },
            "Moves to the next ubatch; False after the last.")
        .def_property_readonly(
            "ubatch", [](const py_context& c) { return c.state->ctx->get_ubatch(); },
            "The current ubatch (a copy).")
        .def_property_readonly(
            "out_ids",
            [](const py_context& c) {
                const auto ids = c.state->ctx->out_ids();
                return to_numpy(std::vector<int32_t>(ids.begin(), ids.end()));
            },
            "Batch index of each output row, in processing order.")
        .def(
            "attn",
            [](const py_context& c, uint32_t il) -> py::object {
                kv_cache_context* kc = c.state->ctx->get_attn(il);
                if (kc == nullptr) return py::none();
                return py::cast(py_attn_context{c.state, kc});
            },
            py::arg("il"),
            "The attention inputs of model layer il (of the cache holding it); None for a recurrent layer, a "
            "layer no cache keeps, or a failed context.")
        .def(
            "recr",
            [](const py_context& c) -> py::object {
                memory_recurrent_context* rc = c.state->ctx->get_recr();
                if (rc == nullptr) return py::none();
                return py::cast(py_recr_context{c.state, rc});
            },
            "The recurrent state rows; None without a recurrent part.");
}

void bind_attn(py::module_& m) {
    py::class_<py_attn_context>(
        m, "AttnContext", "Per-ubatch attention inputs of one KV cache: K/V rows in, views and the mask out.")
        .def_property_readonly(
            "n_kv", [](const py_attn_context& a) { return a.kc->get_n_kv(); },
            "Cells attention reads (0 before apply()).")
        .def_property_readonly(
            "cache",
            [](const py_attn_context& a) {
                const py_memory& pm = a.state->memory;
                auto* kv = const_cast<kv_cache*>(&a.kc->cache());
                return py::cast(py_kv_cache{make_memory(pm.owner, pm.mutex, kv)});
            },
            "The KVCache this context writes to (a part of the memory for iSWA and hybrid).")
        .def(
            "cpy_k",
            [](const py_attn_context& a, uint32_t il, const py::handle& src) {
                const auto in = numpy_to_view(src, "cpy_k");  // in.first owns the bytes in.second views
                a.state->memory.locked([&] { a.kc->cpy_k(il, in.second); });
            },
            py::arg("il"), py::arg("k"),
            "Writes the ubatch's K rows of layer il: [n_tokens, n_head_kv * head_dim] or [n_tokens, "
            "n_head_kv, "
            "head_dim], float32 (any float array is converted) or float16; after RoPE.")
        .def(
            "cpy_v",
            [](const py_attn_context& a, uint32_t il, const py::handle& src) {
                const auto in = numpy_to_view(src, "cpy_v");  // in.first owns the bytes in.second views
                a.state->memory.locked([&] { a.kc->cpy_v(il, in.second); });
            },
            py::arg("il"), py::arg("v"), "Writes the ubatch's V rows of layer il (as cpy_k).")
        .def(
            "get_k",
            [](const py_attn_context& a, uint32_t il) {
                const tensor_view v = a.state->memory.locked([&] { return a.kc->get_k(il); });
                return view_to_numpy(v, a.state->memory.owner, 4);
            },
            py::arg("il"),
            "A zero-copy view of layer il's K over the first n_kv cells: [n_stream, n_kv, n_head_kv, "
            "head_dim] "
            "(float32/float16; bf16 as uint16 bits; q8_0/q4_0 as uint8 blocks [..., head_dim / 32, block "
            "bytes]). It keeps the memory alive and sees later writes.")
        .def(
            "get_v",
            [](const py_attn_context& a, uint32_t il) {
                const tensor_view v = a.state->memory.locked([&] { return a.kc->get_v(il); });
                return view_to_numpy(v, a.state->memory.owner, 4);
            },
            py::arg("il"),
            "A zero-copy view of layer il's V: [n_stream, n_kv, n_head_kv, head_dim], or with v_trans "
            "[n_stream, head_dim, n_head_kv, n_kv] (cells fastest).")
        .def(
            "get_k_f32",
            [](const py_attn_context& a, uint32_t il) {
                const tensor_view v = a.state->memory.locked([&] { return a.kc->get_k(il); });
                return view_to_f32(v, 4);
            },
            py::arg("il"), "get_k's values as a float32 copy (any element type, quantised ones decoded).")
        .def(
            "get_v_f32",
            [](const py_attn_context& a, uint32_t il) {
                const tensor_view v = a.state->memory.locked([&] { return a.kc->get_v(il); });
                return view_to_f32(v, 4);
            },
            py::arg("il"), "get_v's values as a float32 copy.")
        .def(
            "kq_mask",
            [](const py_attn_context& a, bool causal, bool alibi, const py::object& dt) {
                const bool f16 = !dt.is_none() && py::dtype::from_args(dt).is(py::dtype("float16"));
                if (!dt.is_none() && !f16 && !py::dtype::from_args(dt).is(py::dtype::of<float>())) {
                    fail_argument("kq_mask: dtype must be float32 or float16");
                }
                const ubatch& ub = a.state->ctx->get_ubatch();
                const uint32_t n_kv = a.kc->get_n_kv();
                py::array out(f16 ? py::dtype("float16") : py::dtype::of<float>(),
                              std::vector<py::ssize_t>{static_cast<py::ssize_t>(ub.n_tokens), n_kv});
                auto view =
                    tensor_view::contiguous(f16 ? dtype::f16 : dtype::f32,
                                            static_cast<std::byte*>(out.mutable_data()), n_kv, ub.n_tokens);
                a.state->memory.locked([&] { a.kc->set_input_kq_mask(view, {causal, alibi}); });
                return out;
            },
            py::kw_only(), py::arg("causal") = true, py::arg("alibi") = false, py::arg("dtype") = py::none(),
            "The KQ mask [n_tokens, n_kv]: 0 where token t may see cell c, -inf elsewhere.")
        .def(
            "k_idxs", [](const py_attn_context& a) { return to_numpy(a.kc->k_idxs()); },
            "Per token, its K row stream * kv_size + cell (engines scattering rows themselves).")
        .def(
            "v_idxs", [](const py_attn_context& a, uint32_t il) { return to_numpy(a.kc->v_idxs(il)); },
            py::arg("il"), "V destinations: rows, or elements of transposed V.")
        .def_property_readonly(
            "sinfo",
            [](const py_attn_context& a) {
                const slot_info& s = a.kc->get_sinfo();
                py::dict d;
                d["s0"] = s.s0;
                d["s1"] = s.s1;
                d["strm"] = s.strm;
                d["idxs"] = s.idxs;
                return d;
            },
            "The current ubatch's cells: group k of tokens goes to stream strm[k], cells idxs[k].")
        .def(
            "k_shift",
            [](const py_attn_context& a) {
                const kv_cache& c = a.kc->cache();
                std::vector<int32_t> out(size_t{c.get_size()} * c.get_n_stream());
                a.state->memory.locked([&] { a.kc->set_input_k_shift(out); });
                return to_numpy(out);
            },
            "Pending shift of every cell [kv_size * n_stream].");
}

void bind_recr(py::module_& m) {
    py::class_<py_recr_context>(m, "RecrContext", "Per-ubatch recurrent state rows (the engine contract).")
        .def_property_readonly("n_rs", [](const py_recr_context& r) { return r.rc->get_n_rs(); })
        .def_property_readonly("n_seqs", [](const py_recr_context& r) { return r.rc->get_n_seqs(); })
        .def_property_readonly("head", [](const py_recr_context& r) { return r.rc->get_head(); })
        .def_property_readonly("rs_z", [](const py_recr_context& r) { return r.rc->get_rs_z(); })
        .def_property_readonly("size", [](const py_recr_context& r) { return r.rc->get_size(); })
        .def_property_readonly("n_rs_seq", [](const py_recr_context& r) { return r.rc->get_n_rs_seq(); })
        .def_property_readonly("s_copies",
                               [](const py_recr_context& r) {
                                   const auto s = r.rc->s_copies();
                                   return to_numpy(std::vector<int64_t>(s.begin(), s.end()));
                               })
        .def_property_readonly(
            "hist_copies",
            [](const py_recr_context& r) {
                const auto h = r.rc->hist_copies();
                py::array_t<int64_t> out({static_cast<py::ssize_t>(h.size()), py::ssize_t{2}});
                int64_t* d = out.mutable_data();
                for (const rs_copy& c : h) {
                    *d++ = c.src;
                    *d++ = c.dst;
                }
                return out;
            })
        .def(
            "get_r",
            [](const py_recr_context& r, uint32_t il) {
                return view_to_numpy(r.rc->get_r(il), r.state->memory.owner, 3);
            },
            py::arg("il"), "Layer il's r rows, a writable view [1 + n_rs_seq, size, n_embd_r].")
        .def(
            "get_s",
            [](const py_recr_context& r, uint32_t il) {
                return view_to_numpy(r.rc->get_s(il), r.state->memory.owner, 3);
            },
            py::arg("il"), "Layer il's s rows, a writable view [1 + n_rs_seq, size, n_embd_s].")
        .def(
            "step",
            [](const py_recr_context& r, uint32_t il, const std::string& which) {
                if (which != "r" && which != "s")
                    fail_argument("step: which must be 'r' or 's', got '" + which + "'");
                auto st = std::make_shared<py_step>();
                st->state = r.state;
                st->generation = r.state->generation;
                st->step = r.state->memory.locked([&] {
                    return std::make_unique<recurrent_step>(*r.rc, il,
                                                            which == "r" ? rs_tensor::r : rs_tensor::s);
                });
                return st;
            },
            py::arg("il"), py::arg("which"),
            "The engine contract for layer il's 'r' or 's' tensor of the applied ubatch (recurrent_step): "
            "zeroes, gathers and moves rows now; then per block b and token t, update state(b) in place and "
            "store(b, t); finish() once.");

    py::class_<py_step, std::shared_ptr<py_step>>(m, "RecurrentStep")
        .def_property_readonly("n_seqs", [](const py_step& s) { return s.step->n_seqs(); })
        .def_property_readonly("n_seq_tokens", [](const py_step& s) { return s.step->n_seq_tokens(); })
        .def_property_readonly("width", [](const py_step& s) { return s.step->width(); })
        .def(
            "state",
            [](const std::shared_ptr<py_step>& s, uint32_t b) {
                if (s->generation != s->state->generation) {
                    throw error(errc::invalid_state, "RecurrentStep.state: the context moved on");
                }
                const std::span<float> st = s->step->state(b);
                auto* keep = new std::shared_ptr<py_step>(s);
                py::capsule base(keep, [](void* p) { delete static_cast<std::shared_ptr<py_step>*>(p); });
                return py::array_t<float>({static_cast<py::ssize_t>(st.size())}, {py::ssize_t{sizeof(float)}},
                                          st.data(), base);
            },
            py::arg("b"), "Block b's working state (float32, a writable view).")
        .def(
            "store",
            [](const py_step& s, uint32_t b, uint32_t t) {
                if (s.generation != s.state->generation) {
                    throw error(errc::invalid_state, "RecurrentStep.store: the context moved on");
                }
                s.state->memory.locked([&] { s.step->store(b, t); });
            },
            py::arg("b"), py::arg("t"), "Records state(b) as block b's state after its token t.")
        .def(
            "finish",
            [](const py_step& s) {
                if (s.generation != s.state->generation) {
                    throw error(errc::invalid_state, "RecurrentStep.finish: the context moved on");
                }
                s.state->memory.locked([&] { s.step->finish(); });
            },
            "Writes the history copies; once, after every block stored its last token.");
}

}  // namespace

void bind_contexts(py::module_& m) {
    bind_ubatch(m);
    bind_context(m);
    bind_attn(m);
    bind_recr(m);
}

}  // namespace kvc::py_binding
