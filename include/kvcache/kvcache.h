/// @file kvcache.h
/// @brief The C API of kvcache: the sequence memory (KV cache) of an LLM inference engine.
///
/// A thin layer over the C++ API (namespace kvc), usable from C11 and C++. Every name starts with
/// `kvc_` / `KVC_`; handles are opaque (`kvc_memory`, `kvc_memory_context`, `kvc_batch`). A memory is one
/// of four kinds (::kvc_memory_kind): an attention KV cache, an iSWA pair of KV caches, a recurrent state
/// memory, or a hybrid of attention and recurrent state; they share one handle type and one set of
/// functions, and a function that needs what a kind lacks fails with #KVC_ERR_UNSUPPORTED.
///
/// Conventions (docs/c-api.md has the guide):
/// - Functions that can fail return a ::kvc_status. Results go through out pointers, written only on
///   success (out handles are set to NULL on failure). A failing call changes nothing: the memory, the
///   batch and the caller's buffers are exactly as before, except where a function documents otherwise
///   (a destination buffer too small for state bytes may hold partial data).
/// - A few queries return their value directly: counts and sizes as `int64_t`, where a negative value is
///   the ::kvc_status of the failure; handles as pointers, NULL on failure; names as strings, NULL on
///   failure.
/// - A NULL handle or a NULL required pointer is an error (#KVC_ERR_INVALID_ARGUMENT, the message names
///   the parameter), never a crash. Freeing NULL is harmless.
/// - Every failure sets this thread's message (kvc_last_error()). No C++ exception crosses this API.
/// - Sequence ids are in [0, n_seq_max); #KVC_SEQ_ALL (-1) means every sequence or the whole memory where
///   a function says so. Position ranges are [p0, p1): p0 < 0 means 0, p1 < 0 means no upper bound.
/// - Threads (the contract, in full: docs/c-api.md, "Threads"): functions taking a `const` handle
///   (`const kvc_memory*`, `const kvc_memory_context*`) only read and may run on several threads at once
///   on one memory; every other call on a memory or its contexts is a writer and needs the memory to
///   itself (one writer at a time, no reader meanwhile); distinct memories are independent. kvcache takes
///   no locks. Error messages are per thread.
#ifndef KVCACHE_KVCACHE_H
#define KVCACHE_KVCACHE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/// @brief Marks a function of the C API (default visibility, for shared builds).
#if defined(__GNUC__) || defined(__clang__)
#define KVC_API __attribute__((visibility("default")))
#else
#define KVC_API
#endif

/// @brief `noexcept` when the header is compiled as C++: no function of the C API throws.
#ifdef __cplusplus
#define KVC_NOEXCEPT noexcept
#else
#define KVC_NOEXCEPT
#endif

#ifdef __cplusplus
extern "C" {
#endif

/// @brief Every sequence (or the whole memory) where a function accepts it as a sequence id.
#define KVC_SEQ_ALL (-1)

/// @brief State flag: composite memories (iSWA, hybrid) save and restore only their partial part (the
/// sliding-window cache, the recurrent state); plain memories (KV cache, recurrent) ignore it. A buffer
/// written with the flag must be restored with it.
#define KVC_STATE_SEQ_FLAG_PARTIAL_ONLY 1u

// ---------------------------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------------------------

/// @brief Result of a fallible call: #KVC_OK or a negative code mirroring kvc::errc.
typedef enum kvc_status {
    KVC_OK = 0,                     ///< success
    KVC_ERR_INVALID_ARGUMENT = -1,  ///< a value is malformed whatever the memory holds (NULL, bad count)
    KVC_ERR_OUT_OF_RANGE = -2,      ///< a well-formed value outside what the memory accepts (seq id, layer)
    KVC_ERR_INVALID_STATE = -3,     ///< the request conflicts with the current contents or call order
    KVC_ERR_CORRUPT_DATA = -4,      ///< state or file bytes do not follow the format
    KVC_ERR_UNSUPPORTED = -5,       ///< a valid request this build or configuration cannot serve
    KVC_ERR_IO = -6,                ///< the operating system refused a read or write
    KVC_ERR_OUT_OF_MEMORY = -7,     ///< an allocation failed
    KVC_ERR_INTERNAL = -100,        ///< an unexpected failure inside kvcache (a bug: please report it)
} kvc_status;

/// @brief The name of a status ("ok", "invalid_argument", ...).
/// @param status Any value; unknown values give "unknown".
/// @return A static string, never NULL.
KVC_API const char* kvc_status_string(kvc_status status) KVC_NOEXCEPT;

/// @brief The message of the last failing call on this thread.
///
/// The message starts with the name of the failing function and names the offending value, e.g.
/// "kvc_memory_seq_rm: seq_rm: seq_id 7 not in [0, 4)". Successful calls leave it alone: it stays until
/// the next failure on this thread replaces it (or kvc_clear_last_error()), so read it right after the
/// call that failed.
/// @return A string owned by kvcache, valid until the next failing `kvc_` call on this thread (or
/// kvc_clear_last_error()); "" when no call has failed on this thread. Never NULL.
KVC_API const char* kvc_last_error(void) KVC_NOEXCEPT;

/// @brief Forgets this thread's last error message: kvc_last_error() returns "" until the next failure.
KVC_API void kvc_clear_last_error(void) KVC_NOEXCEPT;

/// @brief Records this thread's error message, "function: message" (or the message alone without a
/// function), for libraries built on this API
/// (kvcache_redis's kvc_redis_store_new()) so that their failures read like kvcache's own.
/// @param status The status of the failure (returned).
/// @param function The failing function's name, or NULL.
/// @param message What went wrong, naming the offending value (NULL: "").
/// @return status.
KVC_API kvc_status kvc_set_last_error(kvc_status status, const char* function,
                                      const char* message) KVC_NOEXCEPT;

/// @brief Severity of a log message.
typedef enum kvc_log_level {
    KVC_LOG_DEBUG = 0,  ///< details for debugging
    KVC_LOG_INFO = 1,   ///< progress
    KVC_LOG_WARN = 2,   ///< something suspicious that kvcache handled
    KVC_LOG_ERROR = 3,  ///< something went wrong
} kvc_log_level;

/// @brief Receives the messages kvcache logs.
/// @param level Severity of the message.
/// @param message The text, without a trailing newline; valid during the call only.
/// @param user_data The pointer given to kvc_set_log_callback().
typedef void (*kvc_log_callback)(kvc_log_level level, const char* message, void* user_data);

/// @brief Installs a log callback, process-wide (thread-safe).
///
/// The callback may be called from any thread that calls into kvcache, one call at a time; it must not
/// call kvc_set_log_callback() itself.
/// @param callback The receiver; NULL restores the default (warnings and errors to stderr).
/// @param user_data Passed to every call of the callback.
KVC_API void kvc_set_log_callback(kvc_log_callback callback, void* user_data) KVC_NOEXCEPT;

/// @brief The version of the library binary, e.g. "0.1.0" (compare with KVC_VERSION_STRING of
/// <kvcache/version.h> to detect a header/binary mismatch).
/// @return A static string, never NULL.
KVC_API const char* kvc_version_string(void) KVC_NOEXCEPT;

// ---------------------------------------------------------------------------------------------------------
// Limits
// ---------------------------------------------------------------------------------------------------------

/// @brief The largest inputs kvcache accepts, process-wide (kvc::limits; in the spirit of sqlite3_limit).
///
/// What an input declares is checked against them before anything is allocated for it: the size of a
/// file a state or session load reads, the metadata of a GGUF file, the capacity of a batch, the number
/// of sequences of a memory or a batch. A refusal is #KVC_ERR_OUT_OF_RANGE (#KVC_ERR_OUT_OF_MEMORY for
/// memory_bytes) and kvc_last_error() names the limit and both values.
typedef struct kvc_limits {
    uint64_t file_bytes;      ///< largest file a state, session or 'ggsq' load reads (0: physical memory)
    uint64_t metadata_bytes;  ///< largest GGUF metadata section (default 1 GiB)
    uint32_t batch_tokens;    ///< largest batch capacity in tokens (default 1,048,576)
    uint32_t sequences;       ///< largest n_seq_max of a memory or a batch (default 65,536)
    /// Budget of a memory whose memory_budget is 0, and the most bytes one batch may take (0: physical
    /// memory; the default).
    uint64_t memory_bytes;
} kvc_limits;

/// @brief The limits in force (the defaults until kvc_set_limits()).
KVC_API kvc_limits kvc_get_limits(void) KVC_NOEXCEPT;

/// @brief Replaces every limit, process-wide. Set them at start-up: each field is read atomically, so a
/// call running meanwhile sees each limit either before or after.
/// @param limits The new limits (start from kvc_get_limits()); batch_tokens and sequences >= 1.
/// @param old Receives the previous limits; may be NULL.
/// @return #KVC_OK, or #KVC_ERR_INVALID_ARGUMENT (NULL limits, batch_tokens or sequences 0; nothing
/// changes then).
KVC_API kvc_status kvc_set_limits(const kvc_limits* limits, kvc_limits* old) KVC_NOEXCEPT;

// ---------------------------------------------------------------------------------------------------------
// Element types
// ---------------------------------------------------------------------------------------------------------

/// @brief Element type of stored keys and values; the values are ggml's type ids.
typedef enum kvc_type {
    KVC_TYPE_F32 = 0,    ///< IEEE binary32
    KVC_TYPE_F16 = 1,    ///< IEEE binary16
    KVC_TYPE_Q4_0 = 2,   ///< ggml block_q4_0: 32 values in 18 bytes
    KVC_TYPE_Q8_0 = 8,   ///< ggml block_q8_0: 32 values in 34 bytes
    KVC_TYPE_BF16 = 30,  ///< bfloat16
} kvc_type;

/// @brief The name of a type ("f32", "f16", "q4_0", "q8_0", "bf16").
/// @param type The type.
/// @return A static string, or NULL for a value that is not a ::kvc_type (the message says so).
KVC_API const char* kvc_type_name(kvc_type type) KVC_NOEXCEPT;

/// @brief Values per block of a type (1 for float types, 32 for q8_0 and q4_0).
/// @param type The type.
/// @return The block size, or #KVC_ERR_INVALID_ARGUMENT (negative) for an invalid type.
KVC_API int64_t kvc_type_block_size(kvc_type type) KVC_NOEXCEPT;

/// @brief Bytes of a row of n values of a type.
/// @param type The type.
/// @param n Values in the row: >= 0 and a multiple of kvc_type_block_size().
/// @return The size in bytes (0 for n == 0), or a negative ::kvc_status: #KVC_ERR_INVALID_ARGUMENT for an
/// invalid type, a negative n or n not a whole number of blocks.
KVC_API int64_t kvc_row_size(kvc_type type, int64_t n) KVC_NOEXCEPT;

// ---------------------------------------------------------------------------------------------------------
// Memory creation
// ---------------------------------------------------------------------------------------------------------

/// @brief A memory of any kind (::kvc_memory_kind); owns its storage.
typedef struct kvc_memory kvc_memory;

/// @brief What a memory is made of (kvc_memory_get_kind()).
typedef enum kvc_memory_kind {
    KVC_MEMORY_KIND_KV_CACHE = 0,  ///< one attention KV cache (kvc_kv_cache_create())
    /// two KV caches, for the full-attention and the sliding-window layers (kvc_iswa_create())
    KVC_MEMORY_KIND_ISWA = 1,
    KVC_MEMORY_KIND_RECURRENT = 2,    ///< recurrent state rows, no K/V (kvc_recurrent_create())
    KVC_MEMORY_KIND_HYBRID = 3,       ///< one KV cache and recurrent state (kvc_hybrid_create())
    KVC_MEMORY_KIND_HYBRID_ISWA = 4,  ///< an iSWA pair of KV caches and recurrent state (kvc_hybrid_create())
} kvc_memory_kind;

/// @brief How the keys of a layer were rotated (for K-shifts).
typedef enum kvc_rope_type {
    KVC_ROPE_TYPE_NONE = 0,    ///< no rotary embedding (ALiBi, learned positions): nothing to shift
    KVC_ROPE_TYPE_NORMAL = 1,  ///< rotate pairs (x[2i], x[2i+1]) (llama, ggml mode 0)
    KVC_ROPE_TYPE_NEOX = 2,    ///< rotate pairs (x[i], x[i + n_rot/2]) (GPT-NeoX, Qwen, ggml mode 2)
} kvc_rope_type;

/// @brief RoPE parameters of one layer, with ggml's YaRN parameters.
typedef struct kvc_rope_params {
    kvc_rope_type type;  ///< rotation kind
    int32_t n_rot;       ///< rotary dims of a head (even; 0 = the whole head)
    float freq_base;     ///< theta_i = pos * freq_base^(-2i / n_rot)
    float freq_scale;    ///< linear / YaRN interpolation: positions scaled by freq_scale
    float ext_factor;    ///< YaRN extrapolation mix (0 = off)
    float attn_factor;   ///< magnitude scale applied to rotated values
    float beta_fast;     ///< YaRN ramp bound
    float beta_slow;     ///< YaRN ramp bound
    int32_t n_ctx_orig;  ///< training context (YaRN)
} kvc_rope_params;

/// @brief One model layer as the cache sees it.
typedef struct kvc_layer_desc {
    uint32_t n_head_kv;      ///< KV heads
    uint32_t n_embd_head_k;  ///< values per key head (a multiple of the block size of type_k)
    uint32_t n_embd_head_v;  ///< values per value head
    bool is_swa;             ///< a sliding-window layer (an iSWA memory keeps it in its sliding-window cache)
    bool has_kv;             ///< false: the layer keeps no K/V (e.g. it reuses another layer's)
    kvc_rope_params rope;    ///< how its keys were rotated
} kvc_layer_desc;

/// @brief Sliding-window attention rule of a cache.
typedef enum kvc_swa_type {
    KVC_SWA_TYPE_NONE = 0,       ///< every past key of the sequence is visible
    KVC_SWA_TYPE_STANDARD = 1,   ///< a query at p sees keys in (p - n_swa, p]
    KVC_SWA_TYPE_CHUNKED = 2,    ///< a query sees keys from the start of its chunk of n_swa positions
    KVC_SWA_TYPE_SYMMETRIC = 3,  ///< keys within n_swa / 2 on either side (bidirectional encoders)
} kvc_swa_type;

/// @brief Decides whether a memory keeps a model layer (its K/V, or its state rows).
/// @param il Model index of the layer.
/// @param user_data The `layer_filter_user_data` of the same parameter struct.
/// @return true to keep the layer.
typedef bool (*kvc_layer_filter)(uint32_t il, void* user_data);

/// @brief Which cached blocks of one priority a batch that needs room evicts first.
typedef enum kvc_evict_policy {
    KVC_EVICT_LRU = 0,   ///< least recently released first
    KVC_EVICT_SLRU = 1,  ///< segmented LRU: blocks never hit since publishing before blocks hit at least once
    KVC_EVICT_ADAPTIVE = 2,  ///< SLRU with ghosts of evicted blocks and a protected bound that adapts
} kvc_evict_policy;

/// @brief What happened to a prefix cache's index (the C++ kvc::prefix_event::kind).
typedef enum kvc_prefix_event_type {
    KVC_PREFIX_EVENT_STORED = 0,   ///< a block was published
    KVC_PREFIX_EVENT_REMOVED = 1,  ///< a block left the index (evicted, or its cells were edited)
    KVC_PREFIX_EVENT_CLEARED = 2,  ///< every block left the index
} kvc_prefix_event_type;

/// @brief Which index of a memory an event's block is in (the C++ kvc::prefix_part): memories made of
/// parts keep one per part, and a hit needs the blocks of every part.
typedef enum kvc_prefix_part {
    /// K/V blocks of full attention: a KV cache's, an iSWA pair's base cache, a hybrid's attention part
    KVC_PREFIX_PART_KV = 0,
    /// K/V blocks of an iSWA pair's sliding-window cache (also as a hybrid's attention part)
    KVC_PREFIX_PART_SWA = 1,
    /// a recurrent memory's blocks (also a hybrid's recurrent part): the chains that lead to snapshots
    KVC_PREFIX_PART_SNAPSHOT = 2,
} kvc_prefix_part;

/// @brief One event of a prefix cache (the C++ kvc::prefix_event).
typedef struct kvc_prefix_event {
    kvc_prefix_event_type type;  ///< what happened
    uint64_t hash;               ///< the block's chain hash: XXH3-64 of its tokens seeded with parent_hash
    uint64_t parent_hash;        ///< the previous block's hash; for the first block of a chain, its key
    uint32_t depth;              ///< the block covers positions [depth * n_tokens, (depth + 1) * n_tokens)
    const int32_t* tokens;       ///< [n_tokens] the block's tokens, valid during the call (NULL: cleared)
    uint32_t n_tokens;           ///< the block size (0: cleared)
    kvc_prefix_part part;        ///< the index the block is in (cleared: the index that emptied)
} kvc_prefix_event;

/// @brief Receives a prefix cache's events, synchronously; it must not call into the same memory.
/// @param event The event (valid during the call).
/// @param user_data The `on_event_user_data` of the parameters.
typedef void (*kvc_prefix_event_fn)(const kvc_prefix_event* event, void* user_data);

/// @brief A block store below a prefix cache: a tier (kvcache_tiers.h, docs/tiers.md). A handle holds a
/// reference: the store lives until its handle is freed and no memory uses it.
typedef struct kvc_block_store kvc_block_store;

/// @brief When a prefix cache writes blocks to its tiers (the C++ kvc::tier_write).
typedef enum kvc_tier_write {
    KVC_TIER_WRITE_ON_EVICT = 0,  ///< when a block leaves memory to make room (the default)
    KVC_TIER_WRITE_THROUGH = 1,   ///< when a block is published (more writes, earlier sharing)
    KVC_TIER_WRITE_NEVER = 2,     ///< never: the tiers are read only (another process fills them)
} kvc_tier_write;

/// @brief Most stores a prefix cache takes (the C++ kvc::prefix_max_tiers).
#define KVC_PREFIX_MAX_TIERS 3

/// @brief The stores below a prefix cache (the C++ kvc::prefix_tier_params, docs/tiers.md): KV caches
/// without a sliding window, recurrent and hybrid memories; the defaults (no stores) are a prefix cache
/// without tiers.
typedef struct kvc_prefix_tier_params {
    /// [n_stores] asked in this order (the fastest first); read at creation: the memory keeps its own
    /// references, so the handles may be freed after creating it
    kvc_block_store* const* stores;
    size_t n_stores;  ///< entries of stores, at most #KVC_PREFIX_MAX_TIERS (0: no tiers)
    /// names the model and how its keys were computed: caches whose layouts or models differ never read
    /// each other's records
    uint64_t model_id;
    kvc_tier_write write;  ///< when blocks are written
    bool fetch;            ///< whether kvc_memory_prefix_attach() asks the stores (true by default)
    /// the engine's cost of computing one prompt token (ns): a store is asked only when its measured cost
    /// is lower (0: always ask)
    double prefill_ns_per_token;
    /// while the cost model declines a store, one attach in this many asks it anyway (0: never)
    uint32_t probe_every;
    /// write from a thread of the memory's own, so that a step never waits for a store (false by default:
    /// a step writes before it returns); kvc_memory_prefix_tier_drain() waits for the queue
    bool async_writes;
    uint64_t
        max_queued_bytes;  ///< async_writes: the queue's bound in bytes (> 0; what does not fit is dropped)
} kvc_prefix_tier_params;

/// @brief A memory's prefix cache (kvcache_prefix.h, docs/prefix-cache.md): a KV cache's, a recurrent
/// memory's (snapshots of states at block boundaries) or a hybrid memory's (both).
typedef struct kvc_prefix_cache_params {
    bool enabled;                  ///< keep computed prompt prefixes (KV caches: no window and n_pos 1)
    uint32_t block_size;           ///< tokens per block: reuse comes in whole blocks (divides kv_size)
    kvc_evict_policy policy;       ///< the eviction order of blocks of one priority
    float protected_fraction;      ///< SLRU: the protected segment holds at most this fraction of blocks
    float max_pinned_fraction;     ///< pins may hold at most this fraction of the cells
    int32_t n_vocab;               ///< > 0: prompt tokens must be in [0, n_vocab); else non-negative
    kvc_prefix_event_fn on_event;  ///< NULL: no events
    void* on_event_user_data;      ///< passed to on_event
    /// recurrent and hybrid memories: a snapshot every this many blocks of a sequence, besides the end
    /// of every prompt and of every sequence (0: only those)
    uint32_t snapshot_interval;
    /// recurrent and hybrid memories: snapshots the pool holds at most (0: 4 x n_seq_max)
    uint32_t max_snapshots;
    kvc_prefix_tier_params tiers;  ///< KV caches: stores below memory (none by default)
} kvc_prefix_cache_params;

/// @brief An engine that owns the K/V tensors (kvcache_engine.h).
typedef struct kvc_storage_engine kvc_storage_engine;

/// @brief Everything a KV cache is made from. Start from kvc_kv_cache_default_params() and set the
/// fields you need; `layers` must be set.
typedef struct kvc_kv_cache_params {
    const kvc_layer_desc* layers;  ///< [n_layers] every model layer, by model index (read during creation)
    size_t n_layers;               ///< entries of layers (>= 1)
    kvc_layer_filter
        layer_filter;  ///< keep model layer il? NULL: every layer with K/V; called only during creation
    void* layer_filter_user_data;  ///< passed to layer_filter
    kvc_type type_k;               ///< element type of stored keys
    kvc_type type_v;               ///< element type of stored values
    bool v_trans;                  ///< transposed V (attention without flash attention); float type_v only
    uint32_t kv_size;              ///< cells per stream
    uint32_t n_seq_max;            ///< sequence ids are [0, n_seq_max)
    bool unified;                  ///< one stream for all sequences, else one stream per sequence
    uint32_t n_pad;                ///< kv_size must be a multiple of it
    uint32_t n_kv_pad;             ///< attention reads a multiple of max(n_pad, n_kv_pad) cells
    uint32_t n_swa;                ///< window of the SWA rule
    kvc_swa_type swa_type;         ///< the SWA rule
    uint32_t n_pos;                ///< positions per token (4 for M-RoPE)
    float compact_threshold;  ///< compact on update once this fraction of cells are holes (0: on request)
    /// kvc_memory_init_batch() applies pending K-shifts (what kvc_memory_update() does) once the batch is
    /// placed, as llama.cpp's decode does (a batch that does not fit leaves them pending); true by default
    /// here (false in the C++ defaults)
    bool auto_update;
    kvc_prefix_cache_params prefix;  ///< the prefix cache (off by default)
    /// the most bytes the K/V of every cell may take: creation refuses more, before allocating anything
    /// (0: the machine's physical memory)
    uint64_t memory_budget;
    /// NULL (the default): kvcache owns the K/V storage. Else the engine owns the tensors and runs the row
    /// operations kvcache hands it (kvcache_engine.h, docs/engine-owned-storage.md); read at creation.
    const kvc_storage_engine* engine;
} kvc_kv_cache_params;

/// @brief The defaults of a layer: 1 KV head, has_kv, normal RoPE with base 10000; head sizes 0 (set them).
/// @return The defaults (the C++ kvc::layer_desc defaults).
KVC_API kvc_layer_desc kvc_layer_desc_default(void) KVC_NOEXCEPT;

/// @brief The defaults of a KV cache: f16 K and V, transposed V, 4096 cells, one sequence, unified,
/// n_kv_pad 256, no SWA; no layers (set layers and n_layers).
/// @return The defaults (the C++ kvc::kv_cache_params defaults).
KVC_API kvc_kv_cache_params kvc_kv_cache_default_params(void) KVC_NOEXCEPT;

/// @brief Creates an attention KV cache. Host memory is reserved for every cell now and committed as cells
/// are used (docs/memory.md); with an engine allocator, all of it is allocated now.
/// @param params The configuration; read during the call only.
/// @param out Receives the memory (free it with kvc_memory_free()); NULL on failure.
/// @return #KVC_OK; #KVC_ERR_INVALID_ARGUMENT for a NULL pointer or an invalid configuration (the message
/// names the field), #KVC_ERR_OUT_OF_MEMORY when every cell's K/V would exceed memory_budget (the message
/// names both sizes) or the storage cannot be reserved.
KVC_API kvc_status kvc_kv_cache_create(const kvc_kv_cache_params* params, kvc_memory** out) KVC_NOEXCEPT;

/// @brief How the sliding-window cache of an iSWA pair is sized (kvc_iswa_params, kvc_hybrid_params).
typedef struct kvc_iswa_sizing {
    /// Size the sliding-window cache like the full one (kv_size): positions can then be shifted and any
    /// part of a sequence removed. false: min(kv_size, n_swa * (unified ? n_seq_max : 1) + n_ubatch)
    /// cells, padded to 256.
    bool swa_full;
    uint32_t n_ubatch;  ///< the largest ubatch the engine places (sizes the sliding-window cache)
    /// Without swa_full: more cells per stream for the windows of cached prefixes (a prefix cache's,
    /// docs/prefix-cache.md; 0: only what live sequences need).
    uint32_t n_swa_retain;
} kvc_iswa_sizing;

/// @brief Everything an iSWA memory (interleaved sliding-window attention: Gemma 2/3, Cohere 2, Llama 4)
/// is made from: two KV caches, one for the layers with kvc_layer_desc::is_swa false (kv_size cells, no
/// window) and one for the layers with is_swa true (the window rule of `kv`, and only the cells the window
/// needs). Start from kvc_iswa_default_params(); set `kv.layers`, `kv.n_swa` and `kv.swa_type`.
typedef struct kvc_iswa_params {
    /// Shared by both caches: layers (is_swa chooses the cache), filter, types, V layout, kv_size (of the
    /// full-attention cache), streams, padding, positions per token; n_swa and swa_type are the rule of
    /// the sliding-window layers (swa_type must not be #KVC_SWA_TYPE_NONE, n_swa must be positive).
    kvc_kv_cache_params kv;
    kvc_iswa_sizing sizing;  ///< how the sliding-window cache is sized
} kvc_iswa_params;

/// @brief The defaults of an iSWA memory: kvc_kv_cache_default_params() (no layers, no window: set them),
/// swa_full, n_ubatch 512.
/// @return The defaults (the C++ kvc::kv_cache_iswa_params defaults).
KVC_API kvc_iswa_params kvc_iswa_default_params(void) KVC_NOEXCEPT;

/// @brief Creates an iSWA memory (all of its storage is allocated and zeroed now).
///
/// Positions are reported from the sliding-window cache (kvc_memory_seq_pos_min() grows as the window
/// slides). The attention inputs (n_kv, KQ mask, position buckets, K-shift) are those of the cache
/// holding the layer the functions are given: the full-attention and the sliding-window layers differ
/// (the section "K/V data and attention inputs" explains it).
/// @param params The configuration; read during the call only.
/// @param out Receives the memory (free it with kvc_memory_free()); NULL on failure.
/// @return #KVC_OK; #KVC_ERR_INVALID_ARGUMENT for a NULL pointer or an invalid configuration (what
/// kvc_kv_cache_create() refuses, no window, or no full-attention or no sliding-window layer kept: use a
/// plain KV cache then), #KVC_ERR_OUT_OF_MEMORY when the storage cannot be allocated.
KVC_API kvc_status kvc_iswa_create(const kvc_iswa_params* params, kvc_memory** out) KVC_NOEXCEPT;

/// @brief One model layer as the recurrent memory sees it: the widths of its two state rows.
typedef struct kvc_recurrent_layer_desc {
    uint32_t n_embd_r;  ///< values per r row (conv / token-shift state); 0: no r tensor
    uint32_t n_embd_s;  ///< values per s row (SSM / WKV state); 0: no s tensor
} kvc_recurrent_layer_desc;

/// @brief Everything a recurrent memory (Mamba, RWKV, short-conv, Gated-DeltaNet state) is made from.
/// Start from kvc_recurrent_default_params(); `layers` must be set.
///
/// The memory has n_seq_max cells; cell c is row c of every layer's r and s tensor, and each tensor has
/// 1 + n_rs_seq planes of them (plane 0 the current state, planes 1.. the states before the last tokens,
/// for rollback). The section "Recurrent state through a context" gives the engine's part.
typedef struct kvc_recurrent_params {
    /// [n_layers] every model layer, by model index; a layer with n_embd_r == n_embd_s == 0 keeps no state
    /// (read during creation)
    const kvc_recurrent_layer_desc* layers;
    size_t n_layers;  ///< entries of layers (>= 1)
    /// keep model layer il? NULL: every layer with a row; called only during creation
    kvc_layer_filter layer_filter;
    void* layer_filter_user_data;  ///< passed to layer_filter
    kvc_type type_r;               ///< element type of r rows: f32, f16 or bf16
    kvc_type type_s;               ///< element type of s rows: f32, f16 or bf16
    uint32_t n_seq_max;            ///< sequence ids are [0, n_seq_max); also the number of cells
    /// rollback depth in tokens: kvc_memory_seq_rm() can remove up to this many last tokens of a
    /// sequence (0: no rollback; removing a suffix then reports removed == false)
    uint32_t n_rs_seq;
    /// the most bytes every state row may take: creation refuses more, before allocating anything (0: the
    /// machine's physical memory)
    uint64_t memory_budget;
    /// snapshots of states at block boundaries, for kvc_memory_prefix_attach() (off by default; no pins)
    kvc_prefix_cache_params prefix;
} kvc_recurrent_params;

/// @brief The defaults of a recurrent memory: f32 r and s rows, one sequence, no rollback; no layers (set
/// layers and n_layers).
/// @return The defaults (the C++ kvc::recurrent_params defaults).
KVC_API kvc_recurrent_params kvc_recurrent_default_params(void) KVC_NOEXCEPT;

/// @brief Creates a recurrent state memory (all of its storage is allocated and zeroed now).
/// @param params The configuration; read during the call only.
/// @param out Receives the memory (free it with kvc_memory_free()); NULL on failure.
/// @return #KVC_OK; #KVC_ERR_INVALID_ARGUMENT for a NULL pointer or an invalid configuration (no layers,
/// no layer with a state row kept, n_seq_max 0, a type other than f32, f16 or bf16; the message names
/// it), #KVC_ERR_OUT_OF_MEMORY over memory_budget or when the storage cannot be allocated.
KVC_API kvc_status kvc_recurrent_create(const kvc_recurrent_params* params, kvc_memory** out) KVC_NOEXCEPT;

/// @brief Everything a hybrid memory (attention and recurrent layers: Jamba, Falcon-H1, Granite 4, LFM2,
/// Qwen3-Next, ...) is made from. Start from kvc_hybrid_default_params(); set `attn.layers` and
/// `recr.layers` (both by model index, over every model layer) and the same n_seq_max in both.
///
/// The attention part keeps the layers with kvc_layer_desc::has_kv (and its filter), the recurrent part
/// those with a state row (and its filter): mark the recurrent layers has_kv = false in `attn.layers`
/// and give the attention layers zero widths in `recr.layers`. A layer may be in both parts or in
/// neither.
typedef struct kvc_hybrid_params {
    kvc_kv_cache_params attn;   ///< the attention part (with iswa: also the window rule of its SWA layers)
    kvc_recurrent_params recr;  ///< the recurrent part (same n_seq_max as attn)
    /// the attention part is an iSWA pair of caches (kvc_iswa_params), split by kvc_layer_desc::is_swa
    bool iswa;
    kvc_iswa_sizing sizing;  ///< with iswa: how its sliding-window cache is sized
    uint64_t memory_budget;  ///< the most both parts may take together (0: the machine's physical memory)
    /// the prefix cache of both parts (set it here, not in attn or recr; no pins; with iswa: no tiers)
    kvc_prefix_cache_params prefix;
} kvc_hybrid_params;

/// @brief The defaults of a hybrid memory: kvc_kv_cache_default_params(), kvc_recurrent_default_params(),
/// no iSWA (swa_full, n_ubatch 512 for when it is set).
/// @return The defaults (the C++ kvc::memory_hybrid_params defaults).
KVC_API kvc_hybrid_params kvc_hybrid_default_params(void) KVC_NOEXCEPT;

/// @brief Creates a hybrid memory (its parts' storage as kvc_kv_cache_create() and kvc_recurrent_create()).
///
/// Batches are split once, in equal-length ubatches, and placed in both parts or in neither. Removing
/// tokens is all or nothing: when the recurrent part cannot remove them (no rollback left),
/// kvc_memory_seq_rm() reports removed == false and neither part changes. Positions are those both parts
/// hold (kvc_memory_seq_pos_max() is the smaller maximum).
/// @param params The configuration; read during the call only.
/// @param out Receives the memory (free it with kvc_memory_free()); NULL on failure.
/// @return #KVC_OK; #KVC_ERR_INVALID_ARGUMENT for a NULL pointer or an invalid configuration (what either
/// part refuses, or different n_seq_max), #KVC_ERR_OUT_OF_MEMORY over a memory budget or when the storage
/// cannot be allocated.
KVC_API kvc_status kvc_hybrid_create(const kvc_hybrid_params* params, kvc_memory** out) KVC_NOEXCEPT;

/// @brief The kind of a memory.
/// @param mem The memory.
/// @param out Receives its kind.
/// @return #KVC_OK; #KVC_ERR_INVALID_ARGUMENT for NULL pointers.
KVC_API kvc_status kvc_memory_get_kind(const kvc_memory* mem, kvc_memory_kind* out) KVC_NOEXCEPT;

/// @brief Where a memory's bytes are (K/V and state rows): committed = used + cached + free, reserved >=
/// committed (docs/memory.md).
typedef struct kvc_memory_breakdown {
    uint64_t reserved;   ///< every cell's bytes: the most it can hold (address space, not memory)
    uint64_t committed;  ///< bytes backed by memory: the cells below each stream's commit mark
    uint64_t used;       ///< cells some sequence holds
    uint64_t cached;     ///< cells only the prefix cache holds (evictable)
    uint64_t pinned;     ///< cells of pinned prefix blocks (within used or cached; not evictable)
    uint64_t free;       ///< committed cells that hold nothing
} kvc_memory_breakdown;

/// @brief Where a memory's bytes are, and the bytes of the cells each sequence holds. It counts every
/// cell: for reports, not for every step.
/// @param mem The memory.
/// @param out Receives the totals.
/// @param seq_bytes NULL, or [n_seq] receiving the bytes of sequences 0..n_seq-1 (a cell several share
/// counts for each; 0 past n_seq_max).
/// @param n_seq Entries of seq_bytes.
/// @return #KVC_OK; #KVC_ERR_INVALID_ARGUMENT for NULL mem or out, or NULL seq_bytes with n_seq > 0.
KVC_API kvc_status kvc_memory_get_breakdown(const kvc_memory* mem, kvc_memory_breakdown* out,
                                            uint64_t* seq_bytes, size_t n_seq) KVC_NOEXCEPT;

/// @brief Frees a memory and its storage. Free its contexts first.
/// @param mem The memory; NULL is harmless.
KVC_API void kvc_memory_free(kvc_memory* mem) KVC_NOEXCEPT;

// ---------------------------------------------------------------------------------------------------------
// Batches
// ---------------------------------------------------------------------------------------------------------

/// @brief A batch of tokens (or embedding rows) to place, with positions, sequences and output flags.
/// Owns its arrays.
typedef struct kvc_batch kvc_batch;

/// @brief Creates an empty batch with room for n_tokens_alloc tokens (llama_batch_init).
/// @param n_tokens_alloc Capacity in tokens (>= 1).
/// @param n_embd 0 for token ids; > 0: each entry is an embedding row of n_embd floats.
/// @param n_seq_max Most sequence ids one token may carry (>= 1).
/// @return The batch (free it with kvc_batch_free()), or NULL on invalid arguments or when out of memory
/// (see kvc_last_error()).
KVC_API kvc_batch* kvc_batch_init(int32_t n_tokens_alloc, int32_t n_embd, int32_t n_seq_max) KVC_NOEXCEPT;

/// @brief A batch of tokens of sequence 0 with automatic positions (continuing the sequence in the
/// memory) and an output for the last token only (llama_batch_get_one).
///
/// Unlike llama.cpp's, the batch copies the tokens (the caller's array may change or go away) and must be
/// freed with kvc_batch_free(). It is read-only: kvc_batch_add(), kvc_batch_clear() and
/// kvc_batch_set_output() refuse it.
/// @param tokens [n_tokens] token ids.
/// @param n_tokens Number of tokens (>= 1).
/// @return The batch, or NULL for NULL tokens, n_tokens == 0, more than INT32_MAX tokens, or when out of
/// memory (see kvc_last_error()).
KVC_API kvc_batch* kvc_batch_get_one(const int32_t* tokens, size_t n_tokens) KVC_NOEXCEPT;

/// @brief Frees a batch.
/// @param batch The batch; NULL is harmless.
KVC_API void kvc_batch_free(kvc_batch* batch) KVC_NOEXCEPT;

/// @brief Appends a token (common_batch_add).
/// @param batch A batch from kvc_batch_init() with n_embd == 0.
/// @param token The token id.
/// @param pos Its position.
/// @param seq_ids [n_seq_ids] the sequences it belongs to (the first is its primary sequence).
/// @param n_seq_ids Entries of seq_ids, in [1, n_seq_max of the batch].
/// @param output Whether the token produces an output (logits, embeddings).
/// @return #KVC_OK; #KVC_ERR_INVALID_ARGUMENT for NULL pointers, a wrong n_seq_ids, an embeddings batch or a
/// batch from kvc_batch_get_one(); #KVC_ERR_OUT_OF_RANGE when the batch is full. The batch is unchanged
/// on failure. Sequence ids are checked later, by kvc_memory_init_batch().
KVC_API kvc_status kvc_batch_add(kvc_batch* batch, int32_t token, int32_t pos, const int32_t* seq_ids,
                                 size_t n_seq_ids, bool output) KVC_NOEXCEPT;

/// @brief Appends an embedding row.
/// @param batch A batch from kvc_batch_init() with n_embd > 0.
/// @param embd [n_embd] the row (copied).
/// @param pos Its position.
/// @param seq_ids [n_seq_ids] the sequences it belongs to.
/// @param n_seq_ids Entries of seq_ids, in [1, n_seq_max of the batch].
/// @param output Whether the row produces an output.
/// @return #KVC_OK; #KVC_ERR_INVALID_ARGUMENT for NULL pointers, a wrong n_seq_ids or a token batch;
/// #KVC_ERR_OUT_OF_RANGE when the batch is full. The batch is unchanged on failure.
KVC_API kvc_status kvc_batch_add_embd(kvc_batch* batch, const float* embd, int32_t pos,
                                      const int32_t* seq_ids, size_t n_seq_ids, bool output) KVC_NOEXCEPT;

/// @brief Removes every token (the capacity stays).
/// @param batch A batch from kvc_batch_init().
/// @return #KVC_OK; #KVC_ERR_INVALID_ARGUMENT for NULL or a batch from kvc_batch_get_one().
KVC_API kvc_status kvc_batch_clear(kvc_batch* batch) KVC_NOEXCEPT;

/// @brief Sets or clears the output flag of token i (e.g. the last one, after filling).
/// @param batch A batch from kvc_batch_init().
/// @param i Index of the token, in [0, kvc_batch_n_tokens()).
/// @param output The flag.
/// @return #KVC_OK; #KVC_ERR_INVALID_ARGUMENT for NULL or a batch from kvc_batch_get_one();
/// #KVC_ERR_OUT_OF_RANGE for a bad index.
KVC_API kvc_status kvc_batch_set_output(kvc_batch* batch, int32_t i, bool output) KVC_NOEXCEPT;

/// @brief Tokens in a batch.
/// @param batch The batch.
/// @return The count, or #KVC_ERR_INVALID_ARGUMENT (negative) for NULL.
KVC_API int32_t kvc_batch_n_tokens(const kvc_batch* batch) KVC_NOEXCEPT;

/// @brief Capacity of a batch in tokens (the token count for a batch from kvc_batch_get_one()).
/// @param batch The batch.
/// @return The capacity, or #KVC_ERR_INVALID_ARGUMENT (negative) for NULL.
KVC_API int32_t kvc_batch_capacity(const kvc_batch* batch) KVC_NOEXCEPT;

// ---------------------------------------------------------------------------------------------------------
// Placement: memory contexts
// ---------------------------------------------------------------------------------------------------------

/// @brief The plan for one batch (or an update): its ubatches and their cells. Creating one changes
/// nothing; kvc_memory_context_apply() commits the current ubatch. Borrows its memory: free the context
/// before the memory, and do not change the memory (sequence ops, state loads, other contexts) between
/// creating a context and applying its last ubatch.
typedef struct kvc_memory_context kvc_memory_context;

/// @brief What a context has to do (kvc::memory_status).
typedef enum kvc_memory_status {
    KVC_MEMORY_STATUS_SUCCESS = 0,         ///< the context has work to apply
    KVC_MEMORY_STATUS_NO_UPDATE = 1,       ///< nothing to do (update contexts only)
    KVC_MEMORY_STATUS_FAILED_PREPARE = 2,  ///< the batch could not be placed; the memory is unchanged
    KVC_MEMORY_STATUS_FAILED_COMPUTE = 3,  ///< reserved for memories whose apply can fail
} kvc_memory_status;

/// @brief Validates a batch, splits it into ubatches of at most n_ubatch tokens and finds cells for all
/// of them (llama_memory_i::init_batch, after llama_batch_allocr::init).
///
/// The batch is checked against the memory (sequence ids in [0, n_seq_max), positions that continue each
/// sequence; missing positions are filled from the memory). A valid batch that does not fit is not an
/// error: the call returns #KVC_OK with a context whose kvc_memory_context_get_status() is
/// #KVC_MEMORY_STATUS_FAILED_PREPARE (free it; the memory is unchanged; free cells or use a smaller batch).
/// The context copies what it needs: the batch may be changed or freed afterwards.
/// @param mem The memory.
/// @param batch The batch.
/// @param n_ubatch Most tokens per ubatch (>= 1).
/// @param embd_all Every token produces an output (embeddings / pooling), which constrains the split.
/// @param out Receives the context (free it with kvc_memory_context_free()); NULL on failure.
/// @return #KVC_OK (check the context's status); #KVC_ERR_INVALID_ARGUMENT / #KVC_ERR_OUT_OF_RANGE for NULL
/// pointers, n_ubatch == 0 or a batch that breaks a rule (the message names the token and the value);
/// #KVC_ERR_INVALID_STATE for a batch whose positions do not continue a sequence the memory holds (a gap
/// after its last position, or a start before it that the memory cannot take).
KVC_API kvc_status kvc_memory_init_batch(kvc_memory* mem, const kvc_batch* batch, uint32_t n_ubatch,
                                         bool embd_all, kvc_memory_context** out) KVC_NOEXCEPT;

/// @brief A context shaped like the largest possible ubatch (every cell), to size compute buffers:
/// kvc_memory_context_n_kv() is the cells of the cache holding the layer and kvc_memory_get_k() /
/// kvc_memory_get_v() give views of every cell; with recurrent state,
/// kvc_memory_context_get_rs() covers every cell (head 0, n_rs = n_seq_max, rs_z 0, s_copy[i] = i).
/// Applying it does nothing.
/// @param mem The memory.
/// @param out Receives the context; NULL on failure.
/// @return #KVC_OK; #KVC_ERR_INVALID_ARGUMENT for NULL pointers.
KVC_API kvc_status kvc_memory_init_full(kvc_memory* mem, kvc_memory_context** out) KVC_NOEXCEPT;

/// @brief A context for pending maintenance: K-shifts left by kvc_memory_seq_add() / kvc_memory_seq_div(),
/// and compaction (when optimize, or past compact_threshold). Its status is #KVC_MEMORY_STATUS_NO_UPDATE
/// when there is nothing to do, else #KVC_MEMORY_STATUS_SUCCESS: apply it before the next batch
/// (kvc_memory_context_apply()), after reading kvc_memory_set_input_k_shift() if the engine rotates keys
/// itself.
/// @param mem The memory.
/// @param optimize Also compact the cells (move used cells down into holes) when there are holes.
/// @param out Receives the context; NULL on failure.
/// @return #KVC_OK; #KVC_ERR_INVALID_ARGUMENT for NULL pointers.
KVC_API kvc_status kvc_memory_init_update(kvc_memory* mem, bool optimize,
                                          kvc_memory_context** out) KVC_NOEXCEPT;

/// @brief Runs pending maintenance now: kvc_memory_init_update() and, when it has work, apply (stored keys
/// are re-rotated on the host, cells compacted).
/// @param mem The memory.
/// @param optimize Also compact the cells.
/// @param updated Receives whether anything was done; may be NULL.
/// @return #KVC_OK; #KVC_ERR_INVALID_ARGUMENT for NULL mem; #KVC_ERR_UNSUPPORTED when positions of an
/// M-RoPE cache would have to be shifted.
KVC_API kvc_status kvc_memory_update(kvc_memory* mem, bool optimize, bool* updated) KVC_NOEXCEPT;

/// @brief Frees a context (an unapplied plan is dropped; ubatches already applied stay in the memory).
/// @param ctx The context; NULL is harmless.
KVC_API void kvc_memory_context_free(kvc_memory_context* ctx) KVC_NOEXCEPT;

/// @brief The status of a context: whether it has work to apply, nothing to do, or failed to place its
/// batch (not an error: the memory is unchanged).
/// @param ctx The context.
/// @param out Receives its status.
/// @return #KVC_OK; #KVC_ERR_INVALID_ARGUMENT for NULL pointers.
KVC_API kvc_status kvc_memory_context_get_status(const kvc_memory_context* ctx,
                                                 kvc_memory_status* out) KVC_NOEXCEPT;

/// @brief Commits the current ubatch to the memory (or runs the update). Each ubatch is applied once.
/// @param ctx The context, whose status is #KVC_MEMORY_STATUS_SUCCESS (or NO_UPDATE: nothing happens).
/// @return #KVC_OK; #KVC_ERR_INVALID_ARGUMENT for NULL; #KVC_ERR_INVALID_STATE for a failed context, a
/// ubatch already applied or none left; #KVC_ERR_UNSUPPORTED for an update an M-RoPE cache cannot do.
KVC_API kvc_status kvc_memory_context_apply(kvc_memory_context* ctx) KVC_NOEXCEPT;

/// @brief Moves to the next ubatch once the current one is computed; past the last one the step counts
/// as computed, and a prefix cache publishes the blocks it completed (a sequence removed right after it
/// leaves them cached; after a failed compute, do not call it). Like `sqlite3_step`, the status says
/// whether the call worked and `more` whether there is another ubatch, so that a failure is never
/// mistaken for the end:
/// @code
/// bool more = true;
/// while (more) {
///     /* apply the current ubatch, compute it */
///     if (kvc_memory_context_next(ctx, &more) != KVC_OK) { /* report kvc_last_error() */ }
/// }
/// @endcode
/// @param ctx The context.
/// @param more Receives true when there is a next ubatch (now the current one); false when every ubatch
/// has been consumed, and for update, full and failed contexts.
/// @return #KVC_OK; #KVC_ERR_INVALID_ARGUMENT for NULL pointers.
KVC_API kvc_status kvc_memory_context_next(kvc_memory_context* ctx, bool* more) KVC_NOEXCEPT;

/// @brief Cells the attention of layer il reads in the current ubatch (padded to n_kv_pad): n_kv of the KV
/// cache holding the layer, known after apply (with iSWA, full-attention and sliding-window layers
/// differ).
/// @param ctx The context.
/// @param il Model index of a layer with K/V.
/// @return n_kv (0 before the current ubatch is applied and for update contexts; the cells of the cache
/// for a full context), or a negative ::kvc_status: #KVC_ERR_INVALID_ARGUMENT for NULL,
/// #KVC_ERR_OUT_OF_RANGE for a layer without K/V, #KVC_ERR_INVALID_STATE for a failed context,
/// #KVC_ERR_UNSUPPORTED for a memory without K/V.
KVC_API int64_t kvc_memory_context_n_kv(const kvc_memory_context* ctx, uint32_t il) KVC_NOEXCEPT;

/// @brief Tokens of the current ubatch.
/// @param ctx A batch context.
/// @return The count, or a negative ::kvc_status: #KVC_ERR_INVALID_ARGUMENT for NULL, #KVC_ERR_INVALID_STATE
/// for a context without a current ubatch (failed, update, full, or past the last ubatch).
KVC_API int64_t kvc_memory_context_n_tokens(const kvc_memory_context* ctx) KVC_NOEXCEPT;

/// @brief The current ubatch, as borrowed arrays (what the engine computes).
///
/// With equal_seqs, tokens form n_seqs blocks of n_seq_tokens tokens with the same sequence set each.
typedef struct kvc_ubatch_view {
    uint32_t n_tokens;             ///< tokens (== n_seq_tokens * n_seqs)
    uint32_t n_seq_tokens;         ///< tokens per block (1 for simple splits)
    uint32_t n_seqs;               ///< blocks
    uint32_t n_seqs_unq;           ///< distinct sequence ids
    uint32_t n_pos;                ///< position sections per token (4 for M-RoPE)
    uint32_t n_embd;               ///< embedding width (0 with token input)
    bool equal_seqs;               ///< blocks of equal length
    const int32_t* token;          ///< [n_tokens] token ids, or NULL with embeddings input
    const float* embd;             ///< [n_tokens][n_embd] embedding rows, or NULL with token input
    const int32_t* pos;            ///< [n_pos][n_tokens] section-major positions: pos[j * n_tokens + i]
    const int32_t* n_seq_id;       ///< [n_tokens] sequence ids per token
    const uint32_t* seq_id_begin;  ///< [n_tokens + 1] token i's ids are seq_id_data[begin[i] .. begin[i+1])
    const int32_t* seq_id_data;    ///< every token's sequence ids, token by token (primary first)
    const int32_t* seq_id_unq;     ///< [n_seqs_unq] distinct sequence ids, ascending
    const int8_t* output;          ///< [n_tokens] non-zero: the token produces an output
    const int32_t* batch_idx;      ///< [n_tokens] index of each token in the batch
} kvc_ubatch_view;

/// @brief Describes the current ubatch.
/// @param ctx A batch context.
/// @param out Receives the view; its pointers are valid until kvc_memory_context_next() or
/// kvc_memory_context_free().
/// @return #KVC_OK; #KVC_ERR_INVALID_ARGUMENT for NULL pointers; #KVC_ERR_INVALID_STATE for a context
/// without a current ubatch.
KVC_API kvc_status kvc_memory_context_get_ubatch(const kvc_memory_context* ctx,
                                                 kvc_ubatch_view* out) KVC_NOEXCEPT;

/// @brief Batch indices of the output tokens, in the order the ubatches produce their output rows (to put
/// output rows back into batch order).
/// @param ctx A context.
/// @param ids Receives a borrowed array, valid until kvc_memory_context_free() (NULL when empty).
/// @param n Receives its length (0 for non-batch contexts).
/// @return #KVC_OK; #KVC_ERR_INVALID_ARGUMENT for NULL pointers.
KVC_API kvc_status kvc_memory_context_out_ids(const kvc_memory_context* ctx, const int32_t** ids,
                                              size_t* n) KVC_NOEXCEPT;

// ---------------------------------------------------------------------------------------------------------
// K/V data and attention inputs, through a context (after kvc_memory_context_apply())
//
// Every function takes a layer (model index) and works on every memory with K/V: it uses the KV cache
// that holds the layer (with iSWA: the full-attention or the sliding-window cache; in a hybrid memory:
// its attention part). Layers of one cache share n_kv, the KQ mask, the position buckets and the
// K-shift: compute them once per cache, with any of its layers (for iSWA, one full-attention layer and
// one sliding-window layer). A layer without K/V is #KVC_ERR_OUT_OF_RANGE; a memory without K/V
// (recurrent) #KVC_ERR_UNSUPPORTED; a failed context, or reading the current ubatch before it is
// applied, #KVC_ERR_INVALID_STATE.
// ---------------------------------------------------------------------------------------------------------

/// @brief A strided 4-D view of stored data, as ggml describes tensors.
///
/// ne[i] counts elements along dimension i (ne[0] is the row length in values); nb[i] is the stride of
/// dimension i in bytes (nb[0] = one element or one block). Element (i0, i1, i2, i3) of a float type is at
/// data + i0*nb[0] + i1*nb[1] + i2*nb[2] + i3*nb[3].
typedef struct kvc_tensor_view {
    kvc_type type;  ///< element type
    int64_t ne[4];  ///< elements per dimension
    size_t nb[4];   ///< stride per dimension, in bytes
    void* data;     ///< first element; borrowed from the memory
} kvc_tensor_view;

/// @brief Writes the keys of the current ubatch into its cells (converted to type_k).
/// @param ctx A batch context whose current ubatch is applied.
/// @param il Model index of the layer.
/// @param src [n_tokens][n_head_kv * n_embd_head_k] f32 rows, in ubatch order.
/// @param n_tokens Rows in src: the current ubatch's token count.
/// @return #KVC_OK; #KVC_ERR_INVALID_ARGUMENT for NULL pointers or a wrong n_tokens;
/// #KVC_ERR_OUT_OF_RANGE for a layer without K/V in this memory; #KVC_ERR_INVALID_STATE when the ubatch is
/// not applied (or the context has none); #KVC_ERR_UNSUPPORTED for a memory without K/V (recurrent) or
/// whose engine owns the K/V tensors (kvcache_engine.h: the engine writes at kvc_memory_k_idxs()).
KVC_API kvc_status kvc_memory_cpy_k(kvc_memory_context* ctx, uint32_t il, const float* src,
                                    size_t n_tokens) KVC_NOEXCEPT;

/// @brief Writes the values of the current ubatch into its cells (converted to type_v; transposed if
/// v_trans).
/// @param ctx A batch context whose current ubatch is applied.
/// @param il Model index of the layer.
/// @param src [n_tokens][n_head_kv * n_embd_head_v] f32 rows, in ubatch order.
/// @param n_tokens Rows in src: the current ubatch's token count.
/// @return As kvc_memory_cpy_k().
KVC_API kvc_status kvc_memory_cpy_v(kvc_memory_context* ctx, uint32_t il, const float* src,
                                    size_t n_tokens) KVC_NOEXCEPT;

/// @brief A view of the keys of layer il the current ubatch's attention reads:
/// [n_embd_head_k, n_head_kv, n_kv, n_stream] (cell c of stream s at i2 = c, i3 = s).
/// @param ctx A batch context whose current ubatch is applied, or a full context.
/// @param il Model index of the layer.
/// @param out Receives the view; valid while the memory lives (its contents change with the memory).
/// @return #KVC_OK; #KVC_ERR_INVALID_ARGUMENT for NULL pointers; #KVC_ERR_OUT_OF_RANGE for a layer without
/// K/V; #KVC_ERR_INVALID_STATE before apply or for a context without a slot; #KVC_ERR_UNSUPPORTED for a
/// memory without K/V (recurrent) or whose engine owns the K/V tensors (kvcache_engine.h).
KVC_API kvc_status kvc_memory_get_k(kvc_memory_context* ctx, uint32_t il, kvc_tensor_view* out) KVC_NOEXCEPT;

/// @brief A view of the values of layer il: [n_embd_head_v, n_head_kv, n_kv, n_stream], or with v_trans
/// [n_kv, n_head_kv, n_embd_head_v, n_stream] (cells fastest).
/// @param ctx A batch context whose current ubatch is applied, or a full context.
/// @param il Model index of the layer.
/// @param out Receives the view.
/// @return As kvc_memory_get_k().
KVC_API kvc_status kvc_memory_get_v(kvc_memory_context* ctx, uint32_t il, kvc_tensor_view* out) KVC_NOEXCEPT;

/// @brief Elements of the KQ mask (and of the position buckets) of the current ubatch in the KV cache
/// holding layer il: n_kv * n_tokens.
/// @param ctx A batch context whose current ubatch is applied.
/// @param il Model index of a layer with K/V.
/// @return The count, or a negative ::kvc_status: #KVC_ERR_INVALID_ARGUMENT for NULL,
/// #KVC_ERR_OUT_OF_RANGE for a layer without K/V, #KVC_ERR_INVALID_STATE before apply, without a current
/// ubatch or for a failed context, #KVC_ERR_UNSUPPORTED for a memory without K/V.
KVC_API int64_t kvc_memory_kq_mask_elements(const kvc_memory_context* ctx, uint32_t il) KVC_NOEXCEPT;

/// @brief Builds the KQ mask of the current ubatch for the KV cache holding layer il: [n_tokens][n_kv],
/// row i for token i, 0 where the token may attend to the cell and -INFINITY elsewhere (the cell is empty,
/// of another sequence, in the future when causal, or outside the sliding window: with iSWA, the mask of
/// a sliding-window layer also hides keys outside the window).
/// @param ctx A batch context whose current ubatch is applied.
/// @param il Model index of a layer with K/V.
/// @param type #KVC_TYPE_F32 (dst holds floats) or #KVC_TYPE_F16 (IEEE binary16: 0x0000 visible, 0xFC00
/// = -inf masked).
/// @param dst [n_elements] values of `type`.
/// @param n_elements Elements of dst: kvc_memory_kq_mask_elements().
/// @param causal Keys after the query's position are masked.
/// @param alibi Visible cells get -|p_key - p_query| instead of 0 (ALiBi biases).
/// @return #KVC_OK; #KVC_ERR_INVALID_ARGUMENT for NULL pointers, another type or a wrong n_elements;
/// #KVC_ERR_OUT_OF_RANGE for a layer without K/V; #KVC_ERR_INVALID_STATE before apply, without a current
/// ubatch or for a failed context; #KVC_ERR_UNSUPPORTED for a memory without K/V.
KVC_API kvc_status kvc_memory_set_input_kq_mask(const kvc_memory_context* ctx, uint32_t il, kvc_type type,
                                                void* dst, size_t n_elements, bool causal,
                                                bool alibi) KVC_NOEXCEPT;

/// @brief T5 relative position buckets of the current ubatch for the KV cache holding layer il:
/// [n_tokens][n_kv] (unified caches only).
/// @param ctx A batch context whose current ubatch is applied.
/// @param il Model index of a layer with K/V.
/// @param dst [n] buckets.
/// @param n Elements of dst: kvc_memory_kq_mask_elements().
/// @param n_buckets Number of buckets of the model.
/// @return #KVC_OK; #KVC_ERR_INVALID_ARGUMENT for NULL pointers or a wrong n; #KVC_ERR_OUT_OF_RANGE for a
/// layer without K/V; #KVC_ERR_INVALID_STATE before apply or for a failed context; #KVC_ERR_UNSUPPORTED for
/// a cache with several streams or a memory without K/V.
KVC_API kvc_status kvc_memory_set_input_pos_bucket(const kvc_memory_context* ctx, uint32_t il, int32_t* dst,
                                                   size_t n, uint32_t n_buckets) KVC_NOEXCEPT;

/// @brief Elements of the K-shift input of the KV cache holding layer il: kv_size * n_stream of that cache.
/// @param mem The memory.
/// @param il Model index of a layer with K/V.
/// @return The count, or a negative ::kvc_status: #KVC_ERR_INVALID_ARGUMENT for NULL,
/// #KVC_ERR_OUT_OF_RANGE for a layer without K/V, #KVC_ERR_UNSUPPORTED for a memory without K/V.
KVC_API int64_t kvc_memory_k_shift_elements(const kvc_memory* mem, uint32_t il) KVC_NOEXCEPT;

/// @brief The pending shift of every cell of the KV cache holding layer il, for engines that re-rotate keys
/// themselves (read it before applying the update context): [n_stream][kv_size], 0 for empty cells.
/// @param mem The memory.
/// @param il Model index of a layer with K/V.
/// @param dst [n] shifts.
/// @param n Elements of dst: kvc_memory_k_shift_elements().
/// @return #KVC_OK; #KVC_ERR_INVALID_ARGUMENT for NULL pointers or a wrong n; #KVC_ERR_OUT_OF_RANGE for a
/// layer without K/V; #KVC_ERR_UNSUPPORTED for a memory without K/V.
KVC_API kvc_status kvc_memory_set_input_k_shift(const kvc_memory* mem, uint32_t il, int32_t* dst,
                                                size_t n) KVC_NOEXCEPT;

// ---------------------------------------------------------------------------------------------------------
// Recurrent state through a context (recurrent and hybrid memories)
//
// Engine contract for one applied ubatch (B = n_seqs blocks of T = n_seq_tokens tokens, from
// kvc_ubatch_view). Rows are those of the [n_embd, size, 1 + n_rs_seq] tensors of kvc_memory_get_r() /
// kvc_memory_get_s(); row index = plane * size + cell, at data + cell * nb[1] + plane * nb[2]:
//   1. if rs_z >= 0, zero row rs_z of every r and s tensor, before reading anything;
//   2. gather, from the storage as it is before this ubatch writes anything, row s_copy[i] for every i
//      in [0, n_rs) and the src row of every history copy;
//   3. i in [B, n_rs): write gathered row s_copy[i] to plane 0 of cell head + i;
//   4. i in [0, B): the gathered row is block i's initial state; run its T tokens and write the final
//      state to plane 0 of cell head + i; with n_rs_seq = k > 0 also write, for r = 1 .. min(k, T - 1),
//      the state after token T - 1 - r of the block to plane r of cell head + i; with a prefix cache,
//      also the state after token t of block i to row dst for every snapshot {i, t, dst} (snaps);
//   5. write every gathered history copy to its dst row.
// docs/c-api.md shows it in C; include/kvcache/memory_recurrent.h explains cells and rollback.
// ---------------------------------------------------------------------------------------------------------

/// @brief A row move of the engine contract (step 5): rows of the [n_embd, size * (1 + n_rs_seq)] layout.
typedef struct kvc_rs_copy {
    int64_t src;  ///< row read before the ubatch writes anything
    int64_t dst;  ///< row written after
} kvc_rs_copy;

/// @brief A snapshot of the engine contract (step 4): block `block`'s state after its token `token` goes
/// to row `dst`, a snapshot row after the planes (the tensors are contiguous: at data + dst * nb[1]).
typedef struct kvc_rs_snap {
    uint32_t block;  ///< block of the ubatch, in [0, n_seqs)
    uint32_t token;  ///< token of the block, in [0, n_seq_tokens)
    int64_t dst;     ///< snapshot row: (1 + n_rs_seq) * size + slot
} kvc_rs_snap;

/// @brief Where the current ubatch's states come from and go, as borrowed arrays.
typedef struct kvc_rs_view {
    uint32_t head;                 ///< first cell of the range
    uint32_t n_rs;                 ///< cells in the range; the first n_seqs are the blocks' ("main" cells)
    uint32_t n_seqs;               ///< blocks of the ubatch (B; n_rs for a full context)
    int32_t rs_z;                  ///< row to zero before reading (fresh states read it), -1: none
    uint32_t size;                 ///< cells of the memory (= n_seq_max): rows per plane
    uint32_t n_rs_seq;             ///< rollback depth k: each tensor has 1 + k planes
    const int64_t* s_copy;         ///< [n_rs] source row of range cell i (plane * size + cell)
    const kvc_rs_copy* hist_copy;  ///< [n_hist_copy] history rows to carry over (NULL when none)
    size_t n_hist_copy;            ///< entries of hist_copy (0 when n_rs_seq == 0)
    const kvc_rs_snap* snaps;      ///< [n_snaps] snapshots to write (NULL when none)
    size_t n_snaps;                ///< entries of snaps (0 without a prefix cache)
} kvc_rs_view;

/// @brief The state inputs of the current ubatch (recurrent and hybrid memories; for a hybrid memory,
/// those of its recurrent part).
/// @param ctx A batch context whose current ubatch is applied, or a full context.
/// @param out Receives the view; its arrays are the context's own, valid until kvc_memory_context_next()
/// or kvc_memory_context_free().
/// @return #KVC_OK; #KVC_ERR_INVALID_ARGUMENT for NULL pointers; #KVC_ERR_INVALID_STATE before apply, past
/// the last ubatch, for an update context or a failed one; #KVC_ERR_UNSUPPORTED for a memory without
/// recurrent state.
KVC_API kvc_status kvc_memory_context_get_rs(const kvc_memory_context* ctx, kvc_rs_view* out) KVC_NOEXCEPT;

/// @brief A view of layer il's r tensor (conv / token-shift state): [n_embd_r, size, 1 + n_rs_seq], row of
/// cell c in plane p at (c, p), writable. It does not depend on the ubatch: any context of the memory gives
/// it, before apply too.
/// @param ctx A context of a recurrent or hybrid memory.
/// @param il Model index of a layer with an r row.
/// @param out Receives the view; valid while the memory lives (its contents change with the memory).
/// @return #KVC_OK; #KVC_ERR_INVALID_ARGUMENT for NULL pointers; #KVC_ERR_OUT_OF_RANGE for a layer without
/// an r row; #KVC_ERR_UNSUPPORTED for a memory without recurrent state.
KVC_API kvc_status kvc_memory_get_r(kvc_memory_context* ctx, uint32_t il, kvc_tensor_view* out) KVC_NOEXCEPT;

/// @brief A view of layer il's s tensor (SSM / WKV state): [n_embd_s, size, 1 + n_rs_seq]; see
/// kvc_memory_get_r().
/// @param ctx A context of a recurrent or hybrid memory.
/// @param il Model index of a layer with an s row.
/// @param out Receives the view.
/// @return As kvc_memory_get_r() (an s row instead of an r row).
KVC_API kvc_status kvc_memory_get_s(kvc_memory_context* ctx, uint32_t il, kvc_tensor_view* out) KVC_NOEXCEPT;

#ifdef __cplusplus
}  // extern "C"
#endif

// Sequence operations and state buffers and files: the second half of the API.
#include <kvcache/kvcache_state.h>
// The prefix cache.
#include <kvcache/kvcache_prefix.h>
// Engine-owned storage.
#include <kvcache/kvcache_engine.h>
// Tiers of the prefix cache: block stores.
#include <kvcache/kvcache_tiers.h>

#endif  // KVCACHE_KVCACHE_H
