// Paged decode attention for XLA:CPU (block-sparse and dense), as XLA FFI custom calls.
//
// SparrowSparseDecodeCpu has the contract of sparrow_jax.attention.decode.sparse_decode_reference:
//   q [B, H, D] f32 (already rounded to the cache dtype), k_pages / v_pages [B, Hkv, P, S, D]
//   (f32 or bf16), page_idx [B, Hkv, N] s32, page_valid [B, Hkv, N] pred, positions [B] s32,
//   attribute scale (f32)  ->  out [B, H, D] f32.
// Valid in-range slots are attended once each (duplicates collapse, as in the reference's
// page mask); tokens after positions[b] are masked; a row with nothing visible gives 0.
// SparrowDenseDecodeCpu is the same loop over every page up to the query's own (dense decode,
// the like-for-like baseline of the sparse kernel). SparrowPagedDecodeCpu reads a shared page
// pool [NP, Hkv, S, D] through a page table [B, W] (logical page -> physical page), sparse or
// dense: the layout of the continuous-batching rollout engine.
//
// Why a custom call: XLA:CPU gathers the selected pages into a temporary and then runs
// several fusions over it, so each selected byte is moved about three times and the
// intermediates are written out. Here each (row, KV head) streams its selected pages once,
// in ascending order, through a per-page online softmax held in registers / L1, and the
// (row, KV head) pairs are spread over XLA's own intra-op thread pool. Software prefetch of
// pages further on, into L2, keeps memory busy while a page is computed (the hardware
// prefetchers stop at 4 KiB boundaries): at 16K, batch 8, on 2 cores, per layer-step,
// sparse 1.4 -> 0.9 ms and dense 9.2 -> 6.3 ms against prefetching into L1 (NTA) and the
// dense loop left to the hardware prefetchers.
//
// SparrowSelectPagesCpu does the decode step's block top-k page selection (a radix select on
// the scores' ordered bits, then a sort of the chosen only, instead of XLA's full top-k);
// SparrowScoreSelectCpu scores the pages from their metadata (centroid or Quest bounds, per-row
// or through a page table) and selects in the same pass, so the page scores never leave the
// core's cache.
// SparrowPagedSparseStepCpu is the rollout engine's sparse decode of one layer-step on a pool in
// one thread-pool round: the step's key appended to its page's metadata, the group-mean query,
// ScoreSelect, then PagedDecode.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <type_traits>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "parallel_for.h"

namespace ffi = xla::ffi;

namespace {

using sparrow::ParallelFor;

// Built with -ffast-math (vectorised expf), which assumes no infinities: a large finite
// negative stands in for -inf as the initial running max.
constexpr float kNegLarge = -1e30f;

constexpr size_t kPrefetchPages = 2;  // pages ahead (1, 2, 3, 4, 8 measured: within noise, 2 best)

// Locality 2 (into L2, not only L1): K and V pages ahead are tens of KiB in flight, which
// would evict each other from L1 before use.
inline void Prefetch(const void* start, int64_t bytes) {
  const char* p = static_cast<const char*>(start);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 2);
}

inline float ToFloat(float x) { return x; }
inline float ToFloat(uint16_t bf16) {
  uint32_t bits = static_cast<uint32_t>(bf16) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// One K or V row of ``d`` elements as float: read in place when it is float (no copy), converted
// into ``buf`` when it is bf16.
template <typename KV>
inline const float* RowAsFloat(const KV* row, int64_t d, float* buf) {
  if constexpr (std::is_same<KV, float>::value) {
    return row;
  } else {
#pragma omp simd
    for (int64_t j = 0; j < d; ++j) buf[j] = ToFloat(row[j]);
    return buf;
  }
}

struct Shape {
  int64_t batch, heads, kv_heads, pages, page_size, dim, slots;  // pages: logical pages per row
};

// Where logical page ``page`` of (row, KV head) starts, in elements from the K / V base.
// Without a table: the per-row layout [B, Hkv, P, S, D]. With one: a pool [NP, Hkv, S, D].
struct Layout {
  const int32_t* table = nullptr;  // [B, pages] physical page of each logical page, or identity
  int64_t Offset(const Shape& s, int64_t row, int64_t kv_head, int64_t page) const {
    const int64_t page_elems = s.page_size * s.dim;
    if (table == nullptr) return ((row * s.kv_heads + kv_head) * s.pages + page) * page_elems;
    return (static_cast<int64_t>(table[row * s.pages + page]) * s.kv_heads + kv_head) * page_elems;
  }
};

// One page of one (row, KV head): scores of the G query heads, online-softmax update of their
// accumulators. Token-outer, head-inner, so each K / V row is read (and converted) once per
// page for all G heads. kDim / kGroups > 0: head_dim / G fixed at compile time, so the loops
// unroll and the G accumulators stay in registers for the page (with float K / V read in place,
// 2.2-2.5x faster than with both at run time in a one-thread microbenchmark of the quickstart's
// shape, the same results bit for bit); 0: runtime ``dim`` / ``groups``.
template <int kDim, int kGroups, typename KV>
inline void AttendPage(const KV* kp, const KV* vp, const KV* k_ahead, const KV* v_ahead, int64_t visible,
                       int64_t runtime_groups, int64_t page_size, const float* qs, float* acc_io, float* score,
                       float* m, float* l, int64_t dim = kDim) {
  const int64_t d = kDim > 0 ? kDim : dim;
  const int64_t groups = kGroups > 0 ? kGroups : runtime_groups;
  // Stack rows and accumulators (not slices of the caller's scratch): the compiler then knows
  // they alias nothing (the row alone measured ~12% faster on the whole sparse step).
  constexpr bool fixed = kDim > 0 && kGroups > 0;
  float row[kDim > 0 ? kDim : 256];
  float acc_fixed[fixed ? kDim * kGroups : 1];
  float* acc = fixed ? acc_fixed : acc_io;
  if (fixed) std::memcpy(acc_fixed, acc_io, sizeof(acc_fixed));
  float* buf = row;
  std::vector<float> big;
  if (kDim == 0 && d > 256) {
    big.resize(d);
    buf = big.data();
  }
  const int64_t row_bytes = d * static_cast<int64_t>(sizeof(KV));
  for (int64_t t = 0; t < visible; ++t) {  // score[g][t] = q_g . k_t
    if (k_ahead != nullptr) Prefetch(k_ahead + t * d, row_bytes);
    const float* kf = RowAsFloat(kp + t * d, d, buf);
    for (int64_t g = 0; g < groups; ++g) {
      const float* qg = qs + g * d;
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t j = 0; j < d; ++j) dot += qg[j] * kf[j];
      score[g * page_size + t] = dot;
    }
  }
  for (int64_t g = 0; g < groups; ++g) {  // weights, running max and sum, rescale of acc
    float* sc = score + g * page_size;
    float page_max = kNegLarge;
    for (int64_t t = 0; t < visible; ++t) page_max = std::max(page_max, sc[t]);
    const float m_new = std::max(m[g], page_max);
    const float rescale = expf(m[g] - m_new);  // 0 on the first page (m = kNegLarge)
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < visible; ++t) {  // vector expf (libmvec) under -ffast-math
      sc[t] = expf(sc[t] - m_new);
      sum += sc[t];
    }
    l[g] = l[g] * rescale + sum;
    m[g] = m_new;
    float* ag = acc + g * d;
#pragma omp simd
    for (int64_t j = 0; j < d; ++j) ag[j] *= rescale;
  }
  for (int64_t t = 0; t < visible; ++t) {  // acc_g += w[g][t] * v_t
    if (v_ahead != nullptr) Prefetch(v_ahead + t * d, row_bytes);
    const float* vf = RowAsFloat(vp + t * d, d, buf);
    for (int64_t g = 0; g < groups; ++g) {
      const float w = score[g * page_size + t];
      float* ag = acc + g * d;
#pragma omp simd
      for (int64_t j = 0; j < d; ++j) ag[j] += w * vf[j];
    }
  }
  if (fixed) std::memcpy(acc_io, acc_fixed, sizeof(acc_fixed));
}

// AttendPage with head_dim and G fixed at compile time for the common shapes.
template <int kDim, typename KV>
inline void AttendPageOfDim(const KV* kp, const KV* vp, const KV* k_ahead, const KV* v_ahead, int64_t visible,
                            int64_t groups, int64_t page_size, int64_t d, const float* qs, float* acc, float* score,
                            float* m, float* l) {
  switch (groups) {
    case 1: return AttendPage<kDim, 1>(kp, vp, k_ahead, v_ahead, visible, groups, page_size, qs, acc, score, m, l, d);
    case 2: return AttendPage<kDim, 2>(kp, vp, k_ahead, v_ahead, visible, groups, page_size, qs, acc, score, m, l, d);
    case 4: return AttendPage<kDim, 4>(kp, vp, k_ahead, v_ahead, visible, groups, page_size, qs, acc, score, m, l, d);
    default: return AttendPage<kDim, 0>(kp, vp, k_ahead, v_ahead, visible, groups, page_size, qs, acc, score, m, l, d);
  }
}

template <typename KV>
inline void AttendPageDispatch(const KV* kp, const KV* vp, const KV* k_ahead, const KV* v_ahead, int64_t visible,
                               int64_t groups, int64_t page_size, int64_t d, const float* qs, float* acc,
                               float* score, float* m, float* l) {
  switch (d) {
    case 32: return AttendPageOfDim<32>(kp, vp, k_ahead, v_ahead, visible, groups, page_size, d, qs, acc, score, m, l);
    case 64: return AttendPageOfDim<64>(kp, vp, k_ahead, v_ahead, visible, groups, page_size, d, qs, acc, score, m, l);
    case 128: return AttendPageOfDim<128>(kp, vp, k_ahead, v_ahead, visible, groups, page_size, d, qs, acc, score, m, l);
    default: return AttendPage<0, 0>(kp, vp, k_ahead, v_ahead, visible, groups, page_size, qs, acc, score, m, l, d);
  }
}

// The pages one (row, KV head) attends, ascending without duplicates: its slots' valid
// in-range pages (``idx`` / ``ok``: s.slots slots), or (idx nullptr: dense) every page up to
// the query's own.
void SlotPages(const Shape& s, int64_t position, const int32_t* idx, const bool* ok, std::vector<int32_t>& pages) {
  pages.clear();
  if (idx == nullptr) {
    const int64_t last = std::min<int64_t>(position / s.page_size, s.pages - 1);
    for (int64_t p = 0; p <= last; ++p) pages.push_back(static_cast<int32_t>(p));
    return;
  }
  for (int64_t i = 0; i < s.slots; ++i) {
    if (ok[i] && idx[i] >= 0 && idx[i] < s.pages) pages.push_back(idx[i]);
  }
  std::sort(pages.begin(), pages.end());  // front-to-back reads; duplicates become adjacent
  pages.erase(std::unique(pages.begin(), pages.end()), pages.end());
}

// One (row, KV head): the G query heads of the group over ``pages`` (ascending logical pages).
template <typename KV>
void AttendPages(const Shape& s, const Layout& layout, int64_t row, int64_t kv_head, const float* q, const KV* k,
                 const KV* v, const std::vector<int32_t>& pages, const int32_t* positions, float scale, float* out,
                 std::vector<float>& work) {
  const int64_t groups = s.heads / s.kv_heads, d = s.dim, ps = s.page_size;

  // work: q group [G, D] (scaled) | acc [G, D] | scores [G, S] | m [G] | l [G]
  work.assign(groups * (2 * d + ps + 2), 0.0f);
  float* qs = work.data();
  float* acc = qs + groups * d;
  float* score = acc + groups * d;
  float* m = score + groups * ps;
  float* l = m + groups;
  const float* q_group = q + (row * s.heads + kv_head * groups) * d;
  for (int64_t i = 0; i < groups * d; ++i) qs[i] = q_group[i] * scale;
  for (int64_t g = 0; g < groups; ++g) m[g] = kNegLarge;

  const int64_t position = positions[row];
  const int64_t page_bytes = ps * d * static_cast<int64_t>(sizeof(KV));
  for (size_t i = 0; i < std::min(pages.size(), kPrefetchPages); ++i) {  // no page before these requests them
    const int64_t at = layout.Offset(s, row, kv_head, pages[i]);
    Prefetch(k + at, page_bytes);
    Prefetch(v + at, page_bytes);
  }
  for (size_t i = 0; i < pages.size(); ++i) {
    // Pages are 4 KiB blocks (scattered when selected or behind a page table): the hardware
    // prefetchers only start within a page, so each token row of this page also requests the
    // same row of a page further on (spread over the page's work: a burst of 128 requests
    // would overflow the miss queue). Consecutive pages (dense, per-row layout) gain as much.
    const bool ahead = i + kPrefetchPages < pages.size();
    const int64_t ahead_at = ahead ? layout.Offset(s, row, kv_head, pages[i + kPrefetchPages]) : 0;
    const KV* k_ahead = ahead ? k + ahead_at : nullptr;
    const KV* v_ahead = ahead ? v + ahead_at : nullptr;
    const int32_t page = pages[i];
    const int64_t visible = std::min<int64_t>(ps, position - static_cast<int64_t>(page) * ps + 1);
    if (visible <= 0) continue;  // the whole page is after the query
    const int64_t at = layout.Offset(s, row, kv_head, page);
    const KV* kp = k + at;
    const KV* vp = v + at;
    AttendPageDispatch(kp, vp, k_ahead, v_ahead, visible, groups, ps, d, qs, acc, score, m, l);
  }
  float* out_group = out + (row * s.heads + kv_head * groups) * d;
  for (int64_t g = 0; g < groups; ++g) {
    const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;  // nothing visible: 0, not 0/0
    for (int64_t j = 0; j < d; ++j) out_group[g * d + j] = acc[g * d + j] * inv;
  }
}

// One (row, KV head) over the pages of its slots (idx / ok; nullptr: dense).
template <typename KV>
void AttendGroup(const Shape& s, const Layout& layout, int64_t row, int64_t kv_head, const float* q, const KV* k,
                 const KV* v, const int32_t* idx, const bool* ok, const int32_t* positions, float scale, float* out,
                 std::vector<int32_t>& pages, std::vector<float>& work) {
  SlotPages(s, positions[row], idx, ok, pages);
  AttendPages(s, layout, row, kv_head, q, k, v, pages, positions, scale, out, work);
}

template <typename KV>
void Run(ffi::ThreadPool& pool, const Shape& s, const Layout& layout, const float* q, const KV* k, const KV* v,
         const int32_t* idx, const bool* valid, const int32_t* positions, float scale, float* out) {
  ParallelFor(pool, s.batch * s.kv_heads, [=](int64_t pair) {
    thread_local std::vector<int32_t> pages;
    thread_local std::vector<float> work;
    const bool sparse = idx != nullptr;
    AttendGroup(s, layout, pair / s.kv_heads, pair % s.kv_heads, q, k, v, sparse ? idx + pair * s.slots : nullptr,
                sparse ? valid + pair * s.slots : nullptr, positions, scale, out, pages, work);
  });
}

// Calls run(k, v) with the K / V data typed by their dtype (float, or bf16 as uint16_t bits).
template <typename RunFn>
ffi::Error WithKvDtype(ffi::AnyBuffer& k, ffi::AnyBuffer& v, RunFn run) {
  if (k.element_type() != v.element_type()) {
    return ffi::Error::InvalidArgument("decode_cpu: K and V pages dtypes differ");
  }
  switch (k.element_type()) {
    case ffi::F32:
      run(reinterpret_cast<const float*>(k.untyped_data()), reinterpret_cast<const float*>(v.untyped_data()));
      return ffi::Error::Success();
    case ffi::BF16:
      run(reinterpret_cast<const uint16_t*>(k.untyped_data()), reinterpret_cast<const uint16_t*>(v.untyped_data()));
      return ffi::Error::Success();
    default:
      return ffi::Error::InvalidArgument("decode_cpu: K/V pages must be float32 or bfloat16");
  }
}

// The attention-only handlers' shared body; idx / valid nullptr: dense.
ffi::Error Dispatch(ffi::ThreadPool& pool, const Shape& s, const Layout& layout, ffi::Buffer<ffi::F32>& q,
                    ffi::AnyBuffer& k, ffi::AnyBuffer& v, const int32_t* idx, const bool* valid,
                    ffi::Buffer<ffi::S32>& positions, float scale, ffi::ResultBuffer<ffi::F32>& out) {
  return WithKvDtype(k, v, [&](auto* kd, auto* vd) {
    Run(pool, s, layout, q.typed_data(), kd, vd, idx, valid, positions.typed_data(), scale, out->typed_data());
  });
}

ffi::Error SparseDecodeImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_pages,
                            ffi::AnyBuffer v_pages, ffi::Buffer<ffi::S32> page_idx,
                            ffi::Buffer<ffi::PRED> page_valid, ffi::Buffer<ffi::S32> positions, float scale,
                            ffi::ResultBuffer<ffi::F32> out) {
  auto kd = k_pages.dimensions();
  auto qd = q.dimensions();
  auto nd = page_idx.dimensions();
  if (kd.size() != 5 || qd.size() != 3 || nd.size() != 3) {
    return ffi::Error::InvalidArgument("sparse_decode_cpu: expected q [B,H,D], pages [B,Hkv,P,S,D], idx [B,Hkv,N]");
  }
  Shape s{kd[0], qd[1], kd[1], kd[2], kd[3], kd[4], nd[2]};
  const bool* valid = reinterpret_cast<const bool*>(page_valid.typed_data());
  return Dispatch(pool, s, Layout{}, q, k_pages, v_pages, page_idx.typed_data(), valid, positions, scale, out);
}

ffi::Error DenseDecodeImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_pages,
                           ffi::AnyBuffer v_pages, ffi::Buffer<ffi::S32> positions, float scale,
                           ffi::ResultBuffer<ffi::F32> out) {
  auto kd = k_pages.dimensions();
  auto qd = q.dimensions();
  if (kd.size() != 5 || qd.size() != 3) {
    return ffi::Error::InvalidArgument("dense_decode_cpu: expected q [B,H,D], pages [B,Hkv,P,S,D]");
  }
  Shape s{kd[0], qd[1], kd[1], kd[2], kd[3], kd[4], 0};
  return Dispatch(pool, s, Layout{}, q, k_pages, v_pages, nullptr, nullptr, positions, scale, out);
}

// Every page table entry names a page of the pool (a bad entry would read outside it).
bool TableInPool(const int32_t* table, int64_t entries, int64_t pool_pages) {
  for (int64_t i = 0; i < entries; ++i) {
    if (table[i] < 0 || table[i] >= pool_pages) return false;
  }
  return true;
}

// Pool layout: k_pool / v_pool [NP, Hkv, S, D], page_table [B, W] s32; page_idx [B, Hkv, N]
// logical pages (N = 0 with dense = 1: every logical page up to the query's own).
ffi::Error PagedDecodeImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_pool,
                           ffi::AnyBuffer v_pool, ffi::Buffer<ffi::S32> page_table, ffi::Buffer<ffi::S32> page_idx,
                           ffi::Buffer<ffi::PRED> page_valid, ffi::Buffer<ffi::S32> positions, float scale,
                           int64_t dense, ffi::ResultBuffer<ffi::F32> out) {
  auto kd = k_pool.dimensions();
  auto qd = q.dimensions();
  auto td = page_table.dimensions();
  auto nd = page_idx.dimensions();
  if (kd.size() != 4 || qd.size() != 3 || td.size() != 2 || nd.size() != 3 || td[0] != qd[0]) {
    return ffi::Error::InvalidArgument(
        "paged_decode_cpu: expected q [B,H,D], pool [NP,Hkv,S,D], table [B,W], idx [B,Hkv,N]");
  }
  const int32_t* table = page_table.typed_data();
  if (!TableInPool(table, td[0] * td[1], kd[0])) {
    return ffi::Error::InvalidArgument("paged_decode_cpu: page table entry outside the pool");
  }
  Shape s{qd[0], qd[1], kd[1], td[1], kd[2], kd[3], nd[2]};
  Layout layout{table};
  if (dense) return Dispatch(pool, s, layout, q, k_pool, v_pool, nullptr, nullptr, positions, scale, out);
  const bool* valid = reinterpret_cast<const bool*>(page_valid.typed_data());
  return Dispatch(pool, s, layout, q, k_pool, v_pool, page_idx.typed_data(), valid, positions, scale, out);
}

// A float's bits as an unsigned that orders as XLA's total float order (-0 < +0, NaN above +inf).
inline uint32_t OrderedBits(float x) {
  int32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return static_cast<uint32_t>(bits ^ ((bits >> 31) & 0x7fffffff)) ^ 0x80000000u;
}

// A candidate page's 64-bit key, ordered as lax.top_k orders (score, page): the high half the
// score's OrderedBits, the low half the complement of the page index (lower page first among
// equal scores).
inline uint64_t CandidateKey(float score, int64_t page) {
  return (static_cast<uint64_t>(OrderedBits(score)) << 32) | (0xffffffffu - static_cast<uint32_t>(page));
}

// Appends to ``pages`` the ``take`` (0 < take <= n) best of n candidates ``first_page`` +
// [0, n), in page order, from their scores' OrderedBits ``ordered`` [n]: the pages whose
// CandidateKey is at or above the take-th largest. A radix select, bit by bit from the top, of
// the take-th largest score, with branch-free counts (they vectorise) instead of nth_element's
// data-dependent branches: at ~70 candidates those cost ~1 us per (row, KV head) in mispredicts.
// Among scores equal to the threshold the lower pages come first, as the keys order them.
void AppendTopPages(const uint32_t* ordered, int64_t n, int64_t take, int64_t first_page,
                    std::vector<int32_t>& pages) {
  auto at_least = [&](uint32_t bound) {
    int64_t count = 0;
    for (int64_t i = 0; i < n; ++i) count += ordered[i] >= bound;
    return count;
  };
  uint32_t threshold = 0;  // the largest value with at least `take` scores at or above it
  bool exact = take == n;  // exactly `take` scores at or above the threshold: no ties to split
  for (int bit = 31; bit >= 0 && !exact; --bit) {
    const uint32_t bound = threshold | (1u << bit);
    const int64_t count = at_least(bound);
    if (count >= take) {
      threshold = bound;
      exact = count == take;
    }
  }
  int64_t ties = 0;  // scores equal to the threshold still to take, lowest pages first
  if (!exact) {
    int64_t above = 0;
    for (int64_t i = 0; i < n; ++i) above += ordered[i] > threshold;
    ties = take - above;
  }
  for (int64_t i = 0; i < n; ++i) {
    if (ordered[i] > threshold || (ordered[i] == threshold && (exact || ties-- > 0))) {
      pages.push_back(static_cast<int32_t>(first_page + i));
    }
  }
}

// Appends to ``pages``, in page order, the best min(budget, k_max) candidates of one (row, KV
// head) at position ``position``: pages [reserved_first, position / page_size - reserved_last]
// by CandidateKey (AppendTopPages). ``ordered``: scratch.
void AppendTopCandidates(const float* scores, int64_t num_pages, int64_t position, int64_t budget, int64_t k_max,
                         int64_t page_size, int64_t reserved_first, int64_t reserved_last,
                         std::vector<uint32_t>& ordered, std::vector<int32_t>& pages) {
  const int64_t first = reserved_first, last = std::min(position / page_size - reserved_last, num_pages - 1);
  ordered.clear();
  for (int64_t p = first; p <= last; ++p) ordered.push_back(OrderedBits(scores[p]));
  const int64_t available = static_cast<int64_t>(ordered.size());
  const int64_t take = std::max<int64_t>(0, std::min<int64_t>({budget, k_max, available}));
  if (take > 0) AppendTopPages(ordered.data(), available, take, first, pages);
}

// Block top-k page selection of one (row, KV head), the same pages in the same slot order as
// sparrow_jax.attention.selection.select_pages (lax.top_k: larger score first, lower page
// index first among equal scores): reserved first pages | top-k candidates | last pages.
void SelectGroup(const float* scores, int64_t num_pages, int64_t position, int64_t budget, int64_t k_max,
                 int64_t page_size, int64_t reserved_first, int64_t reserved_last, int32_t* idx, bool* valid,
                 std::vector<uint32_t>& ordered, std::vector<int32_t>& top) {
  const int64_t cur = position / page_size;
  int64_t slot = 0;
  for (int64_t i = 0; i < reserved_first; ++i, ++slot) {
    valid[slot] = i <= cur - reserved_last;
    idx[slot] = valid[slot] ? static_cast<int32_t>(i) : 0;
  }
  top.clear();
  AppendTopCandidates(scores, num_pages, position, budget, k_max, page_size, reserved_first, reserved_last, ordered,
                      top);
  std::sort(top.begin(), top.end(), [scores](int32_t a, int32_t b) {  // slot order = top-k order
    return CandidateKey(scores[a], a) > CandidateKey(scores[b], b);
  });
  const int64_t take = static_cast<int64_t>(top.size());
  for (int64_t j = 0; j < k_max; ++j, ++slot) {
    valid[slot] = j < take;
    idx[slot] = valid[slot] ? top[j] : 0;
  }
  for (int64_t i = 0; i < reserved_last; ++i, ++slot) {
    valid[slot] = cur - i >= 0;
    idx[slot] = valid[slot] ? static_cast<int32_t>(cur - i) : 0;
  }
}

// The pages SelectGroup's slots select, as AttendPages reads them (ascending): the reserved
// first pages, the best candidates in page order, the reserved last pages. The same set without
// the slots' score order, so the decode step neither sorts the top-k by score nor sorts its
// pages back into page order.
void SelectedPages(const float* scores, int64_t num_pages, int64_t position, int64_t budget, int64_t k_max,
                   int64_t page_size, int64_t reserved_first, int64_t reserved_last, std::vector<uint32_t>& ordered,
                   std::vector<int32_t>& pages) {
  const int64_t cur = position / page_size;
  pages.clear();
  for (int64_t i = 0; i < std::min(reserved_first, num_pages); ++i) {
    if (i <= cur - reserved_last) pages.push_back(static_cast<int32_t>(i));
  }
  AppendTopCandidates(scores, num_pages, position, budget, k_max, page_size, reserved_first, reserved_last, ordered,
                      pages);
  for (int64_t i = reserved_last - 1; i >= 0; --i) {
    if (cur - i >= 0 && cur - i < num_pages) pages.push_back(static_cast<int32_t>(cur - i));
  }
}

// ``page_order`` != 0: each (row, KV head)'s slots hold SelectedPages' set, ascending, valid slots
// first: the same pages without the top-k's score order, whose sort is most of a selection's
// time, for a caller that reads the slots as a set (the teacher-forced scorer's attention).
ffi::Error SelectPagesImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> scores, ffi::Buffer<ffi::S32> positions,
                           ffi::Buffer<ffi::S32> budget, int64_t k_max, int64_t page_size, int64_t reserved_first,
                           int64_t reserved_last, int64_t page_order, ffi::ResultBuffer<ffi::S32> page_idx,
                           ffi::ResultBuffer<ffi::PRED> page_valid) {
  auto sd = scores.dimensions();
  if (sd.size() != 3) return ffi::Error::InvalidArgument("select_pages_cpu: scores must be [B, Hkv, P]");
  const int64_t kv_heads = sd[1], num_pages = sd[2];
  const int64_t slots = reserved_first + k_max + reserved_last;
  const float* sc = scores.typed_data();
  const int32_t* pos = positions.typed_data();
  const int32_t* bud = budget.typed_data();
  int32_t* idx = page_idx->typed_data();
  bool* valid = reinterpret_cast<bool*>(page_valid->typed_data());
  ParallelFor(pool, sd[0] * kv_heads, [=](int64_t pair) {
    thread_local std::vector<uint32_t> ordered;
    thread_local std::vector<int32_t> top;
    const int64_t row = pair / kv_heads;
    if (page_order == 0) {
      SelectGroup(sc + pair * num_pages, num_pages, pos[row], bud[row], k_max, page_size, reserved_first,
                  reserved_last, idx + pair * slots, valid + pair * slots, ordered, top);
      return;
    }
    SelectedPages(sc + pair * num_pages, num_pages, pos[row], bud[row], k_max, page_size, reserved_first,
                  reserved_last, ordered, top);
    const int64_t count = static_cast<int64_t>(top.size());
    for (int64_t slot = 0; slot < slots; ++slot) {
      valid[pair * slots + slot] = slot < count;
      idx[pair * slots + slot] = slot < count ? top[slot] : 0;
    }
  });
  return ffi::Error::Success();
}

// Score of every candidate page of one (row, KV head) from its metadata rows (D floats each):
// centroid: qg . c; quest: sum_d max(qg_d * kmin_d, qg_d * kmax_d). ``meta_at(page)`` is the
// element offset of a page's metadata row; pages further on are prefetched (rows behind a
// page table are scattered).
template <typename MetaAt>
void ScorePages(const float* qg, const float* meta_a, const float* meta_b, bool quest, int64_t first, int64_t last,
                int64_t dim, MetaAt meta_at, float* scores) {
  constexpr int64_t kAhead = 8;
  for (int64_t p = first; p <= last; ++p) {
    if (p + kAhead <= last) {
      const int64_t ahead = meta_at(p + kAhead);
      Prefetch(meta_a + ahead, dim * 4);
      if (quest) Prefetch(meta_b + ahead, dim * 4);
    }
    const float* a = meta_a + meta_at(p);
    float score = 0.0f;
    if (quest) {
      const float* b = meta_b + meta_at(p);
#pragma omp simd reduction(+ : score)
      for (int64_t j = 0; j < dim; ++j) score += std::max(qg[j] * a[j], qg[j] * b[j]);
    } else {
#pragma omp simd reduction(+ : score)
      for (int64_t j = 0; j < dim; ++j) score += qg[j] * a[j];
    }
    scores[p] = score;
  }
}

// What a decode step's page selection reads: qg [B, Hkv, D] group-mean queries (ScoreSelect;
// the sparse step takes its own), metadata rows (meta_a: centroid or Quest's kmin, meta_b:
// kmax), positions and budget [B], the settings.
struct Selection {
  const float* qg;
  const float* meta_a;
  const float* meta_b;
  bool quest;
  const int32_t* positions;
  const int32_t* budget;
  int64_t kv_heads, dim, num_pages, k_max, page_size, reserved_first, reserved_last;
};

// Page scores [num_pages] of one (row, KV head) from its group-mean query ``qg`` [D] (pages
// outside the candidates 0). ``meta_at(page)``: the element offset of a logical page's metadata row.
template <typename MetaAt>
const float* ScorePair(const Selection& sel, int64_t position, const float* qg, MetaAt meta_at) {
  thread_local std::vector<float> scores;
  const int64_t last = std::min(position / sel.page_size - sel.reserved_last, sel.num_pages - 1);
  scores.assign(sel.num_pages, 0.0f);
  ScorePages(qg, sel.meta_a, sel.meta_b, sel.quest, sel.reserved_first, last, sel.dim, meta_at, scores.data());
  return scores.data();
}

// Scores and selects the pages of one (row, KV head) into its slots idx / valid.
template <typename MetaAt>
void SelectPair(const Selection& sel, int64_t pair, const float* qg, MetaAt meta_at, int32_t* idx, bool* valid) {
  thread_local std::vector<uint32_t> ordered;
  thread_local std::vector<int32_t> top;
  const int64_t row = pair / sel.kv_heads;
  const int64_t position = sel.positions[row];
  SelectGroup(ScorePair(sel, position, qg, meta_at), sel.num_pages, position, sel.budget[row], sel.k_max,
              sel.page_size, sel.reserved_first, sel.reserved_last, idx, valid, ordered, top);
}

// Offset of logical page p's metadata row for (row, KV head) of ``pair``, through a page table
// [B, W] into pool metadata [NP, Hkv, D].
struct PooledMeta {
  const int32_t* table;
  int64_t pair, width, kv_heads, dim;
  int64_t operator()(int64_t p) const {
    const int64_t row = pair / kv_heads, head = pair % kv_heads;
    return (static_cast<int64_t>(table[row * width + p]) * kv_heads + head) * dim;
  }
};

// qg [B, Hkv, D] group-mean queries; metadata per row [B, Hkv, P, D] (table empty) or a pool
// [NP, Hkv, D] read through page_table [B, W]; meta_b: Quest's kmax (kmin in meta_a), ignored
// for centroid scores. Output: the slots of SelectGroup.
ffi::Error ScoreSelectImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> qg, ffi::Buffer<ffi::F32> meta_a,
                           ffi::Buffer<ffi::F32> meta_b, ffi::Buffer<ffi::S32> page_table,
                           ffi::Buffer<ffi::S32> positions, ffi::Buffer<ffi::S32> budget, int64_t k_max,
                           int64_t page_size, int64_t reserved_first, int64_t reserved_last, int64_t quest,
                           ffi::ResultBuffer<ffi::S32> page_idx, ffi::ResultBuffer<ffi::PRED> page_valid) {
  auto qd = qg.dimensions();
  auto md = meta_a.dimensions();
  auto td = page_table.dimensions();
  const bool paged = td.size() == 2 && td[1] > 0;
  if (qd.size() != 3 || td.size() != 2 || md.size() != (paged ? 3u : 4u) || md[md.size() - 1] != qd[2] ||
      md[1] != qd[1]) {
    return ffi::Error::InvalidArgument(
        "score_select_cpu: expected qg [B,Hkv,D] with metadata [B,Hkv,P,D] (table [B,0]) or [NP,Hkv,D] (table [B,W])");
  }
  const int64_t batch = qd[0], kv_heads = qd[1], dim = qd[2];
  const int64_t num_pages = paged ? td[1] : md[2];
  const int32_t* table = page_table.typed_data();
  if (paged && !TableInPool(table, td[0] * td[1], md[0])) {
    return ffi::Error::InvalidArgument("score_select_cpu: page table entry outside the pool");
  }
  const Selection sel{qg.typed_data(), meta_a.typed_data(), meta_b.typed_data(), quest != 0, positions.typed_data(),
                      budget.typed_data(), kv_heads, dim, num_pages, k_max, page_size, reserved_first, reserved_last};
  const int64_t slots = reserved_first + k_max + reserved_last;
  int32_t* idx = page_idx->typed_data();
  bool* valid = reinterpret_cast<bool*>(page_valid->typed_data());
  ParallelFor(pool, batch * kv_heads, [=](int64_t pair) {
    if (paged) {
      SelectPair(sel, pair, sel.qg + pair * dim, PooledMeta{table, pair, num_pages, kv_heads, dim}, idx + pair * slots,
                 valid + pair * slots);
    } else {
      SelectPair(sel, pair, sel.qg + pair * dim, [&](int64_t p) { return (pair * num_pages + p) * dim; },
                 idx + pair * slots, valid + pair * slots);
    }
  });
  return ffi::Error::Success();
}

// A page's metadata row [D] after the step's key ``k`` [D] lands in in-page slot ``slot``:
// Quest's bounds (a = kmin, b = kmax) or the centroid's running mean (a), bit for bit as XLA:CPU
// evaluates sparrow_jax.attention.cache.running_page_metadata (c + (k - c) / n as one fused
// multiply-add by the reciprocal of n); slot 0 starts the page afresh.
void UpdatePageMeta(float* a, float* b, const float* k, int64_t slot, bool quest, int64_t dim) {
  if (slot == 0) {
    std::memcpy(a, k, dim * sizeof(float));
    if (quest) std::memcpy(b, k, dim * sizeof(float));
  } else if (quest) {
    for (int64_t j = 0; j < dim; ++j) {
      a[j] = std::min(a[j], k[j]);
      b[j] = std::max(b[j], k[j]);
    }
  } else {
    const float inv_n = 1.0f / static_cast<float>(slot + 1);
    for (int64_t j = 0; j < dim; ++j) a[j] = std::fma(k[j] - a[j], inv_n, a[j]);
  }
}

// Mean of the G query heads of KV head ``kv_head`` [D] into ``qg``: summed in head order, times
// 1 / G, as XLA:CPU evaluates jnp.mean over the group axis (bit for bit up to G = 4; larger
// groups XLA may sum in another order).
void GroupMeanQuery(const float* q, const Shape& s, int64_t row, int64_t kv_head, float* qg) {
  const int64_t groups = s.heads / s.kv_heads;
  const float inv_groups = 1.0f / static_cast<float>(groups);
  const float* first = q + (row * s.heads + kv_head * groups) * s.dim;
  for (int64_t j = 0; j < s.dim; ++j) {
    float sum = first[j];
    for (int64_t g = 1; g < groups; ++g) sum += first[g * s.dim + j];
    qg[j] = sum * inv_groups;
  }
}

// One layer's sparse decode step on a page pool in one pass per (row, KV head): append the
// step's key to its page's metadata (``k_new`` non-null), score the pages from the pool's
// metadata with the group-mean query, select, attend. Bit for bit the reference's metadata
// update, group mean, ScoreSelect then PagedDecode, with one thread-pool round per layer-step
// instead of two and none of XLA's small gather / reduce / scatter ops around it: at the
// quickstart's shape each of those costs about as much as the selection itself. A row writes
// only the page it appends to (its own: full prompt pages are shared, the last is copied), so
// the pairs update the pool's metadata in place without a race.
template <typename KV>
void RunPagedSparseStep(ffi::ThreadPool& pool, const Shape& s, const Selection& sel, const int32_t* table,
                        const float* q_attn, const float* q_select, const float* k_new, float* meta_a, float* meta_b,
                        const KV* k, const KV* v, float scale, float* out) {
  const Layout layout{table};
  ParallelFor(pool, s.batch * s.kv_heads, [=](int64_t pair) {
    thread_local std::vector<uint32_t> ordered;
    thread_local std::vector<int32_t> pages;
    thread_local std::vector<float> work;
    thread_local std::vector<float> qg;
    const int64_t row = pair / s.kv_heads, head = pair % s.kv_heads;
    const PooledMeta meta_at{table, pair, s.pages, s.kv_heads, s.dim};
    const int64_t position = sel.positions[row];
    if (k_new != nullptr && position >= 0 && position / s.page_size < s.pages) {  // out of range: dropped, as XLA's scatter
      const int64_t at = meta_at(position / s.page_size);
      UpdatePageMeta(meta_a + at, sel.quest ? meta_b + at : nullptr, k_new + pair * s.dim, position % s.page_size,
                     sel.quest, s.dim);
    }
    qg.resize(s.dim);
    GroupMeanQuery(q_select, s, row, head, qg.data());
    SelectedPages(ScorePair(sel, position, qg.data(), meta_at), s.pages, position, sel.budget[row], sel.k_max,
                  s.page_size, sel.reserved_first, sel.reserved_last, ordered, pages);
    AttendPages(s, layout, row, head, q_attn, k, v, pages, sel.positions, scale, out, work);
  });
}

// q_attn [B, H, D] (rounded to the cache dtype) and q_select [B, H, D] (float32: its group means
// score the pages), k_pool / v_pool [NP, Hkv, S, D], page_table [B, W], k_new [B, Hkv, D] (the
// step's keys, appended to the metadata) or [0, Hkv, D] (metadata as given), metadata
// meta_a [NP, Hkv, D] (centroid or kmin) and meta_b (kmax; any [N, Hkv, D] for centroid),
// positions / budget [B]  ->  out [B, H, D] and the metadata (aliased to meta_a / meta_b).
ffi::Error PagedSparseStepImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q_attn, ffi::Buffer<ffi::F32> q_select,
                               ffi::AnyBuffer k_pool, ffi::AnyBuffer v_pool, ffi::Buffer<ffi::S32> page_table,
                               ffi::Buffer<ffi::F32> k_new, ffi::Buffer<ffi::F32> meta_a,
                               ffi::Buffer<ffi::F32> meta_b, ffi::Buffer<ffi::S32> positions,
                               ffi::Buffer<ffi::S32> budget, float scale, int64_t k_max, int64_t reserved_first,
                               int64_t reserved_last, int64_t quest, ffi::ResultBuffer<ffi::F32> out,
                               ffi::ResultBuffer<ffi::F32> meta_a_out, ffi::ResultBuffer<ffi::F32> meta_b_out) {
  auto qd = q_attn.dimensions();
  auto kd = k_pool.dimensions();
  auto td = page_table.dimensions();
  auto nd = k_new.dimensions();
  auto md = meta_a.dimensions();
  auto bd = meta_b.dimensions();
  const bool append = nd.size() == 3 && nd[0] > 0;
  auto same = [](auto x, auto y) { return x.size() == y.size() && std::equal(x.begin(), x.end(), y.begin()); };
  if (qd.size() != 3 || !same(q_select.dimensions(), qd) || kd.size() != 4 || td.size() != 2 || md.size() != 3 ||
      bd.size() != 3 || nd.size() != 3 || td[0] != qd[0] || md[0] != kd[0] || md[1] != kd[1] || md[2] != qd[2] ||
      kd[3] != qd[2] || k_max > td[1] || (quest && !same(bd, md)) ||
      (append && (nd[0] != qd[0] || nd[1] != kd[1] || nd[2] != qd[2]))) {
    return ffi::Error::InvalidArgument(
        "paged_sparse_step_cpu: expected q_attn / q_select [B,H,D], pool [NP,Hkv,S,D], table [B,W], "
        "k_new [B,Hkv,D] or [0,Hkv,D], metadata [NP,Hkv,D] and k_max <= W");
  }
  const int32_t* table = page_table.typed_data();
  if (!TableInPool(table, td[0] * td[1], kd[0])) {
    return ffi::Error::InvalidArgument("paged_sparse_step_cpu: page table entry outside the pool");
  }
  // The results alias the metadata inputs; should XLA have given them their own buffers, start from a copy.
  float* a = meta_a_out->typed_data();
  float* b = meta_b_out->typed_data();
  if (a != meta_a.typed_data()) std::memcpy(a, meta_a.typed_data(), meta_a.size_bytes());
  if (b != meta_b.typed_data()) std::memcpy(b, meta_b.typed_data(), meta_b.size_bytes());
  const Shape s{qd[0], qd[1], kd[1], td[1], kd[2], kd[3], reserved_first + k_max + reserved_last};
  const Selection sel{nullptr, a, b, quest != 0, positions.typed_data(), budget.typed_data(), kd[1], kd[3], td[1],
                      k_max, kd[2], reserved_first, reserved_last};
  const float* keys = append ? k_new.typed_data() : nullptr;
  return WithKvDtype(k_pool, v_pool, [&](auto* k, auto* v) {
    RunPagedSparseStep(pool, s, sel, table, q_attn.typed_data(), q_select.typed_data(), keys, a, b, k, v, scale,
                       out->typed_data());
  });
}

}  // namespace

// The page selection's part of a binding, after its inputs: positions and budget, the selection's
// attributes, and (after any further attributes, ``Ret``) its outputs page_idx and page_valid.
template <typename Binding>
static auto WithSelectionInputs(Binding binding) {
  return std::move(binding)
      .template Arg<ffi::Buffer<ffi::S32>>()            // positions
      .template Arg<ffi::Buffer<ffi::S32>>()            // budget
      .template Attr<int64_t>("k_max")
      .template Attr<int64_t>("page_size")
      .template Attr<int64_t>("reserved_first")
      .template Attr<int64_t>("reserved_last");
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(SparrowScoreSelectCpu, ScoreSelectImpl,
                              WithSelectionInputs(ffi::Ffi::Bind()
                                                      .Ctx<ffi::ThreadPool>()
                                                      .Arg<ffi::Buffer<ffi::F32>>()   // qg
                                                      .Arg<ffi::Buffer<ffi::F32>>()   // meta_a: centroid or kmin
                                                      .Arg<ffi::Buffer<ffi::F32>>()   // meta_b: kmax (quest)
                                                      .Arg<ffi::Buffer<ffi::S32>>())  // page_table ([B, 0]: per-row)
                                  .Attr<int64_t>("quest")
                                  .Ret<ffi::Buffer<ffi::S32>>()    // page_idx
                                  .Ret<ffi::Buffer<ffi::PRED>>()); // page_valid

XLA_FFI_DEFINE_HANDLER_SYMBOL(SparrowPagedSparseStepCpu, PagedSparseStepImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()    // q_attn
                                  .Arg<ffi::Buffer<ffi::F32>>()    // q_select
                                  .Arg<ffi::AnyBuffer>()           // k_pool
                                  .Arg<ffi::AnyBuffer>()           // v_pool
                                  .Arg<ffi::Buffer<ffi::S32>>()    // page_table
                                  .Arg<ffi::Buffer<ffi::F32>>()    // k_new
                                  .Arg<ffi::Buffer<ffi::F32>>()    // meta_a: centroid or kmin
                                  .Arg<ffi::Buffer<ffi::F32>>()    // meta_b: kmax (quest)
                                  .Arg<ffi::Buffer<ffi::S32>>()    // positions
                                  .Arg<ffi::Buffer<ffi::S32>>()    // budget
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("k_max")
                                  .Attr<int64_t>("reserved_first")
                                  .Attr<int64_t>("reserved_last")
                                  .Attr<int64_t>("quest")
                                  .Ret<ffi::Buffer<ffi::F32>>()    // out
                                  .Ret<ffi::Buffer<ffi::F32>>()    // meta_a (aliased)
                                  .Ret<ffi::Buffer<ffi::F32>>());  // meta_b (aliased)

// The binding every attention handler below starts with: the thread pool, then q [.., D] f32 and
// the k and v pages (f32 or bf16).
static auto BindQKV() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(SparrowSparseDecodeCpu, SparseDecodeImpl,
                              BindQKV()  // q, k_pages, v_pages
                                  .Arg<ffi::Buffer<ffi::S32>>()    // page_idx
                                  .Arg<ffi::Buffer<ffi::PRED>>()   // page_valid
                                  .Arg<ffi::Buffer<ffi::S32>>()    // positions
                                  .Attr<float>("scale")
                                  .Ret<ffi::Buffer<ffi::F32>>());  // out

XLA_FFI_DEFINE_HANDLER_SYMBOL(SparrowDenseDecodeCpu, DenseDecodeImpl,
                              BindQKV()  // q, k_pages, v_pages
                                  .Arg<ffi::Buffer<ffi::S32>>()    // positions
                                  .Attr<float>("scale")
                                  .Ret<ffi::Buffer<ffi::F32>>());  // out

XLA_FFI_DEFINE_HANDLER_SYMBOL(SparrowPagedDecodeCpu, PagedDecodeImpl,
                              BindQKV()  // q, k_pool, v_pool
                                  .Arg<ffi::Buffer<ffi::S32>>()    // page_table
                                  .Arg<ffi::Buffer<ffi::S32>>()    // page_idx
                                  .Arg<ffi::Buffer<ffi::PRED>>()   // page_valid
                                  .Arg<ffi::Buffer<ffi::S32>>()    // positions
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("dense")
                                  .Ret<ffi::Buffer<ffi::F32>>());  // out

XLA_FFI_DEFINE_HANDLER_SYMBOL(SparrowSelectPagesCpu, SelectPagesImpl,
                              WithSelectionInputs(ffi::Ffi::Bind()
                                                      .Ctx<ffi::ThreadPool>()
                                                      .Arg<ffi::Buffer<ffi::F32>>())  // scores
                                  .Attr<int64_t>("page_order")
                                  .Ret<ffi::Buffer<ffi::S32>>()    // page_idx
                                  .Ret<ffi::Buffer<ffi::PRED>>()); // page_valid
