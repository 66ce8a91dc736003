// Block-sparse paged decode attention for XLA:CPU, as an XLA FFI custom call.
//
// Same contract as sparrow_jax.attention.decode.sparse_decode_reference:
//   q [B, H, D] f32 (already rounded to the cache dtype), k_pages / v_pages [B, Hkv, P, S, D]
//   (f32 or bf16), page_idx [B, Hkv, N] s32, page_valid [B, Hkv, N] pred, positions [B] s32,
//   attribute scale (f32)  ->  out [B, H, D] f32.
// Valid in-range slots are attended once each (duplicates collapse, as in the reference's
// page mask); tokens after positions[b] are masked; a row with nothing visible gives 0.
//
// Why a custom call: XLA:CPU gathers the selected pages into a temporary and then runs
// several fusions over it, so each selected byte is moved about three times and the
// intermediates are written out. Here each (row, KV head) streams its selected pages once,
// in ascending order, through a per-page online softmax held in registers / L1, and the
// (row, KV head) pairs are spread over XLA's own intra-op thread pool.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Built with -ffast-math (vectorised expf), which assumes no infinities: a large finite
// negative stands in for -inf as the initial running max.
constexpr float kNegLarge = -1e30f;

constexpr size_t kPrefetchPages = 8;

inline void Prefetch(const void* start, int64_t bytes) {
  const char* p = static_cast<const char*>(start);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 0);
}

inline float ToFloat(float x) { return x; }
inline float ToFloat(uint16_t bf16) {
  uint32_t bits = static_cast<uint32_t>(bf16) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

struct Shape {
  int64_t batch, heads, kv_heads, pages, page_size, dim, slots;
};

// One (row, KV head): the G query heads of the group over the selected pages.
template <typename KV>
void AttendGroup(const Shape& s, int64_t row, int64_t kv_head, const float* q, const KV* k, const KV* v,
                 const int32_t* page_idx, const bool* page_valid, const int32_t* positions, float scale,
                 float* out, std::vector<int32_t>& pages, std::vector<float>& work) {
  const int64_t groups = s.heads / s.kv_heads, d = s.dim, ps = s.page_size;
  const int64_t pair = row * s.kv_heads + kv_head;
  const int32_t* idx = page_idx + pair * s.slots;
  const bool* ok = page_valid + pair * s.slots;
  pages.clear();
  for (int64_t i = 0; i < s.slots; ++i) {
    if (ok[i] && idx[i] >= 0 && idx[i] < s.pages) pages.push_back(idx[i]);
  }
  std::sort(pages.begin(), pages.end());  // front-to-back reads; duplicates become adjacent
  pages.erase(std::unique(pages.begin(), pages.end()), pages.end());

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
  const int64_t page_elems = ps * d;
  const KV* k_head = k + pair * s.pages * page_elems;
  const KV* v_head = v + pair * s.pages * page_elems;
  for (size_t i = 0; i < pages.size(); ++i) {
    if (i + kPrefetchPages < pages.size()) {
      // Selected pages are scattered 4 KiB blocks: the hardware prefetchers only start within
      // a page, so ask for a later page's lines now (non-temporal: each is read once).
      Prefetch(k_head + pages[i + kPrefetchPages] * page_elems, page_elems * sizeof(KV));
      Prefetch(v_head + pages[i + kPrefetchPages] * page_elems, page_elems * sizeof(KV));
    }
    const int32_t page = pages[i];
    const int64_t visible = std::min<int64_t>(ps, position - static_cast<int64_t>(page) * ps + 1);
    if (visible <= 0) continue;  // the whole page is after the query
    const KV* kp = k_head + page * page_elems;
    const KV* vp = v_head + page * page_elems;
    for (int64_t g = 0; g < groups; ++g) {
      const float* qg = qs + g * d;
      float* sc = score + g * ps;
      float page_max = kNegLarge;
      for (int64_t t = 0; t < visible; ++t) {
        const KV* kt = kp + t * d;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t j = 0; j < d; ++j) dot += qg[j] * ToFloat(kt[j]);
        sc[t] = dot;
        page_max = std::max(page_max, dot);
      }
      const float m_new = std::max(m[g], page_max);
      const float rescale = expf(m[g] - m_new);  // 0 on the first page (m = kNegLarge)
      float* ag = acc + g * d;
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t t = 0; t < visible; ++t) {  // vector expf (libmvec) under -ffast-math
        sc[t] = expf(sc[t] - m_new);
        sum += sc[t];
      }
      sum += l[g] * rescale;
#pragma omp simd
      for (int64_t j = 0; j < d; ++j) ag[j] *= rescale;
      for (int64_t t = 0; t < visible; ++t) {
        const float w = sc[t];
        const KV* vt = vp + t * d;
#pragma omp simd
        for (int64_t j = 0; j < d; ++j) ag[j] += w * ToFloat(vt[j]);
      }
      m[g] = m_new;
      l[g] = sum;
    }
  }
  float* out_group = out + (row * s.heads + kv_head * groups) * d;
  for (int64_t g = 0; g < groups; ++g) {
    const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;  // nothing visible: 0, not 0/0
    for (int64_t j = 0; j < d; ++j) out_group[g * d + j] = acc[g * d + j] * inv;
  }
}

// Runs fn(i) for i in [0, n) on the caller and up to threads - 1 pool workers. The caller
// waits only for the work items, not for the scheduled tasks to start: a late task finds
// nothing left and returns, touching only the shared counters it co-owns.
template <typename Fn>
void ParallelFor(ffi::ThreadPool& pool, int64_t n, Fn fn) {
  struct Shared {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    std::mutex mu;
    std::condition_variable cv;
  };
  auto shared = std::make_shared<Shared>();
  auto body = std::make_shared<Fn>(std::move(fn));
  auto worker = [shared, body, n]() {
    for (int64_t i = shared->next++; i < n; i = shared->next++) {
      (*body)(i);
      if (++shared->done == n) {
        std::lock_guard<std::mutex> lock(shared->mu);
        shared->cv.notify_all();
      }
    }
  };
  const int64_t helpers = std::min<int64_t>(std::max<int64_t>(pool.num_threads(), 1), n) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([worker] { worker(); });  // an rvalue: Schedule copies it
  worker();
  std::unique_lock<std::mutex> lock(shared->mu);
  shared->cv.wait(lock, [&] { return shared->done.load() == n; });
}

template <typename KV>
void Run(ffi::ThreadPool& pool, const Shape& s, const float* q, const KV* k, const KV* v, const int32_t* idx,
         const bool* valid, const int32_t* positions, float scale, float* out) {
  ParallelFor(pool, s.batch * s.kv_heads, [=](int64_t pair) {
    thread_local std::vector<int32_t> pages;
    thread_local std::vector<float> work;
    AttendGroup(s, pair / s.kv_heads, pair % s.kv_heads, q, k, v, idx, valid, positions, scale, out, pages,
                work);
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
  if (k_pages.element_type() != v_pages.element_type()) {
    return ffi::Error::InvalidArgument("sparse_decode_cpu: k_pages and v_pages dtypes differ");
  }
  const bool* valid = reinterpret_cast<const bool*>(page_valid.typed_data());
  switch (k_pages.element_type()) {
    case ffi::F32:
      Run(pool, s, q.typed_data(), reinterpret_cast<const float*>(k_pages.untyped_data()),
          reinterpret_cast<const float*>(v_pages.untyped_data()), page_idx.typed_data(), valid,
          positions.typed_data(), scale, out->typed_data());
      return ffi::Error::Success();
    case ffi::BF16:
      Run(pool, s, q.typed_data(), reinterpret_cast<const uint16_t*>(k_pages.untyped_data()),
          reinterpret_cast<const uint16_t*>(v_pages.untyped_data()), page_idx.typed_data(), valid,
          positions.typed_data(), scale, out->typed_data());
      return ffi::Error::Success();
    default:
      return ffi::Error::InvalidArgument("sparse_decode_cpu: K/V pages must be float32 or bfloat16");
  }
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SparrowSparseDecodeCpu, SparseDecodeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()    // q
                                  .Arg<ffi::AnyBuffer>()           // k_pages
                                  .Arg<ffi::AnyBuffer>()           // v_pages
                                  .Arg<ffi::Buffer<ffi::S32>>()    // page_idx
                                  .Arg<ffi::Buffer<ffi::PRED>>()   // page_valid
                                  .Arg<ffi::Buffer<ffi::S32>>()    // positions
                                  .Attr<float>("scale")
                                  .Ret<ffi::Buffer<ffi::F32>>());  // out
