/// @file
/// kv_cells: the bookkeeping of one stream of a KV cache (llama.cpp's llama_kv_cells).
///
/// A cell is one row of every layer's K and V buffers. Per cell it records the token position (-1 =
/// empty), the sequences that hold it, the position delta accumulated since the last K-shift, and the
/// (x, y) extension of M-RoPE positions. It knows nothing about K/V data.
///
/// Contract:
///  - A cell is "used" iff its position is >= 0. A used cell normally has at least one sequence; it may
///    have none transiently or after restoring a state written with no sequence ids.
///  - A used cell may be "held" (by the prefix cache): when its last sequence leaves, it stays used, with
///    its position and rows, and is listed in released() instead of becoming empty. Only unhold() (or
///    rm, reset) frees it. A held cell cannot be moved by seq_add / seq_div (the cache copies or lets go
///    of it first). It records a 32-bit holder (the prefix cache's block) in the place of its M-RoPE
///    extension: a held cell has none (a prefix cache needs one position per token), so the prefix cache
///    costs no memory per cell.
///  - Every precondition is checked: a call that breaks one throws kvc::error and changes nothing.
///  - Costs: seq_pos_min/max O(1); a sequence's cells in a position range O(log + cells returned) via the
///    per-sequence index; range operations on one sequence O(cells touched) plus a memmove of its index;
///    free-cell searches go by 64-cell words with a summary level above them, so a search never walks
///    cell by cell through a full or empty region.
///  - Memory follows the cells and the sequences held, not n_seq_max: per-sequence indexes exist for a window
///    of ids grown (doubling) to include every id held so far (a stream of one sequence keeps one),
///    and a cell's seq_set keeps words only for the ids it holds.
///
/// Differences from llama.cpp (see docs/concepts.md): pos_div records shift = new - old (design D1);
/// any number of sequences; pos_add that drops a cell below 0 clears its M-RoPE extension too; snapshots
/// carry the pending shift instead of requiring it to be zero.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>  // std::pair
#include <vector>

#include <kvcache/seq_set.h>
#include <kvcache/types.h>

namespace kvc {

/// 2-D position of an M-RoPE (image) token.
struct cell_ext {
    pos_t x = 0;  ///< column
    pos_t y = 0;  ///< row

    /// Row-major order: (y, x) strictly after (oy, ox).
    bool is_2d_gt(pos_t ox, pos_t oy) const { return y > oy || (y == oy && x > ox); }
    bool operator==(const cell_ext&) const = default;  ///< the same (x, y)
};

/// Metadata of some cells, copied by kv_cells::cp and written back by kv_cells::set (rollback of a trial
/// placement). Entry j belongs to the j-th copied cell.
struct cells_snapshot {
    std::vector<pos_t> pos;     ///< position of each cell (-1: empty)
    std::vector<cell_ext> ext;  ///< M-RoPE (x, y) of each cell
    std::vector<pos_t> shift;   ///< pending shift of each cell
    std::vector<seq_set> seq;   ///< sequences of each cell

    size_t size() const { return pos.size(); }  ///< number of cells copied
};

/// The bookkeeping of one stream of a KV cache (llama_kv_cells): per cell its position, sequences,
/// pending shift and M-RoPE extension, with per-sequence position indexes.
class kv_cells {
public:
    kv_cells();  ///< no cells
    /// n_seq_max: sequence ids accepted are [0, n_seq_max). Throws on n_seq_max < 1.
    explicit kv_cells(uint32_t n_cells, uint32_t n_seq_max = 1);
    kv_cells(const kv_cells& other);             ///< a deep copy
    kv_cells& operator=(const kv_cells& other);  ///< a deep copy
    kv_cells(kv_cells&&) noexcept;               ///< takes other's cells
    kv_cells& operator=(kv_cells&&) noexcept;    ///< takes other's cells
    ~kv_cells();

    // -- size --
    uint32_t size() const { return static_cast<uint32_t>(pos_.size()); }  ///< number of cells
    uint32_t n_seq_max() const { return n_seq_max_; }                     ///< sequence ids are [0, n_seq_max)
    void resize(uint32_t n);                                              ///< then reset()
    void reset();                                                         ///< every cell empty, no shifts
    void reset_shift();  ///< forget pending shifts (after the K data was re-rotated)

    // -- queries --
    bool is_empty(uint32_t i) const { return pos_[check(i)] == pos_none; }  ///< cell i holds no token
    uint32_t get_used() const { return n_used_; }                           ///< number of used cells
    uint32_t used_min() const;                         ///< smallest used index, 0 if none
    uint32_t used_max_p1() const;                      ///< largest used index + 1, 0 if none
    bool get_has_shift() const { return has_shift_; }  ///< some cell has a pending shift

    pos_t pos_get(uint32_t i) const { return pos_[check(i)]; }        ///< position of cell i (-1: empty)
    cell_ext ext_get(uint32_t i) const;                               ///< M-RoPE (x, y) of cell i
    pos_t get_shift(uint32_t i) const { return shift_[check(i)]; }    ///< pending shift of cell i
    const seq_set& seqs(uint32_t i) const { return seq_[check(i)]; }  ///< sequences of cell i
    /// Number of sequences of cell i.
    uint32_t seq_count(uint32_t i) const { return static_cast<uint32_t>(seq_[check(i)].size()); }
    bool seq_has(uint32_t i, seq_id_t s) const { return seq_[check(i)].contains(s); }  ///< s holds cell i
    seq_id_t seq_get(uint32_t i) const;  ///< the cell's only sequence; throws otherwise
    /// p0 <= pos < p1 (never true for an empty cell if p0 >= 0)
    bool pos_in(uint32_t i, pos_t p0, pos_t p1) const {
        const pos_t p = pos_[check(i)];
        return p >= p0 && p < p1;
    }

    /// Smallest position of s; -1 when the sequence holds no cell.
    pos_t seq_pos_min(seq_id_t s) const;
    pos_t seq_pos_max(seq_id_t s) const;  ///< largest position of s; -1 when the sequence holds no cell
    /// Number of cells of s whose position is exactly p (a position may repeat within a sequence).
    uint32_t seq_pos_count(seq_id_t s, pos_t p) const;
    uint32_t seq_n_cells(seq_id_t s) const;  ///< cells holding s
    /// Cells of s with p0 <= pos < p1, by ascending (position, index); appended to out. Negative p0 means
    /// 0, negative p1 means no upper bound.
    void seq_cells(seq_id_t s, pos_t p0, pos_t p1, std::vector<uint32_t>& out) const;
    /// The same as (position, cell) pairs, without copying; valid until the next mutation.
    std::span<const std::pair<pos_t, uint32_t>> seq_entries(seq_id_t s, pos_t p0, pos_t p1) const;

    /// Used cells, ascending, appended to out (O(used + size / 4096)).
    void used_cells(std::vector<uint32_t>& out) const;

    // -- free-cell search (empty cells only) --
    /// The first n empty cells in ring order from hint ([hint, size) then [0, hint)), appended to out.
    /// Returns false, leaving out unchanged, when fewer than n cells are empty.
    bool find_free(uint32_t n, uint32_t hint, std::vector<uint32_t>& out) const;
    /// Start of the first run of n consecutive empty cells at or after hint, else the first from 0; a
    /// run does not wrap around the end. nullopt when there is none.
    std::optional<uint32_t> find_contiguous(uint32_t n, uint32_t hint = 0) const;

    // -- cells held by the prefix cache --
    bool is_held(uint32_t i) const;  ///< cell i is held
    /// Used cell, not yet held, without an M-RoPE extension -> held by `holder`.
    void hold(uint32_t i, uint32_t holder);
    uint32_t holder(uint32_t i) const;  ///< the holder of held cell i
    /// held cell -> not held; a cell without sequences becomes empty then (returns true).
    bool unhold(uint32_t i);
    /// Held cells whose last sequence left since clear_released(), in the order they did (a cell may
    /// appear again after it was attached to and released anew).
    std::span<const uint32_t> released() const;
    void clear_released();  ///< forget released()
    /// Forgets the entries of released() after the first n (those of a placement that was rolled back).
    void truncate_released(size_t n);

    // -- mutations --
    void pos_set(uint32_t i, pos_t p);     ///< empty cell with no sequences -> used at p (p >= 0)
    void ext_set(uint32_t i, cell_ext e);  ///< sets the M-RoPE (x, y) of cell i
    void seq_add(uint32_t i, seq_id_t s);  ///< used cell, s not yet in it
    /// Empty cells cells[j] -> used at pos[j] (and M-RoPE ext[j] unless ext is empty), each held by s
    /// alone: pos_set + ext_set + seq_add for many cells at once (restoring a sequence's state). Throws,
    /// changing nothing, on a bad index, a cell in use or given twice, a negative position, a bad s or
    /// sizes that differ.
    void fill(std::span<const uint32_t> cells, std::span<const pos_t> pos, std::span<const cell_ext> ext,
              seq_id_t s);
    /// s moves from used cell `from` to used cell `to` at the same position (the prefix cache moves a
    /// sequence onto cached cells it recomputed); O(log n) in s's cells. True if `from` became empty.
    bool seq_move(uint32_t from, uint32_t to, seq_id_t s);
    bool seq_rm(uint32_t i, seq_id_t s);    ///< used cell holding s; true if the cell became empty
    bool seq_keep(uint32_t i, seq_id_t s);  ///< drop every other sequence; true if the cell became empty
    void rm(uint32_t i);                    ///< used cell -> empty (held or not)
    /// used cell: pos += d, shift += d; true if it fell below 0 (now empty)
    bool pos_add(uint32_t i, pos_t d);
    void pos_div(uint32_t i, int d);      ///< used cell, d >= 1: pos /= d, shift += new - old
    void mv(uint32_t src, uint32_t dst);  ///< used src -> empty dst, with all it holds (compaction)

    // -- sequence operations on this stream (what kv_cache does per stream; design/kv-cache.md §5) --
    /// @name Sequence operations
    /// Position ranges are [p0, p1) with p0 < 0 meaning 0 and p1 < 0 meaning no bound. Cost: the cells of
    /// the sequence in the range (seq_keep_all and seq_rm_range(-1, ...): the used cells). Each returns
    /// the lowest cell index that became empty, or size() when none did.
    /// @{
    uint32_t seq_rm_range(seq_id_t s, pos_t p0, pos_t p1);  ///< s = -1: empty every cell in the range
    /// dst joins src's cells (idempotent)
    void seq_cp_range(seq_id_t src, seq_id_t dst, pos_t p0, pos_t p1);
    uint32_t seq_keep_all(seq_id_t s);  ///< every cell keeps only s, or empties
    /// Moves whole cells (every sequence sharing them). Throws, changing nothing, if a position or pending
    /// shift would overflow int32.
    uint32_t seq_add_range(seq_id_t s, pos_t p0, pos_t p1, pos_t d);
    void seq_div_range(seq_id_t s, pos_t p0, pos_t p1, int d);  ///< d >= 1
    /// @}

    // -- snapshots (rollback) --
    cells_snapshot cp(uint32_t i, uint32_t n) const;                       ///< cells [i, i + n)
    cells_snapshot cp(std::span<const uint32_t> idxs) const;               ///< the cells idxs[j]
    void set(uint32_t i, const cells_snapshot& snap);                      ///< cell i + j <- entry j
    void set(std::span<const uint32_t> idxs, const cells_snapshot& snap);  ///< cell idxs[j] <- entry j

    /// One character per cell: '.' empty, the digit/letter of its only sequence (0-9, a-z, then '*'),
    /// 'M' shared by several sequences, '?' used with no sequence, '+' held with no sequence (cached). For
    /// tests and debugging.
    std::string picture() const;

    /// Checks every internal invariant (indexes agree with the cells); throws kvc::error on a mismatch.
    /// O(size): for tests.
    void validate() const;

private:
    uint32_t check(uint32_t i) const;  // throws when i >= size()
    void check_seq(seq_id_t s, const char* what) const;
    void check_used(uint32_t i, const char* what) const;

    void index_add(uint32_t i);     // cell i's sequences -> per-sequence index at pos_[i]
    void index_remove(uint32_t i);  // and back
    void mark_used(uint32_t i);
    void mark_free(uint32_t i);
    void make_empty(uint32_t i);  // used cell with its index entries already removed -> empty
    // A used cell whose last sequence left (index entries already removed): empty, or released when
    // held. True if it became empty.
    bool drop(uint32_t i);
    bool held(uint32_t i) const;
    void check_not_held(uint32_t i, const char* what) const;

    uint32_t next_used(uint32_t from) const;  // first used index >= from, or size()
    uint32_t next_free(uint32_t from) const;  // first empty index >= from, or size()
    void restore(uint32_t target, const cells_snapshot& snap, size_t j);

    using entry = std::pair<pos_t, uint32_t>;  // (position, cell) in a sequence's index
    // [lo, hi) slice of s's index with positions in [p0, p1) (p0 < 0: 0, p1 < 0: no bound)
    std::pair<entry*, entry*> range(seq_id_t s, pos_t p0, pos_t p1);
    // After positions in s's index changed by a map that keeps [lo, hi) ordered: restore the order.
    void reorder(seq_id_t s, size_t lo, size_t hi);
    // Other sequences' entries of moved cells: (seq, old entry, new position); new < 0 = cell removed.
    void apply_moves();

    uint32_t n_seq_max_ = 1;
    std::vector<pos_t> pos_;     // [n]  position; -1 = empty
    std::vector<cell_ext> ext_;  // [n]  M-RoPE (x, y); zero unless set
    std::vector<pos_t> shift_;   // [n]  delta to apply to the stored K rows at the next K-shift
    std::vector<seq_set> seq_;   // [n]  sequences holding the cell

    uint32_t n_used_ = 0;
    bool has_shift_ = false;

    // The occupancy bitmap and the per-sequence position indexes (src/cells/kv_cells_tables.h).
    struct tables;
    std::unique_ptr<tables> t_;
};

}  // namespace kvc
