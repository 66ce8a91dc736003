// Causal whole-sequence attention for XLA:CPU (the train step and the dense scorer), forward and
// backward, as XLA FFI custom calls: FlashAttention-2 in tiles of kBlock tokens.
//
// SparrowFlashForwardCpu: q [B, Hkv, T, G, D], k / v [B, Hkv, T, D] f32 (T a multiple of kBlock,
//   D a multiple of 8), page_idx / page_valid [B, Hkv, T, N] s32 / pred, dense_before [B] s32,
//   attributes scale, page_size (divides kBlock)  ->  out [B, Hkv, T, G, D], lse [B, Hkv, T, G].
//   Query t attends keys 0..t; with N > 0 only keys of its valid selected pages (every page
//   when t < dense_before[b]: the prompt the sampler prefilled densely). lse is the
//   log-sum-exp of its scaled scores (kEmptyLse and out 0 where it reads no key). Attribute
//   queries_from (a multiple of kBlock): queries below it are not computed (out and lse 0), for a
//   caller that has them already or does not read them (a prompt prefix).
// SparrowFlashBackwardCpu: q, k, v, the page sets, out, lse, dout  ->  dq, dk, dv (queries below
//   queries_from contribute nothing: their outputs were the constant 0).
//
// Why a custom call: XLA:CPU runs the blockwise attention's small tile products (64 x 64 x 32)
// at 12-43 GFLOP/s on a 181 GFLOP/s machine, and writes every tile's scores and probabilities
// out between its fusions. Here one thread owns a (row, KV head) pair (and, forward, one query
// block): its G query heads are stacked as rows of one tile, every tile product is a
// register-blocked loop over data in L1 / L2, the softmax runs on the tile in place, and
// causal tiles past the diagonal are never visited.
//
// Paged: a query block visits only the key tiles holding a page one of its queries reads, and
// each query keeps to its own pages through a per-tile mask.
//
// Masking uses a large finite negative, not -inf: the build uses -ffast-math, which assumes
// no infinities.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "parallel_for.h"

namespace ffi = xla::ffi;

namespace {

using sparrow::ParallelFor;

constexpr int64_t kBlock = 64;  // query and key tile, tokens
constexpr float kMasked = -1e30f;
constexpr float kEmptyLse = 1e30f;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;  // a query that reads no key: exp(s - lse) = 0 in the backward

typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));  // unaligned loads / stores
typedef int32_t i8 __attribute__((vector_size(32)));

inline v8 Load(const float* p) { return *reinterpret_cast<const v8u*>(p); }
inline void Store(float* p, v8 x) { *reinterpret_cast<v8u*>(p) = x; }
inline v8 Splat(float x) { return v8{x, x, x, x, x, x, x, x}; }

// 2^x for 8 floats x <= ~0 (the softmax's scores minus their max or log-sum-exp, in log2 units):
// 2^round(x) from the exponent bits times a degree-6 Taylor polynomial of 2^f, |f| <= 1/2
// (relative error ~1e-7). x below -126 gives exactly 0 (masked scores). Written out because
// -ffast-math's vectorised expf needs the loop in one shape; base 2 saves the range reduction's
// multiply (log2 e is folded into the query's scale).
inline v8 Exp2(v8 x) {
  const v8 lo = Splat(-126.0f);
  const i8 zero = x < lo;  // all ones where the result is 0
  x = x < lo ? lo : x;
  // n = round(x), taken as floor(x + 0.5) from a positive shifted value (exact integer arithmetic,
  // which -ffast-math cannot reassociate away)
  const i8 n = __builtin_convertvector(x + Splat(128.5f), i8) - 128;
  const v8 f = x - __builtin_convertvector(n, v8);
  v8 p = Splat(1.5403530393381609e-4f);  // ln2^k / k!, k = 6 .. 0
  p = p * f + Splat(1.3333558146428443e-3f);
  p = p * f + Splat(9.6181291076284772e-3f);
  p = p * f + Splat(5.5504108664821580e-2f);
  p = p * f + Splat(2.4022650695910071e-1f);
  p = p * f + Splat(6.9314718055994531e-1f);
  p = p * f + Splat(1.0f);
  const i8 bits = (n + 127) << 23;
  v8 two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  const v8 out = p * two_n;
  i8 out_bits;
  std::memcpy(&out_bits, &out, sizeof(out_bits));
  out_bits &= ~zero;
  v8 result;
  std::memcpy(&result, &out_bits, sizeof(result));
  return result;
}

inline float HorizontalMax(v8 x) {
  float m = x[0];
  for (int i = 1; i < 8; ++i) m = std::max(m, x[i]);
  return m;
}

inline float HorizontalSum(v8 x) {
  return ((x[0] + x[1]) + (x[2] + x[3])) + ((x[4] + x[5]) + (x[6] + x[7]));
}

// The one tile product every step is made of:
//   C[i, 0:W] (+)= sum_j X(i, j) * Y[j, 0:W]   for i < rows, j < inner,
// X(i, j) = x[i * xi + j * xj] (any strides: a matrix or its transpose), Y row-major with row
// stride ldy, C with row stride ldc, W a multiple of 8. kRows rows x kVecs vectors of C stay in
// registers across the inner loop (at most 6 x 2 = 12 accumulators: AVX2's 16 registers hold
// them, the two Y vectors and the broadcasts).
template <int kRows, int kVecs, bool kAccumulate>
inline void Panel(int64_t inner, const float* x, int64_t xi, int64_t xj, const float* y, int64_t ldy, float* c,
                  int64_t ldc) {
  v8 acc[kRows][kVecs];
  for (int r = 0; r < kRows; ++r)
    for (int v = 0; v < kVecs; ++v) acc[r][v] = kAccumulate ? Load(c + r * ldc + 8 * v) : Splat(0.0f);
  for (int64_t j = 0; j < inner; ++j) {
    v8 yv[kVecs];
    for (int v = 0; v < kVecs; ++v) yv[v] = Load(y + j * ldy + 8 * v);
    for (int r = 0; r < kRows; ++r) {
      const v8 xr = Splat(x[r * xi + j * xj]);
      for (int v = 0; v < kVecs; ++v) acc[r][v] += xr * yv[v];
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int v = 0; v < kVecs; ++v) Store(c + r * ldc + 8 * v, acc[r][v]);
}

template <int kRows, bool kAccumulate>
inline void RowPanels(int64_t i, int64_t width, int64_t inner, const float* x, int64_t xi, int64_t xj,
                      const float* y, int64_t ldy, float* c, int64_t ldc) {
  int64_t w = 0;
  for (; w + 16 <= width; w += 16) Panel<kRows, 2, kAccumulate>(inner, x + i * xi, xi, xj, y + w, ldy, c + i * ldc + w, ldc);
  if (w < width) Panel<kRows, 1, kAccumulate>(inner, x + i * xi, xi, xj, y + w, ldy, c + i * ldc + w, ldc);
}

// Rows in panels of 6 (12 accumulators: enough independent FMA chains to cover the FMA
// latency), then 4, then 1. A remainder of 2 takes one panel of 6 back for two of 4: a 1-row
// panel's 2 chains wait on the FMA latency, ~4x the time per row (128 query rows of G = 2 heads
// would otherwise end in two of them).
template <bool kAccumulate>
void Product(int64_t rows, int64_t width, int64_t inner, const float* x, int64_t xi, int64_t xj, const float* y,
             int64_t ldy, float* c, int64_t ldc) {
  const int64_t sixes = rows % 6 == 2 && rows >= 8 ? rows / 6 - 1 : rows / 6;
  int64_t i = 0;
  for (; i < 6 * sixes; i += 6) RowPanels<6, kAccumulate>(i, width, inner, x, xi, xj, y, ldy, c, ldc);
  for (; i + 4 <= rows; i += 4) RowPanels<4, kAccumulate>(i, width, inner, x, xi, xj, y, ldy, c, ldc);
  for (; i < rows; ++i) RowPanels<1, kAccumulate>(i, width, inner, x, xi, xj, y, ldy, c, ldc);
}

struct Dims {
  int64_t batch, kv_heads, tokens, groups, dim;
  int64_t Blocks() const { return tokens / kBlock; }
  int64_t Rows() const { return kBlock * groups; }  // query rows of a block: tokens x heads
};

// Per-query page sets (the sparse teacher-forced scorer), or none (dense causal attention).
struct Pages {
  const int32_t* idx = nullptr;           // [B, Hkv, T, N] logical pages; out-of-range entries are ignored
  const bool* valid = nullptr;            // [B, Hkv, T, N]
  const int32_t* dense_before = nullptr;  // [B]: queries below it read every page
  int64_t slots = 0, page_size = 1;
  bool Paged() const { return idx != nullptr; }
};

// dst [D, kBlock] = src [kBlock, D] transposed (a K or V tile as the Y operand of scores).
void TransposeTile(const float* src, int64_t dim, float* dst) {
  for (int64_t t = 0; t < kBlock; ++t)
    for (int64_t d = 0; d < dim; ++d) dst[d * kBlock + t] = src[t * dim + d];
}

// dst [n] = src * scale (n a multiple of 8; the query block with the softmax scale folded in).
void ScaledCopy(const float* src, int64_t n, float scale, float* dst) {
  for (int64_t x = 0; x < n; x += 8) Store(dst + x, Load(src + x) * Splat(scale));
}

// dst [n] += src (n a multiple of 8).
void AddTo(const float* src, int64_t n, float* dst) {
  for (int64_t x = 0; x < n; x += 8) Store(dst + x, Load(dst + x) + Load(src + x));
}

// allowed[(t - begin) * pages + p]: query t of (row, KV head) ``pair`` reads page p, for t in
// [begin, begin + count); a query below dense_before reads every page.
void AllowedPages(const Dims& s, const Pages& pg, int64_t pair, int64_t begin, int64_t count, uint8_t* allowed) {
  const int64_t pages = s.tokens / pg.page_size;
  std::fill(allowed, allowed + count * pages, uint8_t{0});
  const int64_t dense_before = pg.dense_before[pair / s.kv_heads];
  for (int64_t t = begin; t < begin + count; ++t) {
    uint8_t* row = allowed + (t - begin) * pages;
    if (t < dense_before) {
      std::fill(row, row + pages, uint8_t{1});
      continue;
    }
    const int32_t* idx = pg.idx + (pair * s.tokens + t) * pg.slots;
    const bool* ok = pg.valid + (pair * s.tokens + t) * pg.slots;
    for (int64_t n = 0; n < pg.slots; ++n)
      if (ok[n] && idx[n] >= 0 && idx[n] < pages) row[idx[n]] = 1;
  }
}

// Whether any query of a block (its ``allowed`` rows) reads a page of key tile j.
bool TileUsed(const uint8_t* allowed, int64_t pages, int64_t page_size, int64_t j) {
  const int64_t per_tile = kBlock / page_size;
  for (int64_t t = 0; t < kBlock; ++t)
    for (int64_t p = j * per_tile; p < (j + 1) * per_tile; ++p)
      if (allowed[t * pages + p]) return true;
  return false;
}

// Masks the scores [kBlock * G, kBlock] of query block i against key tile j: keys after the
// query's token (the diagonal tile) and, with ``allowed`` (the block's rows; nullptr: dense),
// keys of pages the query does not read. A masked score becomes kMasked: adding kMasked to a
// score of any size below ~1e22 gives exactly kMasked.
void MaskTile(float* s, int64_t groups, int64_t i, int64_t j, const uint8_t* allowed, int64_t pages,
              int64_t page_size) {
  if (allowed == nullptr && i != j) return;
  const int64_t per_tile = kBlock / page_size;
  for (int64_t t = 0; t < kBlock; ++t) {
    alignas(32) float bias[kBlock];
    bool any = false;
    for (int64_t pp = 0; pp < per_tile; ++pp) {
      const bool read = allowed == nullptr || allowed[t * pages + j * per_tile + pp];
      any |= !read;
      std::fill(bias + pp * page_size, bias + (pp + 1) * page_size, read ? 0.0f : kMasked);
    }
    if (i == j) {
      std::fill(bias + t + 1, bias + kBlock, kMasked);
      any |= t + 1 < kBlock;
    }
    if (!any) continue;
    for (int64_t g = 0; g < groups; ++g) {
      float* row = s + (t * groups + g) * kBlock;
      for (int64_t c = 0; c < kBlock; c += 8) Store(row + c, Load(row + c) + Load(bias + c));
    }
  }
}

// One query block of one (row, KV head): online softmax over the key tiles it reads (tiles
// 0..block; paged: only those holding a page one of its queries reads). A query that reads no
// key gives out 0 and lse kEmptyLse.
void ForwardBlock(const Dims& s, const Pages& pg, int64_t pair, const float* q, const float* k, const float* v,
                  float scale, int64_t block, float* out, float* lse, std::vector<float>& work,
                  std::vector<uint8_t>& allowed_buf) {
  const int64_t rows = s.Rows(), dim = s.dim, pages = s.tokens / pg.page_size;
  work.resize(rows * kBlock + dim * kBlock + rows * dim + rows * 2);
  float* scores = work.data();
  float* kt = scores + rows * kBlock;
  float* qs = kt + dim * kBlock;
  float* m = qs + rows * dim;
  float* l = m + rows;
  const uint8_t* allowed = nullptr;
  if (pg.Paged()) {
    allowed_buf.resize(kBlock * pages);
    AllowedPages(s, pg, pair, block * kBlock, kBlock, allowed_buf.data());
    allowed = allowed_buf.data();
  }
  ScaledCopy(q, rows * dim, scale * kLog2e, qs);  // scores in log2 units: exp(s) = 2^(s log2 e)
  std::fill(m, m + rows, kMasked);
  std::fill(l, l + rows, 0.0f);
  float* acc = out;  // the block's output rows accumulate in place
  std::fill(acc, acc + rows * dim, 0.0f);
  for (int64_t j = 0; j <= block; ++j) {
    if (allowed != nullptr && !TileUsed(allowed, pages, pg.page_size, j)) continue;
    TransposeTile(k + j * kBlock * dim, dim, kt);
    Product<false>(rows, kBlock, dim, qs, dim, 1, kt, kBlock, scores, kBlock);
    MaskTile(scores, s.groups, block, j, allowed, pages, pg.page_size);
    for (int64_t r = 0; r < rows; ++r) {
      float* row = scores + r * kBlock;
      v8 mx = Splat(kMasked);
      for (int64_t c = 0; c < kBlock; c += 8) {
        const v8 x = Load(row + c);
        mx = x > mx ? x : mx;
      }
      const float m_new = std::max(m[r], HorizontalMax(mx));
      if (m_new <= kMasked) {  // no key read yet: this tile adds nothing
        std::fill(row, row + kBlock, 0.0f);
        continue;
      }
      v8 sum = Splat(0.0f);
      for (int64_t c = 0; c < kBlock; c += 8) {
        const v8 p = Exp2(Load(row + c) - Splat(m_new));
        Store(row + c, p);
        sum += p;
      }
      const float corr = Exp2(Splat(m[r] - m_new))[0];
      l[r] = l[r] * corr + HorizontalSum(sum);
      m[r] = m_new;
      if (corr != 1.0f)
        for (int64_t d = 0; d < dim; d += 8) Store(acc + r * dim + d, Load(acc + r * dim + d) * Splat(corr));
    }
    Product<true>(rows, dim, kBlock, scores, kBlock, 1, v + j * kBlock * dim, dim, acc, dim);
  }
  for (int64_t r = 0; r < rows; ++r) {
    if (l[r] == 0.0f) {
      lse[r] = kEmptyLse;
      continue;
    }
    const v8 inv = Splat(1.0f / l[r]);
    for (int64_t d = 0; d < dim; d += 8) Store(acc + r * dim + d, Load(acc + r * dim + d) * inv);
    lse[r] = (m[r] + std::log2(l[r])) * kLn2;
  }
}

// One (row, KV head): FlashAttention-2's backward, key tile outer, so dK / dV of a tile stay
// in the thread's cache and dQ rows (owned by this pair alone) accumulate in the output.
// With qs = scale q: S = qs k^T, P = exp(S - lse), dS = P (dP - rowsum(dO O)), dK = dS^T qs,
// dQ = scale dS k (computed in log2 units, qs carrying log2 e).
void BackwardPair(const Dims& s, const Pages& pg, int64_t pair, const float* q, const float* k, const float* v,
                  const float* out, const float* lse, const float* dout, float scale, int64_t first_block, float* dq,
                  float* dk, float* dv, std::vector<float>& work, std::vector<uint8_t>& allowed_buf) {
  const int64_t rows = s.Rows(), dim = s.dim, all_rows = s.tokens * s.groups, pages = s.tokens / pg.page_size;
  work.resize(2 * rows * kBlock + 3 * dim * kBlock + all_rows * dim + all_rows);
  float* p = work.data();
  float* ds = p + rows * kBlock;
  float* kt = ds + rows * kBlock;
  float* vt = kt + dim * kBlock;
  float* part = vt + dim * kBlock;  // one query block's share of a dK / dV tile
  float* qs_all = part + dim * kBlock;  // the pair's queries, scaled once (every key tile reads them)
  float* delta = qs_all + all_rows * dim;  // rowsum(dout * out) per query row
  const uint8_t* allowed = nullptr;
  if (pg.Paged()) {
    allowed_buf.resize(s.tokens * pages);
    AllowedPages(s, pg, pair, 0, s.tokens, allowed_buf.data());
    allowed = allowed_buf.data();
  }
  for (int64_t r = 0; r < all_rows; ++r) {
    v8 sum = Splat(0.0f);
    for (int64_t d = 0; d < dim; d += 8) sum += Load(dout + r * dim + d) * Load(out + r * dim + d);
    delta[r] = HorizontalSum(sum);
  }
  ScaledCopy(q, all_rows * dim, scale * kLog2e, qs_all);
  std::fill(dq, dq + all_rows * dim, 0.0f);
  std::fill(dk, dk + s.tokens * dim, 0.0f);
  std::fill(dv, dv + s.tokens * dim, 0.0f);
  for (int64_t j = 0; j < s.Blocks(); ++j) {
    const float* kj = k + j * kBlock * dim;
    float* dkj = dk + j * kBlock * dim;
    float* dvj = dv + j * kBlock * dim;
    TransposeTile(kj, dim, kt);
    TransposeTile(v + j * kBlock * dim, dim, vt);
    for (int64_t i = std::max(j, first_block); i < s.Blocks(); ++i) {  // blocks below first_block: output 0
      const uint8_t* block_allowed = allowed == nullptr ? nullptr : allowed + i * kBlock * pages;
      if (block_allowed != nullptr && !TileUsed(block_allowed, pages, pg.page_size, j)) continue;
      const int64_t r0 = i * rows;
      const float* doi = dout + r0 * dim;
      const float* qs = qs_all + r0 * dim;
      Product<false>(rows, kBlock, dim, qs, dim, 1, kt, kBlock, p, kBlock);
      MaskTile(p, s.groups, i, j, block_allowed, pages, pg.page_size);
      Product<false>(rows, kBlock, dim, doi, dim, 1, vt, kBlock, ds, kBlock);  // dP = dO V^T
      for (int64_t r = 0; r < rows; ++r) {
        const v8 row_lse = Splat(lse[r0 + r] * kLog2e), row_delta = Splat(delta[r0 + r]);
        for (int64_t c = 0; c < kBlock; c += 8) {
          const v8 pr = Exp2(Load(p + r * kBlock + c) - row_lse);
          Store(p + r * kBlock + c, pr);
          Store(ds + r * kBlock + c, pr * (Load(ds + r * kBlock + c) - row_delta));
        }
      }
      // dK / dV: each query block's share summed on its own, then added (a chain of rows per block,
      // not of every query: float32 rounding as in a blockwise sum)
      Product<false>(kBlock, dim, rows, p, 1, kBlock, doi, dim, part, dim);  // dV += P^T dO
      AddTo(part, kBlock * dim, dvj);
      Product<true>(rows, dim, kBlock, ds, kBlock, 1, kj, dim, dq + r0 * dim, dim);  // dQ += dS K (scale: below)
      Product<false>(kBlock, dim, rows, ds, 1, kBlock, qs, dim, part, dim);  // dK += dS^T qs
      AddTo(part, kBlock * dim, dkj);
    }
    ScaledCopy(dkj, kBlock * dim, kLn2, dkj);  // qs carried log2 e
  }
  ScaledCopy(dq, all_rows * dim, scale, dq);
}

ffi::Error CheckDims(ffi::Buffer<ffi::F32>& q, ffi::Buffer<ffi::F32>& k, ffi::Buffer<ffi::F32>& v, Dims* s) {
  auto qd = q.dimensions();
  auto kd = k.dimensions();
  if (qd.size() != 5 || kd.size() != 4 || v.dimensions().size() != 4) {
    return ffi::Error::InvalidArgument("flash_attention_cpu: expected q [B,Hkv,T,G,D], k / v [B,Hkv,T,D]");
  }
  *s = Dims{qd[0], qd[1], qd[2], qd[3], qd[4]};
  for (int i = 0; i < 4; ++i) {
    const int64_t want = i < 3 ? qd[i] : qd[4];
    if (kd[i] != want || v.dimensions()[i] != want) {
      return ffi::Error::InvalidArgument("flash_attention_cpu: k / v must be [B,Hkv,T,D] of q's B, Hkv, T, D");
    }
  }
  if (s->tokens % kBlock || s->dim % 8) {
    return ffi::Error::InvalidArgument("flash_attention_cpu: T must be a multiple of 64 and D of 8");
  }
  return ffi::Error::Success();
}

ffi::Error CheckQueriesFrom(const Dims& s, int64_t queries_from) {
  if (queries_from < 0 || queries_from % kBlock || queries_from > s.tokens) {
    return ffi::Error::InvalidArgument("flash_attention_cpu: queries_from must be a multiple of 64 within T");
  }
  return ffi::Error::Success();
}

// page_idx / page_valid [B, Hkv, T, N], dense_before [B]; N == 0: dense attention.
ffi::Error ReadPages(const Dims& s, ffi::Buffer<ffi::S32>& idx, ffi::Buffer<ffi::PRED>& valid,
                     ffi::Buffer<ffi::S32>& dense_before, int64_t page_size, Pages* pg) {
  auto nd = idx.dimensions();
  if (nd.size() != 4 || nd[0] != s.batch || nd[1] != s.kv_heads || nd[2] != s.tokens ||
      valid.element_count() != idx.element_count() || dense_before.element_count() != s.batch) {
    return ffi::Error::InvalidArgument(
        "flash_attention_cpu: page_idx / page_valid must be [B,Hkv,T,N] and dense_before [B]");
  }
  if (page_size < 1 || kBlock % page_size) {
    return ffi::Error::InvalidArgument("flash_attention_cpu: page_size must divide 64");
  }
  if (nd[3] > 0) {
    pg->idx = idx.typed_data();
    pg->valid = reinterpret_cast<const bool*>(valid.typed_data());
    pg->dense_before = dense_before.typed_data();
    pg->slots = nd[3];
    pg->page_size = page_size;
  }
  return ffi::Error::Success();
}

ffi::Error ForwardImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                       ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> page_idx, ffi::Buffer<ffi::PRED> page_valid,
                       ffi::Buffer<ffi::S32> dense_before, float scale, int64_t page_size, int64_t queries_from,
                       ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> lse) {
  Dims s;
  Pages pg;
  if (auto err = CheckDims(q, k, v, &s); err.failure()) return err;
  if (auto err = ReadPages(s, page_idx, page_valid, dense_before, page_size, &pg); err.failure()) return err;
  if (auto err = CheckQueriesFrom(s, queries_from); err.failure()) return err;
  const float *qp = q.typed_data(), *kp = k.typed_data(), *vp = v.typed_data();
  float *op = out->typed_data(), *lp = lse->typed_data();
  const int64_t blocks = s.Blocks(), rows = s.Rows(), first = queries_from / kBlock, computed = blocks - first;
  // Query blocks below queries_from are not computed (the caller has them or does not read them): 0.
  for (int64_t pair = 0; pair < s.batch * s.kv_heads; ++pair) {
    const int64_t r0 = pair * s.tokens * s.groups;
    std::fill(op + r0 * s.dim, op + (r0 + first * rows) * s.dim, 0.0f);
    std::fill(lp + r0, lp + r0 + first * rows, 0.0f);
  }
  // Largest blocks first (they read the most key tiles), so the last items to finish are short.
  ParallelFor(pool, s.batch * s.kv_heads * computed, [=](int64_t item) {
    thread_local std::vector<float> work;
    thread_local std::vector<uint8_t> allowed;
    const int64_t pair = item / computed, block = blocks - 1 - item % computed;
    const int64_t r0 = pair * s.tokens * s.groups + block * rows;
    ForwardBlock(s, pg, pair, qp + r0 * s.dim, kp + pair * s.tokens * s.dim, vp + pair * s.tokens * s.dim, scale,
                 block, op + r0 * s.dim, lp + r0, work, allowed);
  });
  return ffi::Error::Success();
}

ffi::Error BackwardImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                        ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> page_idx, ffi::Buffer<ffi::PRED> page_valid,
                        ffi::Buffer<ffi::S32> dense_before, ffi::Buffer<ffi::F32> out, ffi::Buffer<ffi::F32> lse,
                        ffi::Buffer<ffi::F32> dout, float scale, int64_t page_size, int64_t queries_from,
                        ffi::ResultBuffer<ffi::F32> dq, ffi::ResultBuffer<ffi::F32> dk,
                        ffi::ResultBuffer<ffi::F32> dv) {
  Dims s;
  Pages pg;
  if (auto err = CheckDims(q, k, v, &s); err.failure()) return err;
  if (auto err = ReadPages(s, page_idx, page_valid, dense_before, page_size, &pg); err.failure()) return err;
  if (auto err = CheckQueriesFrom(s, queries_from); err.failure()) return err;
  const int64_t q_pair = s.tokens * s.groups * s.dim, kv_pair = s.tokens * s.dim, l_pair = s.tokens * s.groups;
  const float *qp = q.typed_data(), *kp = k.typed_data(), *vp = v.typed_data(), *op = out.typed_data(),
              *lp = lse.typed_data(), *dop = dout.typed_data();
  float *dqp = dq->typed_data(), *dkp = dk->typed_data(), *dvp = dv->typed_data();
  ParallelFor(pool, s.batch * s.kv_heads, [=](int64_t pair) {
    thread_local std::vector<float> work;
    thread_local std::vector<uint8_t> allowed;
    BackwardPair(s, pg, pair, qp + pair * q_pair, kp + pair * kv_pair, vp + pair * kv_pair, op + pair * q_pair,
                 lp + pair * l_pair, dop + pair * q_pair, scale, queries_from / kBlock, dqp + pair * q_pair,
                 dkp + pair * kv_pair,
                 dvp + pair * kv_pair, work, allowed);
  });
  return ffi::Error::Success();
}

}  // namespace

// q, k, v, then the page sets: page_idx / page_valid [B, Hkv, T, N] (N = 0: dense), dense_before [B].
static auto BindQKVPages() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::F32>>()    // q [B, Hkv, T, G, D]
      .Arg<ffi::Buffer<ffi::F32>>()    // k [B, Hkv, T, D]
      .Arg<ffi::Buffer<ffi::F32>>()    // v
      .Arg<ffi::Buffer<ffi::S32>>()    // page_idx
      .Arg<ffi::Buffer<ffi::PRED>>()   // page_valid
      .Arg<ffi::Buffer<ffi::S32>>();   // dense_before
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(SparrowFlashForwardCpu, ForwardImpl,
                              BindQKVPages()
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("page_size")
                                  .Attr<int64_t>("queries_from")  // query blocks below it: not computed, 0
                                  .Ret<ffi::Buffer<ffi::F32>>()    // out [B, Hkv, T, G, D]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // lse [B, Hkv, T, G]

XLA_FFI_DEFINE_HANDLER_SYMBOL(SparrowFlashBackwardCpu, BackwardImpl,
                              BindQKVPages()
                                  .Arg<ffi::Buffer<ffi::F32>>()    // out
                                  .Arg<ffi::Buffer<ffi::F32>>()    // lse
                                  .Arg<ffi::Buffer<ffi::F32>>()    // dout
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("page_size")
                                  .Attr<int64_t>("queries_from")
                                  .Ret<ffi::Buffer<ffi::F32>>()    // dq
                                  .Ret<ffi::Buffer<ffi::F32>>()    // dk
                                  .Ret<ffi::Buffer<ffi::F32>>());  // dv
