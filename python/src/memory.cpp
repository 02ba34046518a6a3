// The four memories: creation, batches, sequence operations, state, session files, the prefix cache and
// sizes (common.h has the map and the locking rule).
#include <pybind11/stl.h>

#include <string>
#include <utility>
#include <vector>

#include <kvcache/prefix_cache.h>
#include <kvcache/prefix_tiers.h>
#include <kvcache/session.h>
#include <kvcache/state.h>

#include "common.h"

namespace kvc::py_binding {

template <class M>
py_memory make_memory(std::shared_ptr<memory_i> owner, std::shared_ptr<std::mutex> mutex, M* mem) {
    py_memory pm;
    pm.owner = std::move(owner);
    pm.mutex = std::move(mutex);
    pm.mem = mem;
    if constexpr (std::is_same_v<M, kv_cache>) pm.kv = mem;
    if constexpr (std::is_same_v<M, kv_cache_iswa>) pm.iswa = mem;
    if constexpr (std::is_same_v<M, memory_recurrent>) pm.recr = mem;
    if constexpr (std::is_same_v<M, memory_hybrid>) pm.hybrid = mem;
    return pm;
}
template py_memory make_memory(std::shared_ptr<memory_i>, std::shared_ptr<std::mutex>, kv_cache*);

namespace {

// A part of the memory `of` (sharing its owner and lock), as an object of the part's Python class.
template <class M>
py::object wrap_part(const py_memory& of, M* part) {
    const py_memory pm = make_memory(of.owner, of.mutex, part);
    if constexpr (std::is_same_v<M, kv_cache>) return py::cast(py_kv_cache{pm});
    if constexpr (std::is_same_v<M, kv_cache_iswa>) return py::cast(py_kv_cache_iswa{pm});
    if constexpr (std::is_same_v<M, memory_recurrent>) return py::cast(py_memory_recurrent{pm});
}

}  // namespace

namespace {

template <class Kind, class Memory>
Kind make_owned(std::shared_ptr<Memory> m) {
    Kind k;
    Memory* raw = m.get();
    static_cast<py_memory&>(k) = make_memory(std::move(m), std::make_shared<std::mutex>(), raw);
    return k;
}

// Params from keyword arguments: the Python class of the parameters called with them.
template <class Params>
Params params_from(const char* cls, const py::kwargs& kw) {
    return py::module_::import("kvcache._kvcache").attr(cls)(**kw).template cast<Params>();
}

std::vector<token_t> tokens_of(const py::object& tokens, const char* what) {
    if (tokens.is_none()) return {};
    auto a = py::array_t<token_t, py::array::c_style | py::array::forcecast>::ensure(tokens);
    if (!a || a.ndim() != 1) fail_argument(std::string(what) + ": expected a 1-D list or array of token ids");
    return {a.data(), a.data() + a.size()};
}

py::bytes to_bytes(const std::vector<uint8_t>& v) {
    return {reinterpret_cast<const char*>(v.data()), v.size()};
}

state_seq_flags flags_of(bool partial) {
    return partial ? state_seq_flag_partial_only : 0;
}

uint32_t check_u8(uint32_t v, const char* what) {
    if (v > prefix_max_priority) {
        throw error(errc::out_of_range, std::string(what) + ": priority " + std::to_string(v) + " above " +
                                            std::to_string(prefix_max_priority));
    }
    return v;
}

void bind_reports(py::module_& m) {
    py::class_<memory_breakdown>(m, "MemoryBreakdown", "Where a memory's bytes are (K/V and state rows).")
        .def_readonly("reserved", &memory_breakdown::reserved)
        .def_readonly("committed", &memory_breakdown::committed)
        .def_readonly("used", &memory_breakdown::used)
        .def_readonly("cached", &memory_breakdown::cached)
        .def_readonly("pinned", &memory_breakdown::pinned)
        .def_readonly("free", &memory_breakdown::free)
        .def_readonly("seq", &memory_breakdown::seq)
        .def("__repr__", [](const memory_breakdown& b) {
            return "MemoryBreakdown(reserved=" + std::to_string(b.reserved) +
                   ", committed=" + std::to_string(b.committed) + ", used=" + std::to_string(b.used) +
                   ", cached=" + std::to_string(b.cached) + ", pinned=" + std::to_string(b.pinned) +
                   ", free=" + std::to_string(b.free) + ")";
        });

    py::class_<prefix_stats>(m, "PrefixStats", "What the prefix cache did and holds.")
        .def_readonly("lookups", &prefix_stats::lookups)
        .def_readonly("tokens_looked_up", &prefix_stats::tokens_looked_up)
        .def_readonly("hit_tokens", &prefix_stats::hit_tokens)
        .def_readonly("published_blocks", &prefix_stats::published_blocks)
        .def_readonly("evicted_blocks", &prefix_stats::evicted_blocks)
        .def_readonly("unpublished_blocks", &prefix_stats::unpublished_blocks)
        .def_readonly("dropped_blocks", &prefix_stats::dropped_blocks)
        .def_readonly("bytes_copied", &prefix_stats::bytes_copied)
        .def_readonly("event_errors", &prefix_stats::event_errors)
        .def_readonly("blocks", &prefix_stats::blocks)
        .def_readonly("cached_cells", &prefix_stats::cached_cells)
        .def_readonly("shared_cells", &prefix_stats::shared_cells)
        .def_readonly("pinned_cells", &prefix_stats::pinned_cells)
        .def_readonly("free_cells", &prefix_stats::free_cells)
        .def_readonly("index_bytes", &prefix_stats::index_bytes)
        .def_readonly("snapshots_saved", &prefix_stats::snapshots_saved)
        .def_readonly("snapshots_dropped", &prefix_stats::snapshots_dropped)
        .def_readonly("snapshots", &prefix_stats::snapshots)
        .def_readonly("swa_blocks", &prefix_stats::swa_blocks)
        .def_readonly("swa_published_blocks", &prefix_stats::swa_published_blocks)
        .def_readonly("swa_evicted_blocks", &prefix_stats::swa_evicted_blocks)
        .def_readonly("tier_fetched_blocks", &prefix_stats::tier_fetched_blocks)
        .def_readonly("tier_written_blocks", &prefix_stats::tier_written_blocks)
        .def("__repr__", [](const prefix_stats& s) {
            return "PrefixStats(lookups=" + std::to_string(s.lookups) +
                   ", hit_tokens=" + std::to_string(s.hit_tokens) + ", blocks=" + std::to_string(s.blocks) +
                   ", cached_cells=" + std::to_string(s.cached_cells) +
                   ", shared_cells=" + std::to_string(s.shared_cells) + ")";
        });

    py::class_<session_info>(m, "SessionInfo", "What a session file held.")
        .def_readonly("version", &session_info::version)
        .def_readonly("file_flags", &session_info::file_flags)
        .def_readonly("seq_id", &session_info::seq_id)
        .def_readonly("state_flags", &session_info::state_flags)
        .def_readonly("layout", &session_info::layout)
        .def_readonly("payload_bytes", &session_info::payload_bytes)
        .def_readonly("stored_bytes", &session_info::stored_bytes)
        .def_property_readonly("tokens", [](const session_info& s) { return to_numpy(s.tokens); });
}

void bind_memory_base(py::module_& m) {
    py::class_<py_memory>(m, "Memory",
                          "What every memory kind does: batches, sequence operations, state, session files.")
        .def(
            "init_batch",
            [](const py_memory& self, const py_batch& b, uint32_t n_ubatch, bool embd_all, int32_t n_vocab,
               bool output_all) {
                auto st = std::make_shared<context_state>();
                st->memory = self;
                const batch view = b.view();
                batch_options opt;
                opt.n_seq_max = self.mem->n_seq_max();
                opt.n_vocab = n_vocab;
                opt.n_embd = b.n_embd();
                opt.n_pos = self.mem->n_pos();
                opt.output_all = output_all;
                if (n_ubatch == 0) fail_argument("init_batch: n_ubatch must be > 0");
                self.locked([&] {
                    st->balloc.init(view, positions_of(*self.mem), opt);
                    st->ctx = self.mem->init_batch(st->balloc, n_ubatch, embd_all);
                });
                return py_context{st};
            },
            py::arg("batch"), py::arg("n_ubatch") = 512, py::arg("embd_all") = false, py::arg("n_vocab") = 0,
            py::arg("output_all") = false,
            "Validates the batch against the memory (an invalid batch raises, memory unchanged), splits it "
            "into "
            "ubatches of at most n_ubatch tokens and finds room for all of them. The context's status is "
            "failed_prepare when they do not fit (nothing changed).")
        .def(
            "init_full",
            [](const py_memory& self) {
                auto st = std::make_shared<context_state>();
                st->memory = self;
                st->ctx = self.locked([&] { return self.mem->init_full(); });
                return py_context{st};
            },
            "A context shaped like the largest ubatch (n_kv == kv_size), for reserving compute buffers.")
        .def(
            "update",
            [](const py_memory& self, bool optimize) {
                return self.locked([&] {
                    memory_context_ptr up = self.mem->init_update(optimize);
                    if (up->get_status() != memory_status::success) return false;
                    up->apply();
                    return true;
                });
            },
            py::arg("optimize") = false,
            "Runs pending maintenance (K-shift; compaction with optimize). False when there was none.")
        .def_property_readonly(
            "can_shift",
            [](const py_memory& self) { return self.locked([&] { return self.mem->get_can_shift(); }); })
        .def_property_readonly("n_seq_max", [](const py_memory& self) { return self.mem->n_seq_max(); })
        .def(
            "clear", [](const py_memory& self, bool data) { self.locked([&] { self.mem->clear(data); }); },
            py::arg("data") = false, "Every sequence leaves; data: also zero the stored rows.")
        .def(
            "seq_rm",
            [](const py_memory& self, seq_id_t s, pos_t p0, pos_t p1) {
                return self.locked([&] { return self.mem->seq_rm(s, p0, p1); });
            },
            py::arg("seq_id"), py::arg("p0") = -1, py::arg("p1") = -1,
            "Removes positions [p0, p1) of seq_id (-1: every sequence; p0 < 0: from 0; p1 < 0: to the end). "
            "False where the memory cannot (recurrent state without rollback), nothing changed then.")
        .def(
            "seq_cp",
            [](const py_memory& self, seq_id_t src, seq_id_t dst, pos_t p0, pos_t p1) {
                self.locked([&] { self.mem->seq_cp(src, dst, p0, p1); });
            },
            py::arg("src"), py::arg("dst"), py::arg("p0") = -1, py::arg("p1") = -1,
            "dst also holds src's positions [p0, p1) (shared cells in one stream: no copy).")
        .def(
            "seq_keep",
            [](const py_memory& self, seq_id_t s) { self.locked([&] { self.mem->seq_keep(s); }); },
            py::arg("seq_id"), "Every other sequence leaves.")
        .def(
            "seq_add",
            [](const py_memory& self, seq_id_t s, pos_t p0, pos_t p1, pos_t shift) {
                self.locked([&] { self.mem->seq_add(s, p0, p1, shift); });
            },
            py::arg("seq_id"), py::arg("p0"), py::arg("p1"), py::arg("shift"),
            "Positions in [p0, p1) move by shift (a K-shift becomes pending).")
        .def(
            "seq_div",
            [](const py_memory& self, seq_id_t s, pos_t p0, pos_t p1, int d) {
                self.locked([&] { self.mem->seq_div(s, p0, p1, d); });
            },
            py::arg("seq_id"), py::arg("p0"), py::arg("p1"), py::arg("d"),
            "Positions in [p0, p1) become pos // d.")
        .def(
            "seq_pos_min",
            [](const py_memory& self, seq_id_t s) {
                return self.locked([&] { return self.mem->seq_pos_min(s); });
            },
            py::arg("seq_id"), "Smallest position of seq_id, -1 when it holds none.")
        .def(
            "seq_pos_max",
            [](const py_memory& self, seq_id_t s) {
                return self.locked([&] { return self.mem->seq_pos_max(s); });
            },
            py::arg("seq_id"), "Largest position of seq_id, -1 when it holds none.")
        .def(
            "state_size",
            [](const py_memory& self, seq_id_t s, bool partial) {
                return self.locked([&] { return state_seq_get_size(*self.mem, s, flags_of(partial)); });
            },
            py::arg("seq_id") = -1, py::arg("partial") = false, "Bytes state_get would return.")
        .def_property_readonly(
            "state_max_bytes",
            [](const py_memory& self) { return self.locked([&] { return self.mem->state_max_bytes(); }); },
            "The largest state payload the memory can hold (what a session file's payload is checked "
            "against).")
        .def(
            "state_get",
            [](const py_memory& self, seq_id_t s, bool partial) {
                const auto data =
                    self.locked([&] { return state_seq_get_data(*self.mem, s, flags_of(partial)); });
                return to_bytes(data);
            },
            py::arg("seq_id") = -1, py::arg("partial") = false,
            "llama.cpp's per-sequence buffer (magic, source id, payload) of seq_id, or of the whole memory "
            "(-1). partial: only the SWA cache (iSWA) or the recurrent state (hybrid).")
        .def(
            "state_set",
            [](const py_memory& self, const py::buffer& data, seq_id_t dest, bool partial) {
                const py::buffer_info info = data.request();
                if (info.ndim != 1 || info.itemsize != 1) fail_argument("state_set: expected bytes");
                const std::span<const uint8_t> bytes(static_cast<const uint8_t*>(info.ptr),
                                                     static_cast<size_t>(info.size));
                return self.locked(
                    [&] { return state_seq_set_data(*self.mem, bytes, dest, flags_of(partial)); });
            },
            py::arg("data"), py::arg("dest") = -1, py::arg("partial") = false,
            "Restores a state_get buffer into dest (-1: the whole memory); raises, memory unchanged, on any "
            "problem. Returns the bytes read.")
        .def_property_readonly(
            "layout",
            [](const py_memory& self) { return self.locked([&] { return self.mem->state_layout(); }); })
        .def(
            "memory_breakdown",
            [](const py_memory& self) {
                return self.locked([&] { return self.mem->get_memory_breakdown(); });
            },
            "Where the memory's bytes are (reserved, committed, used, cached, pinned, free, per sequence).")
        .def(
            "save_file",
            [](const py_memory& self, const std::string& path, seq_id_t s, const py::object& tokens,
               bool compress, int zstd_level, bool partial) {
                const std::vector<token_t> toks = tokens_of(tokens, "save_file tokens");
                session_save_options opt;
                opt.flags = flags_of(partial);
                opt.compress = compress;
                opt.zstd_level = zstd_level;
                opt.tokens = toks;
                return self.locked([&] { return save_file(*self.mem, path, s, opt); });
            },
            py::arg("path"), py::arg("seq_id") = -1, py::arg("tokens") = py::none(),
            py::arg("compress") = false, py::arg("zstd_level") = 3, py::arg("partial") = false,
            "Saves seq_id (-1: the whole memory) and its tokens to a kvcache session file, atomically. "
            "Returns "
            "the file size.")
        .def(
            "load_file",
            [](const py_memory& self, const std::string& path, seq_id_t dest, const py::object& max_tokens) {
                const size_t max = max_tokens.is_none() ? SIZE_MAX : max_tokens.cast<size_t>();
                return self.locked([&] { return load_file(*self.mem, path, dest, max); });
            },
            py::arg("path"), py::arg("dest") = -1, py::arg("max_tokens") = py::none(),
            "Loads a session file into dest (-1: the whole memory); raises, memory unchanged, on any "
            "problem.")
        .def(
            "save_llama_seq_file",
            [](const py_memory& self, const std::string& path, seq_id_t s, const py::object& tokens) {
                const std::vector<token_t> toks = tokens_of(tokens, "save_llama_seq_file tokens");
                return self.locked([&] { return save_llama_seq_file(*self.mem, path, s, toks); });
            },
            py::arg("path"), py::arg("seq_id"), py::arg("tokens") = py::none(),
            "llama.cpp's 'ggsq' sequence file (no checksum: prefer save_file).")
        .def(
            "load_llama_seq_file",
            [](const py_memory& self, const std::string& path, seq_id_t dest) {
                return to_numpy(self.locked([&] { return load_llama_seq_file(*self.mem, path, dest); }));
            },
            py::arg("path"), py::arg("dest"), "Restores a 'ggsq' file into dest; returns its tokens.");
}

void bind_kv_cache(py::module_& m) {
    py::class_<prefix_tier_stats>(m, "TierStats", "What a prefix cache did with one of its stores.")
        .def_readonly("where", &prefix_tier_stats::where)
        .def_readonly("fetches", &prefix_tier_stats::fetches)
        .def_readonly("fetched_blocks", &prefix_tier_stats::fetched_blocks)
        .def_readonly("declined", &prefix_tier_stats::declined)
        .def_readonly("refused_blocks", &prefix_tier_stats::refused_blocks)
        .def_readonly("written_blocks", &prefix_tier_stats::written_blocks)
        .def_readonly("dropped_blocks", &prefix_tier_stats::dropped_blocks)
        .def_readonly("errors", &prefix_tier_stats::errors)
        .def_readonly("est_latency_ns", &prefix_tier_stats::est_latency_ns)
        .def_readonly("est_ns_per_byte", &prefix_tier_stats::est_ns_per_byte)
        .def_readonly("store", &prefix_tier_stats::store)
        .def("__repr__", [](const prefix_tier_stats& s) {
            return "TierStats(where='" + s.where + "', fetched_blocks=" + std::to_string(s.fetched_blocks) +
                   ", written_blocks=" + std::to_string(s.written_blocks) +
                   ", declined=" + std::to_string(s.declined) + ", errors=" + std::to_string(s.errors) + ")";
        });

    py::class_<py_kv_cache, py_memory>(m, "KVCache", "The attention KV cache (llama_kv_cache).")
        .def(py::init([](const kv_cache_params& p) {
                 return make_owned<py_kv_cache>(std::make_shared<kv_cache>(p));
             }),
             py::arg("params"))
        .def(py::init([](const py::kwargs& kw) {
                 return make_owned<py_kv_cache>(
                     std::make_shared<kv_cache>(params_from<kv_cache_params>("KVCacheParams", kw)));
             }),
             "KVCache(**fields of KVCacheParams)")
        .def_property_readonly("params", [](const py_kv_cache& s) { return s.kv->params(); })
        .def_property_readonly(
            "size", [](const py_kv_cache& s) { return s.kv->get_size(); }, "cells per stream")
        .def_property_readonly("n_stream", [](const py_kv_cache& s) { return s.kv->get_n_stream(); })
        .def_property_readonly("layer_ids",
                               [](const py_kv_cache& s) {
                                   return std::vector<uint32_t>(s.kv->layer_ids().begin(),
                                                                s.kv->layer_ids().end());
                               })
        .def(
            "has_layer", [](const py_kv_cache& s, uint32_t il) { return s.kv->has_layer(il); }, py::arg("il"))
        .def(
            "seq_to_stream", [](const py_kv_cache& s, seq_id_t id) { return s.kv->seq_to_stream(id); },
            py::arg("seq_id"))
        .def(
            "used_cells",
            [](const py_kv_cache& s, const py::object& stream) {
                return s.locked([&] {
                    if (!stream.is_none()) return s.kv->cells(stream.cast<uint32_t>()).get_used();
                    uint32_t n = 0;
                    for (uint32_t i = 0; i < s.kv->get_n_stream(); ++i) n += s.kv->cells(i).get_used();
                    return n;
                });
            },
            py::arg("stream") = py::none(), "Used cells of a stream, or of every stream.")
        .def(
            "cell",
            [](const py_kv_cache& s, uint32_t stream, uint32_t cell) {
                std::vector<seq_id_t> seqs;
                pos_t pos = pos_none;
                s.locked([&] {
                    const kv_cells& c = s.kv->cells(stream);
                    pos = c.pos_get(cell);
                    for (seq_id_t id = 0; id < static_cast<seq_id_t>(s.kv->n_seq_max()); ++id)
                        if (c.seq_has(cell, id)) seqs.push_back(id);
                });
                return py::make_tuple(pos, seqs);
            },
            py::arg("stream"), py::arg("cell"), "(position, sequence ids) of a cell; position -1 when empty.")
        .def(
            "picture",
            [](const py_kv_cache& s, uint32_t stream) {
                return s.locked([&] { return s.kv->cells(stream).picture(); });
            },
            py::arg("stream") = 0, "One character per cell of a stream.")
        .def_property_readonly(
            "has_shift", [](const py_kv_cache& s) { return s.locked([&] { return s.kv->get_has_shift(); }); })
        .def_property_readonly("size_bytes", [](const py_kv_cache& s) { return s.kv->size_bytes(); })
        .def_property_readonly("size_k_bytes",
                               [](const py_kv_cache& s) { return s.kv->size_bytes(kvc::kv_part::k); })
        .def_property_readonly("size_v_bytes",
                               [](const py_kv_cache& s) { return s.kv->size_bytes(kvc::kv_part::v); })
        .def_property_readonly(
            "committed_bytes",
            [](const py_kv_cache& s) { return s.locked([&] { return s.kv->committed_bytes(); }); })
        .def(
            "layer_k_bytes",
            [](const py_kv_cache& s, uint32_t il) { return s.kv->layer_bytes(kvc::kv_part::k, il); },
            py::arg("il"))
        .def(
            "layer_v_bytes",
            [](const py_kv_cache& s, uint32_t il) { return s.kv->layer_bytes(kvc::kv_part::v, il); },
            py::arg("il"))
        .def(
            "read_k_row",
            [](const py_kv_cache& s, uint32_t il, uint32_t stream, uint32_t cell) {
                if (il >= s.kv->params().layers.size()) {
                    throw error(errc::out_of_range, "read_k_row: no layer " + std::to_string(il));
                }
                const layer_desc& l = s.kv->params().layers[il];
                std::vector<float> out(size_t{l.n_head_kv} * l.n_embd_head_k);
                s.locked([&] { s.kv->read_row(kvc::kv_part::k, il, stream, cell, out); });
                return to_numpy(out);
            },
            py::arg("il"), py::arg("stream"), py::arg("cell"), "A stored K row decoded to float32.")
        .def(
            "read_v_row",
            [](const py_kv_cache& s, uint32_t il, uint32_t stream, uint32_t cell) {
                if (il >= s.kv->params().layers.size()) {
                    throw error(errc::out_of_range, "read_v_row: no layer " + std::to_string(il));
                }
                const layer_desc& l = s.kv->params().layers[il];
                std::vector<float> out(size_t{l.n_head_kv} * l.n_embd_head_v);
                s.locked([&] { s.kv->read_row(kvc::kv_part::v, il, stream, cell, out); });
                return to_numpy(out);
            },
            py::arg("il"), py::arg("stream"), py::arg("cell"), "A stored V row decoded to float32.")
        .def(
            "compact", [](const py_kv_cache& s) { return s.locked([&] { return s.kv->compact(); }); },
            "Moves used cells down into empty ones; returns the cells moved.")
        .def_property_readonly("fragmentation", [](const py_kv_cache& s) {
            return s.locked([&] { return s.kv->fragmentation(); });
        });
}

void bind_composites(py::module_& m) {
    py::class_<py_kv_cache_iswa, py_memory>(m, "KVCacheISWA",
                                            "Interleaved sliding-window attention: a base and a SWA KVCache.")
        .def(py::init([](const kv_cache_iswa_params& p) {
                 return make_owned<py_kv_cache_iswa>(std::make_shared<kv_cache_iswa>(p));
             }),
             py::arg("params"))
        .def(py::init([](const py::kwargs& kw) {
                 return make_owned<py_kv_cache_iswa>(std::make_shared<kv_cache_iswa>(
                     params_from<kv_cache_iswa_params>("KVCacheISWAParams", kw)));
             }),
             "KVCacheISWA(**fields of KVCacheISWAParams)")
        .def_property_readonly("params", [](const py_kv_cache_iswa& s) { return s.iswa->params(); })
        .def_property_readonly(
            "base", [](const py_kv_cache_iswa& s) { return wrap_part(s, &s.iswa->get_base()); },
            "The full-attention layers' KVCache (a part: it shares this memory's lifetime and lock).")
        .def_property_readonly(
            "swa", [](const py_kv_cache_iswa& s) { return wrap_part(s, &s.iswa->get_swa()); },
            "The sliding-window layers' KVCache.")
        .def_property_readonly("size_bytes", [](const py_kv_cache_iswa& s) { return s.iswa->size_bytes(); });

    py::class_<py_memory_recurrent, py_memory>(m, "MemoryRecurrent", "The recurrent state memory.")
        .def(py::init([](const recurrent_params& p) {
                 return make_owned<py_memory_recurrent>(std::make_shared<memory_recurrent>(p));
             }),
             py::arg("params"))
        .def(py::init([](const py::kwargs& kw) {
                 return make_owned<py_memory_recurrent>(std::make_shared<memory_recurrent>(
                     params_from<recurrent_params>("RecurrentParams", kw)));
             }),
             "MemoryRecurrent(**fields of RecurrentParams)")
        .def_property_readonly("params", [](const py_memory_recurrent& s) { return s.recr->params(); })
        .def_property_readonly("size", [](const py_memory_recurrent& s) { return s.recr->get_size(); })
        .def_property_readonly("n_rs_seq",
                               [](const py_memory_recurrent& s) { return s.recr->get_n_rs_seq(); })
        .def_property_readonly("layer_ids",
                               [](const py_memory_recurrent& s) {
                                   return std::vector<uint32_t>(s.recr->layer_ids().begin(),
                                                                s.recr->layer_ids().end());
                               })
        .def(
            "has_r", [](const py_memory_recurrent& s, uint32_t il) { return s.recr->has_r(il); },
            py::arg("il"))
        .def(
            "has_s", [](const py_memory_recurrent& s, uint32_t il) { return s.recr->has_s(il); },
            py::arg("il"))
        .def_property_readonly("size_bytes",
                               [](const py_memory_recurrent& s) { return s.recr->size_bytes(); })
        .def(
            "get_r",
            [](py_memory_recurrent& s, uint32_t il) { return view_to_numpy(s.recr->get_r(il), s.owner, 3); },
            py::arg("il"), "Layer il's r rows, a writable view [1 + n_rs_seq, size, n_embd_r].")
        .def(
            "get_s",
            [](py_memory_recurrent& s, uint32_t il) { return view_to_numpy(s.recr->get_s(il), s.owner, 3); },
            py::arg("il"), "Layer il's s rows, a writable view [1 + n_rs_seq, size, n_embd_s].")
        .def(
            "cell",
            [](const py_memory_recurrent& s, uint32_t i) {
                const auto c = s.locked([&] { return s.recr->cell(i); });
                py::dict d;
                d["pos"] = c.pos;
                d["src"] = c.src;
                d["rs_idx"] = c.rs_idx;
                d["depth"] = c.depth;
                d["seqs"] = c.seqs;
                return d;
            },
            py::arg("i"), "What cell i holds: pos, src, rs_idx, depth, seqs.")
        .def(
            "seq_tail",
            [](const py_memory_recurrent& s, seq_id_t id) {
                return s.locked([&] { return s.recr->seq_tail(id); });
            },
            py::arg("seq_id"), "The cell holding seq_id's state, -1 if none.")
        .def_property_readonly(
            "used", [](const py_memory_recurrent& s) { return s.locked([&] { return s.recr->get_used(); }); })
        .def("picture",
             [](const py_memory_recurrent& s) { return s.locked([&] { return s.recr->picture(); }); })
        .def("validate", [](const py_memory_recurrent& s) { s.locked([&] { s.recr->validate(); }); });

    py::class_<py_memory_hybrid, py_memory>(m, "MemoryHybrid",
                                            "An attention cache and a recurrent memory as one.")
        .def(py::init([](const memory_hybrid_params& p) {
                 return make_owned<py_memory_hybrid>(std::make_shared<memory_hybrid>(p));
             }),
             py::arg("params"))
        .def(py::init([](const py::kwargs& kw) {
                 return make_owned<py_memory_hybrid>(std::make_shared<memory_hybrid>(
                     params_from<memory_hybrid_params>("MemoryHybridParams", kw)));
             }),
             "MemoryHybrid(**fields of MemoryHybridParams)")
        .def_property_readonly("params", [](const py_memory_hybrid& s) { return s.hybrid->params(); })
        .def_property_readonly(
            "attn",
            [](const py_memory_hybrid& s) {
                // the one question of kind the bindings ask: which class the attention part is
                memory_i& attn = s.hybrid->get_attn();
                if (s.hybrid->params().iswa) return wrap_part(s, static_cast<kv_cache_iswa*>(&attn));
                return wrap_part(s, static_cast<kv_cache*>(&attn));
            },
            "The attention part (a KVCache or KVCacheISWA part).")
        .def_property_readonly(
            "recr", [](const py_memory_hybrid& s) { return wrap_part(s, &s.hybrid->get_recr()); },
            "The recurrent part (a MemoryRecurrent part).")
        .def_property_readonly("size_bytes",
                               [](const py_memory_hybrid& s) { return s.hybrid->size_bytes(); });
}

// The prefix cache of any memory (memory_i::prefix_cache()): unsupported when it was made without one.
prefix_cache_i& prefix_of(const py_memory& s, const char* what) {
    prefix_cache_i* p = s.mem->prefix_cache();
    if (p == nullptr)
        throw error(errc::unsupported,
                    std::string(what) + ": the memory has no prefix cache (params.prefix.enabled)");
    return *p;
}

// The prefix calls, on the base class: every memory answers them through its prefix cache.
void bind_prefix_calls(py::module_& m) {
    auto c = py::reinterpret_borrow<py::class_<py_memory>>(m.attr("Memory"));
    c.def(
         "prefix_lookup",
         [](const py_memory& s, const py::object& tokens, uint64_t key) {
             const auto t = tokens_of(tokens, "prefix_lookup tokens");
             return s.locked([&] { return prefix_of(s, "prefix_lookup").prefix_lookup(t, key); });
         },
         py::arg("tokens"), py::arg("key") = 0,
         "Tokens of the prompt prefix_attach would give a sequence now (the deepest boundary before its last "
         "token with everything a resumed sequence needs: blocks, window, snapshot).")
        .def(
            "prefix_attach",
            [](const py_memory& s, seq_id_t seq, const py::object& tokens, uint64_t key, uint32_t priority) {
                const auto t = tokens_of(tokens, "prefix_attach tokens");
                const auto pr = static_cast<uint8_t>(check_u8(priority, "prefix_attach"));
                return s.locked(
                    [&] { return prefix_of(s, "prefix_attach").prefix_attach(seq, t, key, pr, UINT32_MAX); });
            },
            py::arg("seq_id"), py::arg("tokens"), py::arg("key") = 0,
            py::arg("priority") = prefix_default_priority,
            "Starts the empty sequence seq_id with the longest cached prefix of tokens (shared cells; a "
            "snapshot for recurrent state); returns n: decode tokens[n:] from position n.")
        .def(
            "prefix_pin",
            [](const py_memory& s, const py::object& tokens, uint64_t key) {
                const auto t = tokens_of(tokens, "prefix_pin tokens");
                return s.locked([&] { return prefix_of(s, "prefix_pin").prefix_pin(t, key); });
            },
            py::arg("tokens"), py::arg("key") = 0,
            "Pins the cached prefix of tokens (a plain KVCache); returns the tokens pinned.")
        .def(
            "prefix_unpin",
            [](const py_memory& s, const py::object& tokens, uint64_t key) {
                const auto t = tokens_of(tokens, "prefix_unpin tokens");
                return s.locked([&] { return prefix_of(s, "prefix_unpin").prefix_unpin(t, key); });
            },
            py::arg("tokens"), py::arg("key") = 0, "Undoes one prefix_pin; returns the tokens unpinned.")
        .def(
            "prefix_set_priority",
            [](const py_memory& s, const py::object& tokens, uint64_t key, uint32_t priority) {
                const auto t = tokens_of(tokens, "prefix_set_priority tokens");
                const auto pr = static_cast<uint8_t>(check_u8(priority, "prefix_set_priority"));
                return s.locked(
                    [&] { return prefix_of(s, "prefix_set_priority").prefix_set_priority(t, key, pr); });
            },
            py::arg("tokens"), py::arg("key"), py::arg("priority"))
        .def(
            "prefix_publish",
            [](const py_memory& s) {
                s.locked([&] {
                    if (prefix_cache_i* p = s.mem->prefix_cache()) p->prefix_publish();
                });
            },
            "Publishes the blocks (and snapshots) the ubatches applied so far completed.")
        .def(
            "prefix_stats",
            [](const py_memory& s) {
                return s.locked([&] {
                    const prefix_cache_i* p = s.mem->prefix_cache();
                    return p != nullptr ? p->get_prefix_stats() : prefix_stats{};
                });
            },
            "What the prefix cache did and holds (zeros without one).")
        .def(
            "tier_stats",
            [](const py_memory& s) {
                return s.locked([&] {
                    const prefix_cache_i* p = s.mem->prefix_cache();
                    return p != nullptr ? p->get_tier_stats() : std::vector<prefix_tier_stats>{};
                });
            },
            "What the prefix cache did with each of its tiers (prefix.tiers.stores, in order).")
        .def(
            "prefix_tier_drain",
            [](const py_memory& s) {
                s.locked([&] {
                    if (prefix_cache_i* p = s.mem->prefix_cache()) p->prefix_tier_drain();
                });
            },
            "With prefix.tiers.async_writes: returns when every write queued so far is done.");
}

}  // namespace

void bind_memories(py::module_& m) {
    bind_reports(m);
    bind_memory_base(m);
    bind_kv_cache(m);
    bind_composites(m);
    bind_prefix_calls(m);
    m.def(
        "read_session_header",
        [](const std::string& path) {
            const session_header h = read_session_header(path);
            py::dict d;
            d["format"] = h.format == session_file_format::kvcache ? "kvcache" : "llama_seq";
            d["version"] = h.version;
            d["n_tokens"] = h.n_tokens;
            return d;
        },
        py::arg("path"),
        "The header of a session file (kvcache or llama.cpp 'ggsq'): format, version, n_tokens.");
}

}  // namespace kvc::py_binding
