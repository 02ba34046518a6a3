// The module kvcache._kvcache: errors, enums, parameters, batches and numpy views (common.h has the map).
#include <pybind11/functional.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <mutex>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <kvcache/disk_store.h>
#include <kvcache/dtype.h>
#include <kvcache/prefix_cache.h>
#include <kvcache/prefix_tiers.h>
#include <kvcache/types.h>

#include "common.h"

namespace kvc::py_binding {

void fail_argument(const std::string& what) {
    throw error(errc::invalid_argument, what);
}

// -- errors --

namespace {

// kvcache.Error and one subclass per errc, indexed by the code; created once, never freed (they live as
// long as the interpreter's module does).
std::array<PyObject*, 8> error_types{};

void raise_error(const error& e) {
    const auto i = static_cast<size_t>(e.code());
    PyObject* type = i < error_types.size() && error_types[i] != nullptr ? error_types[i] : error_types[0];
    py::object inst = py::reinterpret_steal<py::object>(PyObject_CallFunction(type, "s", e.what()));
    if (!inst) return;  // the call set a Python error itself
    inst.attr("status") = to_string(e.code());
    inst.attr("code") = static_cast<int>(e.code());
    PyErr_SetObject(type, inst.ptr());
}

void bind_errors(py::module_& m) {
    PyObject* base = PyErr_NewExceptionWithDoc(
        "kvcache.Error", "An error of kvcache: str(e) is the library's message, e.status its code's name.",
        PyExc_RuntimeError, nullptr);
    error_types[0] = base;
    m.add_object("Error", py::handle(base));
    struct sub {
        errc code;
        const char* name;
        PyObject* also;  // the built-in exception it also is, so `except ValueError` works as usual
    };
    const sub subs[] = {
        {errc::invalid_argument, "InvalidArgumentError", PyExc_ValueError},
        {errc::out_of_range, "OutOfRangeError", PyExc_ValueError},
        {errc::invalid_state, "InvalidStateError", nullptr},
        {errc::corrupt_data, "CorruptDataError", nullptr},
        {errc::unsupported, "UnsupportedError", nullptr},
        {errc::io, "IOError", PyExc_OSError},
        {errc::out_of_memory, "OutOfMemoryError", PyExc_MemoryError},
    };
    for (const sub& s : subs) {
        py::tuple bases = s.also != nullptr ? py::make_tuple(py::handle(base), py::handle(s.also))
                                            : py::make_tuple(py::handle(base));
        const std::string qualified = std::string("kvcache.") + s.name;
        PyObject* t = PyErr_NewException(qualified.c_str(), bases.ptr(), nullptr);
        if (t == nullptr) throw py::error_already_set();
        error_types[static_cast<size_t>(s.code)] = t;
        m.add_object(s.name, py::handle(t));
    }
    // pybind11's translator type takes the pointer by value
    py::register_exception_translator(
        [](std::exception_ptr p) {  // NOLINT(performance-unnecessary-value-param)
            try {
                if (p) std::rethrow_exception(p);
            } catch (const error& e) {
                raise_error(e);
            }
        });
}

// -- enums: each also accepts its name as a string where a parameter takes it --

template <class E>
py::enum_<E> bind_enum(py::module_& m, const char* name,
                       std::initializer_list<std::pair<const char*, E>> list) {
    py::enum_<E> e(m, name);
    for (const auto& [n, v] : list) e.value(n, v);
    // a copy: the initializer list's array dies with this call
    std::vector<std::pair<const char*, E>> values(list);
    e.def(py::init([values, name](const std::string& s) {
        std::string names;
        for (const auto& [n, v] : values) {
            if (s == n) return v;
            names += names.empty() ? n : std::string(", ") + n;
        }
        fail_argument(std::string(name) + " '" + s + "': not one of " + names);
    }));
    py::implicitly_convertible<py::str, E>();
    return e;
}

// A Python callable stored in a parameter struct's std::function: called and released with the GIL (the
// memory may call it from a call that released the GIL, and copies of the parameters may be destroyed
// anywhere).
struct held_function {
    py::function fn;
    explicit held_function(py::function f) : fn(std::move(f)) {}
    held_function(const held_function&) = delete;
    held_function& operator=(const held_function&) = delete;
    ~held_function() {
        try {
            py::gil_scoped_acquire gil;
            fn = py::function();
        } catch (...) {
            fn.release();  // no GIL to be had (the interpreter is going): leak the reference rather than
                           // crash
        }
    }
};

std::function<bool(uint32_t)> to_filter(const py::object& f) {
    if (f.is_none()) return {};
    auto h = std::make_shared<held_function>(py::reinterpret_borrow<py::function>(f));
    return [h](uint32_t il) {
        py::gil_scoped_acquire gil;
        return h->fn(il).cast<bool>();
    };
}

const char* to_string(prefix_event::kind k) {
    switch (k) {
        case prefix_event::kind::stored:
            return "stored";
        case prefix_event::kind::removed:
            return "removed";
        case prefix_event::kind::cleared:
            return "cleared";
    }
    return "?";
}

const char* to_string(prefix_part p) {
    switch (p) {
        case prefix_part::kv:
            return "kv";
        case prefix_part::swa:
            return "swa";
        case prefix_part::snapshot:
            return "snapshot";
    }
    return "?";
}

std::function<void(const prefix_event&)> to_event_callback(const py::object& f) {
    if (f.is_none()) return {};
    auto h = std::make_shared<held_function>(py::reinterpret_borrow<py::function>(f));
    return [h](const prefix_event& e) {
        py::gil_scoped_acquire gil;
        py::dict d;
        d["type"] = to_string(e.type);
        d["hash"] = e.hash;
        d["parent_hash"] = e.parent_hash;
        d["depth"] = e.depth;
        d["tokens"] = std::vector<token_t>(e.tokens.begin(), e.tokens.end());
        d["part"] = to_string(e.part);
        try {
            h->fn(d);
        } catch (py::error_already_set& err) {
            // the cache counts it (prefix_stats.event_errors); Python's error must not stay set
            const std::string what = err.what();
            throw error(errc::invalid_state, "prefix on_event callback raised: " + what);
        }
    };
}

// A store made of Python callables (kvcache.CallbackStore): a tier of the program's own (a dict, Redis
// through redis-py). The cache calls it without the GIL, holding the memory's lock; each call takes the
// GIL (as prefix events do), copies what Python returned and gives the GIL back before the cache decodes.
// What the callables raise is a miss, counted, never an error of the cache (a tier is a cache).
class py_callback_store final : public block_store_i {
public:
    py_callback_store(py::function read, py::function put, const py::object& contains, std::string where)
        : read_(std::make_shared<held_function>(std::move(read))),
          put_(std::make_shared<held_function>(std::move(put))),
          contains_(contains.is_none()
                        ? nullptr
                        : std::make_shared<held_function>(py::reinterpret_borrow<py::function>(contains))),
          where_(std::move(where)) {}

    size_t read_many(std::span<const std::string> keys, const block_value_fn& on_value) override {
        std::lock_guard lock(mu_);
        block_store_call_timer timer(st_);
        st_.lookups += keys.size();
        std::vector<std::pair<size_t, std::string>> got;
        if (!call("read_many", [&] {
                py::object r = read_->fn(py::cast(std::vector<std::string>(keys.begin(), keys.end())));
                size_t i = 0;
                for (const py::handle v : r) {
                    if (i >= keys.size()) throw py::value_error("read_many returned more values than keys");
                    if (!v.is_none())
                        got.emplace_back(i, std::string(py::bytes(py::reinterpret_borrow<py::object>(v))));
                    ++i;
                }
            }))
            return 0;
        size_t n = 0;
        for (const auto& [i, v] : got) {
            if (v.empty()) continue;  // values are never empty: a miss
            on_value(i, std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(v.data()), v.size()));
            ++n;
            ++st_.hits;
            st_.bytes_in += v.size();
        }
        return n;
    }

    void put_many(std::span<const block_put> items) override {
        std::lock_guard lock(mu_);
        block_store_call_timer timer(st_);
        uint64_t bytes = 0;
        for (const block_put& it : items) bytes += it.value.size();
        if (call("put_many", [&] {
                py::list l;
                for (const block_put& it : items)
                    l.append(py::make_tuple(
                        py::str(it.key.data(), it.key.size()),
                        py::bytes(reinterpret_cast<const char*>(it.value.data()), it.value.size())));
                put_->fn(l);
            })) {
            st_.puts += items.size();
            st_.bytes_out += bytes;
        }
    }

    std::vector<uint8_t> contains_many(std::span<const std::string> keys) override {
        std::lock_guard lock(mu_);
        std::vector<uint8_t> out(keys.size(), 0);
        if (!contains_) return out;  // all absent: put_many is asked to skip what it holds
        block_store_call_timer timer(st_);
        std::vector<uint8_t> has(keys.size(), 0);
        if (call("contains_many", [&] {
                py::object r = contains_->fn(py::cast(std::vector<std::string>(keys.begin(), keys.end())));
                size_t i = 0;
                for (const py::handle v : r) {
                    if (i < has.size()) has[i] = py::bool_(py::reinterpret_borrow<py::object>(v)) ? 1 : 0;
                    ++i;
                }
            }))
            out = has;
        return out;
    }

    block_store_stats stats() const override {
        std::lock_guard lock(mu_);
        return st_;
    }
    std::string describe() const override { return where_; }

private:
    // Runs f with the GIL; false (counted, logged once) when Python raised.
    template <class F>
    bool call(const char* what, const F& f) {
        py::gil_scoped_acquire gil;
        try {
            f();
            return true;
        } catch (py::error_already_set& e) {
            ++st_.errors;
            if (!logged_) log(log_level::warn, where_ + ": " + what + " raised: " + e.what());
            logged_ = true;
        } catch (const std::exception& e) {
            ++st_.errors;
            if (!logged_) log(log_level::warn, where_ + ": " + what + ": " + e.what());
            logged_ = true;
        }
        return false;
    }

    std::shared_ptr<held_function> read_, put_, contains_;
    std::string where_;
    mutable std::mutex mu_;
    block_store_stats st_;
    bool logged_ = false;
};

// Parameter structs are built with keyword arguments naming their fields: KVCacheParams(kv_size=256, ...).
// An unknown name is a TypeError naming it.
template <class T, class... Extra>
py::class_<T, Extra...>& kwargs_init(py::class_<T, Extra...>& c, std::function<void(T&)> defaults = {}) {
    c.def(py::init([defaults](const py::kwargs& kw) {
        auto t = std::make_unique<T>();
        if (defaults) defaults(*t);
        py::object self = py::cast(t.get(), py::return_value_policy::reference);
        for (const auto& [k, v] : kw) {
            if (!py::hasattr(self, k)) {
                throw py::type_error(
                    py::str("{}: no field '{}'").format(py::type::of(self).attr("__name__"), k));
            }
            py::object cur = self.attr(k);
            if (py::isinstance<py::str>(v) && !py::isinstance<py::str>(cur) && !cur.is_none()) {
                // an enum given by name: its constructor names the choices when the name is wrong
                py::setattr(self, k, py::type::of(cur)(v));
            } else {
                py::setattr(self, k, v);
            }
        }
        return t;
    }));
    c.def("__repr__", [](const py::object& self) {
        std::string out = py::type::of(self).attr("__name__").cast<std::string>() + "(";
        bool first = true;
        for (const py::handle& name : self.attr("_fields")) {
            if (!first) out += ", ";
            first = false;
            out += name.cast<std::string>() + "=" + py::repr(self.attr(name)).cast<std::string>();
        }
        return out + ")";
    });
    return c;
}

void set_fields(py::handle cls, std::vector<const char*> names) {
    cls.attr("_fields") = py::tuple(py::cast(names));
}

void bind_params(py::module_& m) {
    py::class_<rope_params> rope(m, "RopeParams", "How a layer rotated its keys (used by the K-shift).");
    kwargs_init(rope)
        .def_readwrite("type", &rope_params::type)
        .def_readwrite("n_rot", &rope_params::n_rot)
        .def_readwrite("freq_base", &rope_params::freq_base)
        .def_readwrite("freq_scale", &rope_params::freq_scale)
        .def_readwrite("ext_factor", &rope_params::ext_factor)
        .def_readwrite("attn_factor", &rope_params::attn_factor)
        .def_readwrite("beta_fast", &rope_params::beta_fast)
        .def_readwrite("beta_slow", &rope_params::beta_slow)
        .def_readwrite("n_ctx_orig", &rope_params::n_ctx_orig);
    set_fields(rope, {"type", "n_rot", "freq_base", "freq_scale", "ext_factor", "attn_factor", "beta_fast",
                      "beta_slow", "n_ctx_orig"});

    py::class_<layer_desc> layer(m, "LayerDesc", "One model layer as a KV cache sees it.");
    kwargs_init(layer)
        .def_readwrite("n_head_kv", &layer_desc::n_head_kv)
        .def_readwrite("n_embd_head_k", &layer_desc::n_embd_head_k)
        .def_readwrite("n_embd_head_v", &layer_desc::n_embd_head_v)
        .def_readwrite("is_swa", &layer_desc::is_swa)
        .def_readwrite("has_kv", &layer_desc::has_kv)
        .def_readwrite("rope", &layer_desc::rope);
    set_fields(layer, {"n_head_kv", "n_embd_head_k", "n_embd_head_v", "is_swa", "has_kv", "rope"});

    // -- tiers: block stores below a KV cache's prefix cache (docs/tiers.md) --
    py::class_<block_store_stats>(m, "BlockStoreStats", "What a block store did (every counter only grows).")
        .def_readonly("lookups", &block_store_stats::lookups)
        .def_readonly("hits", &block_store_stats::hits)
        .def_readonly("puts", &block_store_stats::puts)
        .def_readonly("skipped", &block_store_stats::skipped)
        .def_readonly("bytes_in", &block_store_stats::bytes_in)
        .def_readonly("bytes_out", &block_store_stats::bytes_out)
        .def_readonly("errors", &block_store_stats::errors)
        .def_readonly("damaged", &block_store_stats::damaged)
        .def_readonly("evictions", &block_store_stats::evictions)
        .def_readonly("round_trips", &block_store_stats::round_trips)
        .def_readonly("calls", &block_store_stats::calls)
        .def_readonly("latency_ns", &block_store_stats::latency_ns)
        .def_readonly("max_latency_ns", &block_store_stats::max_latency_ns)
        .def("__repr__", [](const block_store_stats& s) {
            return "BlockStoreStats(lookups=" + std::to_string(s.lookups) +
                   ", hits=" + std::to_string(s.hits) + ", puts=" + std::to_string(s.puts) +
                   ", errors=" + std::to_string(s.errors) + ", damaged=" + std::to_string(s.damaged) + ")";
        });
    // Stores are shared: several caches (and the Python object) hold one, so they are shared_ptrs.
    py::class_<block_store_i, std::shared_ptr<block_store_i>>(
        m, "BlockStore", "A store below a KV cache's prefix cache (a tier): DiskStore.")
        .def(
            "stats", [](const block_store_i& s) { return s.stats(); },
            "What the store did so far (shared by every cache using it).")
        .def("describe", &block_store_i::describe, "Where the store is ('disk:DIR').")
        .def("__repr__", [](const block_store_i& s) { return "<kvcache store " + s.describe() + ">"; });
    py::class_<disk_block_store, block_store_i, std::shared_ptr<disk_block_store>>(
        m, "DiskStore",
        "A directory of blocks, one file per value, written atomically; least recently used files go first "
        "beyond max_bytes (0: no limit). One process per directory.")
        .def(py::init([](const py::object& dir, uint64_t max_bytes, uint64_t max_value_bytes) {
                 disk_store_params p;
                 p.dir = py::str(py::module_::import("os").attr("fspath")(dir)).cast<std::string>();
                 p.max_bytes = max_bytes;
                 p.max_value_bytes = max_value_bytes;
                 if (p.dir.empty()) fail_argument("DiskStore: dir is empty");
                 if (max_value_bytes == 0) fail_argument("DiskStore: max_value_bytes is 0");
                 return std::make_shared<disk_block_store>(std::move(p));
             }),
             py::arg("dir"), py::arg("max_bytes") = 0,
             py::arg("max_value_bytes") = disk_store_params{}.max_value_bytes)
        .def_property_readonly("bytes", &disk_block_store::bytes, "bytes of the files it holds now")
        .def_property_readonly("entries", &disk_block_store::entries, "files it holds now");

    py::class_<py_callback_store, block_store_i, std::shared_ptr<py_callback_store>>(
        m, "CallbackStore",
        "A store of Python callables: read_many(keys) -> a value (bytes) or None per key; put_many([(key, "
        "value), ...]) stores those it does not hold; contains_many(keys) -> a bool per key (None: every "
        "key taken as absent). What they raise is a counted miss. The cache calls them from the thread "
        "calling into the memory, holding its lock: they must not use a memory that has this store.")
        .def(py::init([](const py::function& read_many, const py::function& put_many,
                         const py::object& contains_many, const std::string& describe) {
                 return std::make_shared<py_callback_store>(read_many, put_many, contains_many, describe);
             }),
             py::arg("read_many"), py::arg("put_many"), py::arg("contains_many") = py::none(),
             py::arg("describe") = "python");

    bind_enum<tier_write>(
        m, "TierWrite",
        {{"on_evict", tier_write::on_evict}, {"through", tier_write::through}, {"never", tier_write::never}});
    py::class_<prefix_tier_params> tiers(m, "PrefixTierParams",
                                         "Stores below a KVCache's prefix cache (at most 3, fastest first).");
    kwargs_init(tiers)
        .def_readwrite("stores", &prefix_tier_params::stores)
        .def_readwrite("model_id", &prefix_tier_params::model_id)
        .def_readwrite("write", &prefix_tier_params::write)
        .def_readwrite("fetch", &prefix_tier_params::fetch)
        .def_readwrite("prefill_ns_per_token", &prefix_tier_params::prefill_ns_per_token)
        .def_readwrite("probe_every", &prefix_tier_params::probe_every)
        .def_readwrite("async_writes", &prefix_tier_params::async_writes)
        .def_readwrite("max_queued_bytes", &prefix_tier_params::max_queued_bytes);
    set_fields(tiers, {"stores", "model_id", "write", "fetch", "prefill_ns_per_token", "probe_every",
                       "async_writes", "max_queued_bytes"});

    py::class_<prefix_cache_params> prefix(m, "PrefixCacheParams",
                                           "The prefix cache of a KV cache, recurrent or hybrid memory.");
    kwargs_init(prefix)
        .def_readwrite("enabled", &prefix_cache_params::enabled)
        .def_readwrite("block_size", &prefix_cache_params::block_size)
        .def_readwrite("policy", &prefix_cache_params::policy)
        .def_readwrite("protected_fraction", &prefix_cache_params::protected_fraction)
        .def_readwrite("max_pinned_fraction", &prefix_cache_params::max_pinned_fraction)
        .def_readwrite("n_vocab", &prefix_cache_params::n_vocab)
        .def_readwrite("snapshot_interval", &prefix_cache_params::snapshot_interval)
        .def_readwrite("max_snapshots", &prefix_cache_params::max_snapshots)
        .def_readwrite("tiers", &prefix_cache_params::tiers)
        .def_property(
            "on_event", [](const prefix_cache_params& p) { return static_cast<bool>(p.on_event); },
            [](prefix_cache_params& p, const py::object& f) { p.on_event = to_event_callback(f); },
            "A callable receiving a dict (type, hash, parent_hash, depth, tokens) per index event; reads as "
            "whether one is set.");
    set_fields(prefix, {"enabled", "block_size", "policy", "protected_fraction", "max_pinned_fraction",
                        "n_vocab", "snapshot_interval", "max_snapshots", "tiers"});

    py::class_<kv_cache_params> kv(m, "KVCacheParams",
                                   "Everything a KVCache is made from (auto_update defaults to True here).");
    kwargs_init<kv_cache_params>(kv, [](kv_cache_params& p) { p.auto_update = true; })
        .def_readwrite("layers", &kv_cache_params::layers)
        .def_property(
            "filter", [](const kv_cache_params& p) { return static_cast<bool>(p.filter); },
            [](kv_cache_params& p, const py::object& f) { p.filter = to_filter(f); },
            "A callable: keep model layer il? (None: every layer with K/V); reads as whether one is set.")
        .def_readwrite("type_k", &kv_cache_params::type_k)
        .def_readwrite("type_v", &kv_cache_params::type_v)
        .def_readwrite("v_trans", &kv_cache_params::v_trans)
        .def_readwrite("kv_size", &kv_cache_params::kv_size)
        .def_readwrite("n_seq_max", &kv_cache_params::n_seq_max)
        .def_readwrite("unified", &kv_cache_params::unified)
        .def_readwrite("n_pad", &kv_cache_params::n_pad)
        .def_readwrite("n_kv_pad", &kv_cache_params::n_kv_pad)
        .def_readwrite("n_swa", &kv_cache_params::n_swa)
        .def_readwrite("swa", &kv_cache_params::swa)
        .def_readwrite("n_pos", &kv_cache_params::n_pos)
        .def_readwrite("compact_threshold", &kv_cache_params::compact_threshold)
        .def_readwrite("auto_update", &kv_cache_params::auto_update)
        .def_readwrite("memory_budget", &kv_cache_params::memory_budget)
        .def_readwrite("prefix", &kv_cache_params::prefix);
    set_fields(
        kv, {"layers", "type_k", "type_v", "v_trans", "kv_size", "n_seq_max", "unified", "n_pad", "n_kv_pad",
             "n_swa", "swa", "n_pos", "compact_threshold", "auto_update", "memory_budget", "prefix"});

    py::class_<iswa_sizing> sizing(m, "ISWASizing", "How the SWA cache of an iSWA pair is sized.");
    kwargs_init(sizing)
        .def_readwrite("swa_full", &iswa_sizing::swa_full)
        .def_readwrite("n_ubatch", &iswa_sizing::n_ubatch)
        .def_readwrite("n_swa_retain", &iswa_sizing::n_swa_retain);
    set_fields(sizing, {"swa_full", "n_ubatch", "n_swa_retain"});

    py::class_<kv_cache_iswa_params> iswa(m, "KVCacheISWAParams", "Everything a KVCacheISWA is made from.");
    kwargs_init<kv_cache_iswa_params>(iswa, [](kv_cache_iswa_params& p) { p.kv.auto_update = true; })
        .def_readwrite("kv", &kv_cache_iswa_params::kv)
        .def_readwrite("sizing", &kv_cache_iswa_params::sizing);
    set_fields(iswa, {"kv", "sizing"});

    py::class_<recurrent_layer_desc> rlayer(m, "RecurrentLayerDesc",
                                            "The widths of a layer's two state rows.");
    kwargs_init(rlayer)
        .def_readwrite("n_embd_r", &recurrent_layer_desc::n_embd_r)
        .def_readwrite("n_embd_s", &recurrent_layer_desc::n_embd_s);
    set_fields(rlayer, {"n_embd_r", "n_embd_s"});

    py::class_<recurrent_params> recr(m, "RecurrentParams", "Everything a MemoryRecurrent is made from.");
    kwargs_init(recr)
        .def_readwrite("layers", &recurrent_params::layers)
        .def_property(
            "filter", [](const recurrent_params& p) { return static_cast<bool>(p.filter); },
            [](recurrent_params& p, const py::object& f) { p.filter = to_filter(f); },
            "A callable: keep model layer il? (None: every layer with a row).")
        .def_readwrite("type_r", &recurrent_params::type_r)
        .def_readwrite("type_s", &recurrent_params::type_s)
        .def_readwrite("n_seq_max", &recurrent_params::n_seq_max)
        .def_readwrite("n_rs_seq", &recurrent_params::n_rs_seq)
        .def_readwrite("memory_budget", &recurrent_params::memory_budget)
        .def_readwrite("prefix", &recurrent_params::prefix);
    set_fields(recr, {"layers", "type_r", "type_s", "n_seq_max", "n_rs_seq", "memory_budget", "prefix"});

    py::class_<memory_hybrid_params> hybrid(m, "MemoryHybridParams",
                                            "Everything a MemoryHybrid is made from.");
    kwargs_init<memory_hybrid_params>(hybrid, [](memory_hybrid_params& p) { p.attn.auto_update = true; })
        .def_readwrite("attn", &memory_hybrid_params::attn)
        .def_readwrite("recr", &memory_hybrid_params::recr)
        .def_readwrite("iswa", &memory_hybrid_params::iswa)
        .def_readwrite("memory_budget", &memory_hybrid_params::memory_budget)
        .def_readwrite("prefix", &memory_hybrid_params::prefix);
    set_fields(hybrid, {"attn", "recr", "iswa", "memory_budget", "prefix"});
}

// -- batches --

std::vector<seq_id_t> to_seq_ids(const py::handle& h, const char* what) {
    if (py::isinstance<py::int_>(h)) return {h.cast<seq_id_t>()};
    try {
        return h.cast<std::vector<seq_id_t>>();
    } catch (const py::cast_error&) {
        fail_argument(std::string(what) + ": a sequence id or a list of them, got " +
                      py::repr(h).cast<std::string>());
    }
}

// Values of a 1-D list or array as T, checking the count.
template <class T>
std::vector<T> to_vector(const py::handle& h, size_t n, const char* what) {
    py::array_t<T, py::array::c_style | py::array::forcecast> a;
    try {
        a = py::array_t<T, py::array::c_style | py::array::forcecast>::ensure(h);
    } catch (const py::error_already_set&) {
        a = {};
    }
    if (!a || a.ndim() != 1) fail_argument(std::string(what) + ": expected a 1-D list or array of numbers");
    if (n != SIZE_MAX && static_cast<size_t>(a.size()) != n) {
        fail_argument(std::string(what) + ": " + std::to_string(a.size()) + " values for " +
                      std::to_string(n) + " tokens");
    }
    return {a.data(), a.data() + a.size()};
}

// Batch(tokens=..., embd=..., pos=..., seq_ids=..., logits=...): every argument a list or a numpy array.
std::unique_ptr<py_batch> batch_from_arrays(const py::object& tokens, const py::object& embd,
                                            const py::object& pos, const py::object& seq_ids,
                                            const py::object& logits) {
    if (tokens.is_none() == embd.is_none()) fail_argument("Batch: give exactly one of tokens and embd");
    std::vector<token_t> tok;
    std::vector<float> rows;
    size_t n = 0;
    int32_t n_embd = 0;
    if (!tokens.is_none()) {
        tok = to_vector<token_t>(tokens, SIZE_MAX, "Batch tokens");
        n = tok.size();
    } else {
        auto a = py::array_t<float, py::array::c_style | py::array::forcecast>::ensure(embd);
        if (!a || a.ndim() != 2) fail_argument("Batch embd: expected a 2-D array [n_tokens, n_embd]");
        n = static_cast<size_t>(a.shape(0));
        n_embd = static_cast<int32_t>(a.shape(1));
        if (n_embd <= 0) fail_argument("Batch embd: rows of 0 values");
        rows.assign(a.data(), a.data() + a.size());
    }
    if (n == 0) fail_argument("Batch: no token");
    if (n > static_cast<size_t>(INT32_MAX)) fail_argument("Batch: more than 2^31 - 1 tokens");
    auto b = std::make_unique<py_batch>(0, n_embd, 0);  // capacity 0: add() may grow it
    b->token = std::move(tok);
    b->embd = std::move(rows);
    b->auto_pos = pos.is_none();
    b->auto_seq = seq_ids.is_none();
    b->auto_logits = logits.is_none();
    b->pos = b->auto_pos ? std::vector<pos_t>(n, 0) : to_vector<pos_t>(pos, n, "Batch pos");
    b->logits.assign(n, 0);
    if (!b->auto_logits) {
        const auto l = to_vector<int8_t>(logits, n, "Batch logits");
        std::transform(l.begin(), l.end(), b->logits.begin(), [](int8_t x) { return x != 0 ? 1 : 0; });
    }
    b->seqs.assign(n, std::vector<seq_id_t>{0});
    if (!b->auto_seq) {
        if (py::isinstance<py::array>(seq_ids) && py::reinterpret_borrow<py::array>(seq_ids).ndim() == 1) {
            const auto ids = to_vector<seq_id_t>(seq_ids, n, "Batch seq_ids");
            for (size_t i = 0; i < n; ++i) b->seqs[i] = {ids[i]};
        } else {
            const auto seq = py::reinterpret_borrow<py::sequence>(seq_ids);
            if (seq.size() != n) {
                fail_argument("Batch seq_ids: " + std::to_string(seq.size()) + " entries for " +
                              std::to_string(n) + " tokens");
            }
            for (size_t i = 0; i < n; ++i) {
                b->seqs[i] = to_seq_ids(seq[i], "Batch seq_ids");
                if (b->seqs[i].empty())
                    fail_argument("Batch seq_ids: token " + std::to_string(i) + " has none");
            }
        }
    }
    return b;
}

void bind_batch(py::module_& m) {
    py::class_<py_batch>(
        m, "Batch", "A batch of tokens (or embedding rows) with positions, sequence ids and output flags.")
        .def(py::init(&batch_from_arrays), py::kw_only(), py::arg("tokens") = py::none(),
             py::arg("embd") = py::none(), py::arg("pos") = py::none(), py::arg("seq_ids") = py::none(),
             py::arg("logits") = py::none(),
             "From lists or numpy arrays. Left out: pos continue each sequence, seq_ids are all 0, only the "
             "last token is an output. seq_ids: one id per token, or a list of ids per token.")
        .def_static(
            "init",
            [](int32_t capacity, int32_t n_embd, int32_t n_seq_max) {
                if (capacity < 1)
                    fail_argument("Batch.init: capacity must be >= 1, got " + std::to_string(capacity));
                if (n_seq_max < 1)
                    fail_argument("Batch.init: n_seq_max must be >= 1, got " + std::to_string(n_seq_max));
                return std::make_unique<py_batch>(capacity, n_embd, n_seq_max);
            },
            py::arg("capacity"), py::arg("n_embd") = 0, py::arg("n_seq_max") = 1,
            "An empty batch to fill with add() (llama_batch_init).")
        .def_static(
            "get_one",
            [](const py::object& tokens) {
                return batch_from_arrays(tokens, py::none(), py::none(), py::none(), py::none());
            },
            py::arg("tokens"), "Sequence 0, positions continuing the memory, output for the last token.")
        .def(
            "add",
            [](py_batch& b, const py::object& token, pos_t pos, const py::object& seq_ids, bool output) {
                const std::vector<seq_id_t> ids = to_seq_ids(seq_ids, "Batch.add seq_ids");
                if (b.n_embd() > 0) {
                    b.add_embd(
                        to_vector<float>(token, static_cast<size_t>(b.n_embd()), "Batch.add embedding row"),
                        pos, ids, output);
                } else {
                    b.add_token(token.cast<token_t>(), pos, ids, output);
                }
            },
            py::arg("token"), py::arg("pos"), py::arg("seq_ids") = 0, py::arg("output") = false,
            "Appends a token (or an embedding row) at pos in the given sequence(s).")
        .def("set_output", &py_batch::set_output, py::arg("i"), py::arg("output") = true)
        .def("clear", &py_batch::clear)
        .def("__len__", &py_batch::size)
        .def_property_readonly("capacity", &py_batch::capacity,
                               "Batch.init's capacity; 0: no limit (from arrays)")
        .def_property_readonly("n_embd", &py_batch::n_embd)
        .def_property_readonly("tokens", [](const py_batch& b) { return to_numpy(b.token); })
        .def_property_readonly("pos",
                               [](const py_batch& b) -> py::object {
                                   if (b.auto_pos) return py::none();
                                   return to_numpy(b.pos);
                               })
        .def_property_readonly("seq_ids", [](const py_batch& b) { return b.seqs; })
        .def_property_readonly("logits", [](const py_batch& b) {
            std::vector<bool> out(b.logits.begin(), b.logits.end());
            if (b.auto_logits && !out.empty()) out.back() = true;
            return out;
        });
}

// -- numpy views --

py::dtype numpy_dtype(dtype t) {
    switch (t) {
        case dtype::f32:
            return py::dtype::of<float>();
        case dtype::f16:
            return py::dtype("float16");
        case dtype::bf16:
            return py::dtype::of<uint16_t>();
        case dtype::q8_0:
        case dtype::q4_0:
            return py::dtype::of<uint8_t>();
    }
    fail_argument("unknown element type");
}

}  // namespace

py::array view_to_numpy(const tensor_view& v, std::shared_ptr<memory_i> owner, int min_dims) {
    int nd = 4;
    while (nd > min_dims && v.ne[nd - 1] == 1) --nd;
    std::vector<py::ssize_t> shape, strides;
    for (int i = nd - 1; i >= 0; --i) {
        const bool blocks = i == 0 && is_quantized(v.type);
        shape.push_back(blocks ? v.ne[0] / block_size(v.type) : v.ne[i]);
        strides.push_back(static_cast<py::ssize_t>(v.nb[i]));
    }
    if (is_quantized(v.type)) {
        shape.push_back(static_cast<py::ssize_t>(type_size(v.type)));
        strides.push_back(1);
    }
    // the base owns a reference to the memory: the array keeps it, and so its buffers, alive
    auto* keep = new std::shared_ptr<memory_i>(std::move(owner));
    py::capsule base(keep, [](void* p) { delete static_cast<std::shared_ptr<memory_i>*>(p); });
    return {numpy_dtype(v.type), shape, strides, v.data, base};
}

py::array_t<float> view_to_f32(const tensor_view& v, int min_dims) {
    int nd = 4;
    while (nd > min_dims && v.ne[nd - 1] == 1) --nd;
    std::vector<py::ssize_t> shape;
    for (int i = nd - 1; i >= 0; --i) shape.push_back(v.ne[i]);
    py::array_t<float> out(shape);
    float* dst = out.mutable_data();
    const auto n0 = static_cast<size_t>(v.ne[0]);
    for (int64_t i3 = 0; i3 < v.ne[3]; ++i3)
        for (int64_t i2 = 0; i2 < v.ne[2]; ++i2)
            for (int64_t i1 = 0; i1 < v.ne[1]; ++i1, dst += n0) v.row_to_f32({dst, n0}, i1, i2, i3);
    return out;
}

std::pair<py::array, const_tensor_view> numpy_to_view(const py::handle& h, const char* what) {
    py::array a;
    dtype t = dtype::f32;
    if (py::isinstance<py::array>(h) &&
        py::reinterpret_borrow<py::array>(h).dtype().is(py::dtype("float16"))) {
        a = py::array::ensure(h, py::array::c_style);
        t = dtype::f16;
    } else {
        a = py::array_t<float, py::array::c_style | py::array::forcecast>::ensure(h);
    }
    if (!a) fail_argument(std::string(what) + ": expected an array of numbers (float32 or float16)");
    if (a.ndim() < 1 || a.ndim() > 4) {
        fail_argument(std::string(what) + ": expected 1 to 4 dimensions, got " + std::to_string(a.ndim()));
    }
    int64_t ne[4] = {1, 1, 1, 1};
    for (py::ssize_t i = 0; i < a.ndim(); ++i) ne[a.ndim() - 1 - i] = a.shape(i);
    auto v =
        const_tensor_view::contiguous(t, static_cast<const std::byte*>(a.data()), ne[0], ne[1], ne[2], ne[3]);
    return {a, v};
}

py_batch::py_batch(int32_t capacity, int32_t n_embd, int32_t n_seq_max)
    : capacity_(capacity), n_embd_(n_embd), n_seq_max_(n_seq_max) {
    if (capacity < 0) fail_argument("Batch: capacity must be >= 0, got " + std::to_string(capacity));
    if (n_embd < 0) fail_argument("Batch: n_embd must be >= 0, got " + std::to_string(n_embd));
    if (n_seq_max < 0) fail_argument("Batch: n_seq_max must be >= 0, got " + std::to_string(n_seq_max));
}

void py_batch::add_common(pos_t p, std::vector<seq_id_t> seq_ids, bool output) {
    if (capacity_ > 0 && size() >= capacity_) {
        fail_argument("Batch.add: the batch is full (" + std::to_string(capacity_) + " tokens)");
    }
    if (seq_ids.empty()) fail_argument("Batch.add: no sequence id");
    if (n_seq_max_ > 0 && seq_ids.size() > static_cast<size_t>(n_seq_max_)) {
        fail_argument("Batch.add: " + std::to_string(seq_ids.size()) + " sequence ids, more than n_seq_max " +
                      std::to_string(n_seq_max_));
    }
    if (auto_pos || auto_seq) {
        fail_argument(
            "Batch.add: this batch leaves positions or sequence ids to the memory; build it with pos= "
            "and seq_ids=, or with Batch.init");
    }
    if (auto_logits) {  // the implicit "last token only" becomes explicit
        auto_logits = false;
        if (!logits.empty()) logits.back() = 1;
    }
    pos.push_back(p);
    seqs.push_back(std::move(seq_ids));
    logits.push_back(output ? 1 : 0);
}

void py_batch::add_token(token_t t, pos_t p, std::vector<seq_id_t> seq_ids, bool output) {
    if (n_embd_ > 0) fail_argument("Batch.add: this batch holds embedding rows, not token ids");
    add_common(p, std::move(seq_ids), output);
    token.push_back(t);
}

void py_batch::add_embd(std::vector<float> row, pos_t p, std::vector<seq_id_t> seq_ids, bool output) {
    add_common(p, std::move(seq_ids), output);
    embd.insert(embd.end(), row.begin(), row.end());
}

void py_batch::set_output(int32_t i, bool output) {
    if (i < 0 || i >= size()) {
        throw error(errc::out_of_range,
                    "Batch.set_output: token " + std::to_string(i) + " of " + std::to_string(size()));
    }
    if (auto_logits) {  // the implicit "last token only" becomes explicit
        auto_logits = false;
        std::fill(logits.begin(), logits.end(), 0);
        logits.back() = 1;
    }
    logits[static_cast<size_t>(i)] = output ? 1 : 0;
}

void py_batch::clear() {
    token.clear();
    embd.clear();
    pos.clear();
    logits.clear();
    seqs.clear();
}

batch py_batch::view() const {
    batch b;
    b.n_tokens = size();
    if (n_embd_ > 0) {
        b.embd = embd.data();
    } else {
        b.token = token.data();
    }
    if (!auto_pos) b.pos = pos.data();
    if (!auto_logits) b.logits = logits.data();
    if (!auto_seq) {
        n_seq_id_.resize(seqs.size());
        seq_ptr_.resize(seqs.size());
        for (size_t i = 0; i < seqs.size(); ++i) {
            n_seq_id_[i] = static_cast<int32_t>(seqs[i].size());
            seq_ptr_[i] = seqs[i].data();
        }
        b.n_seq_id = n_seq_id_.data();
        b.seq_id = seq_ptr_.data();
    }
    return b;
}

}  // namespace kvc::py_binding

PYBIND11_MODULE(_kvcache, m) {
    namespace py = pybind11;
    using namespace kvc;
    using namespace kvc::py_binding;
    m.doc() = "kvcache: sequence memory (KV cache, recurrent state) for LLM inference engines";
    bind_errors(m);
    bind_enum<dtype>(m, "dtype",
                     {{"f32", dtype::f32},
                      {"f16", dtype::f16},
                      {"bf16", dtype::bf16},
                      {"q8_0", dtype::q8_0},
                      {"q4_0", dtype::q4_0}});
    bind_enum<swa_type>(m, "SWAType",
                        {{"none", swa_type::none},
                         {"standard", swa_type::standard},
                         {"chunked", swa_type::chunked},
                         {"symmetric", swa_type::symmetric}});
    bind_enum<rope_type>(
        m, "RopeType", {{"none", rope_type::none}, {"normal", rope_type::normal}, {"neox", rope_type::neox}});
    bind_enum<memory_status>(m, "MemoryStatus",
                             {{"success", memory_status::success},
                              {"no_update", memory_status::no_update},
                              {"failed_prepare", memory_status::failed_prepare},
                              {"failed_compute", memory_status::failed_compute}});
    bind_enum<evict_policy>(
        m, "EvictPolicy",
        {{"lru", evict_policy::lru}, {"slru", evict_policy::slru}, {"adaptive", evict_policy::adaptive}});
    m.attr("SEQ_ALL") = seq_all;
    m.attr("__version__") = version_string();
    m.def("row_size", &row_size, py::arg("type"), py::arg("n"),
          "Bytes of a row of n values of an element type.");
    m.def("block_size", &block_size, py::arg("type"), "Values per block (1 for float types).");
    bind_params(m);
    bind_batch(m);
    bind_memories(m);
    bind_contexts(m);
    bind_runtime(m);
}
