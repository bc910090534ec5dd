// Attention for a few query rows, each computed alone: row-invariant, bitwise.
//
// o[r, h] = sum_j softmax_j(scale * q[r, h] . k[b, g, j]) v[b, g, j], b = seq[r], g = h / (heads per KV head), over
// the keys j a row sees: lo[r] <= j <= hi[r], and mask[r, j] where a mask is given (a token tree's ancestors).
// The keys are visited in index order, every dot product over the head size accumulates in 16 fixed lanes summed by
// a fixed tree, the softmax's max and sum run in key order, and the output accumulates the values in key order:
// so a row's output depends only on the keys it sees, not on the other rows of the call, the padding of the cache,
// the thread count, or the instruction set (built with -ffp-contract=off: no fused multiply-adds; the 16 lanes are
// a GCC vector, lowered to AVX-512, AVX2 or scalar code with the same per-lane operations). The softmax's exp is
// exp16 below, 16 scores at a time, the same per-lane arithmetic on every instruction set. A verify row and the
// plain step at the same position (the same keys, in the same order) give the same bits.
//
// Work item: the rows of one sequence (all, or a share of them so that every thread has work) and one KV head. Each
// key is read once for all of them: its dots with every row that sees it (the row's query heads together, and the
// row's keys among SIDE consecutive ones side by side, sharing the loads of the queries), then each row's softmax,
// then the values KEYS keys at a time for every row and head, the accumulators in registers VCHUNK vectors a head
// at a time and back in the output between blocks (stores and loads are exact). A row's arithmetic, and its order,
// is what it is alone; which rows share its item changes nothing.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i16 __attribute__((vector_size(64)));
constexpr int HEADS = 4;  // query heads of one KV head per pass over the keys
#if defined(__AVX512F__)
constexpr int SIDE = 4;    // keys whose dots run side by side, sharing the query loads (4 heads: 16 accumulators)
constexpr int VCHUNK = 4;  // 16-float output vectors a head accumulated in registers (4 heads: 16 of 32 registers)
#else
constexpr int SIDE = 1;    // AVX2 and below: a 16-float vector takes two of 16 registers
constexpr int VCHUNK = 1;
#endif
constexpr int64_t KEYS = 64;  // keys per block of the value pass: their value vectors stay in L1 for every row

inline v16 load16(const float* p) {
  v16 v;
  std::memcpy(&v, p, 64);
  return v;
}
inline void store16(float* p, v16 v) { std::memcpy(p, &v, 64); }

inline v16 splat(float a) { return v16{} + a; }

// Keeps a loaded vector in a register: otherwise the compiler folds each use into a memory operand, reloading it for
// every head or key it multiplies (two loads per product where one suffices). No arithmetic changes.
inline void in_register(v16& a) {
#if defined(__AVX512F__)
  __asm__("" : "+v"(a));
#else
  (void)a;
#endif
}

// exp of 16 lanes, Cephes' expf: x = n ln2 + r (n the nearest integer to x log2(e), ln2 in two parts so n * ln2_hi is
// exact), exp(r) by its degree-7 polynomial on |r| <= ln2 / 2, times 2^n as two power-of-two factors, so that a
// result below FLT_MIN is rounded once (gradual underflow) and x < -104 (and -inf) gives 0. Within 1 ulp of exp
// on every float up to 88.7 (checked exhaustively on x <= 0, the softmax's range); NaN stays NaN. Plain mul and add:
// the same bits on AVX-512, AVX2 and scalar builds.
inline v16 exp16(v16 x) {
  x = x < splat(-110.0f) ? splat(-110.0f) : x;  // keeps n in range; exp is 0 in fp32 below -104
  x = x > splat(89.0f) ? splat(89.0f) : x;      // and inf above 88.73
  const v16 shift = splat(12582912.0f);          // 1.5 * 2^23: adding it rounds to an integer, held in the low bits
  const v16 t = x * splat(1.44269504088896341f) + shift;
  const v16 n = t - shift;
  const i16 ni = (i16)t - (i16)shift;
  v16 r = x - n * splat(0.693359375f);  // exact: 9 significant bits times |n| <= 160
  r = r - n * splat(-2.12194440e-4f);
  v16 p = splat(1.9875691500e-4f);
  p = p * r + splat(1.3981999507e-3f);
  p = p * r + splat(8.3334519073e-3f);
  p = p * r + splat(4.1665795894e-2f);
  p = p * r + splat(1.6666665459e-1f);
  p = p * r + splat(5.0000001201e-1f);
  const v16 y = p * (r * r) + r + splat(1.0f);
  const i16 n1 = ni >> 1, n2 = ni - n1;  // 2^n = 2^n1 * 2^n2, each a normal float for n in [-159, 128]
  const i16 e1 = (n1 + 127) << 23, e2 = (n2 + 127) << 23;
  return y * (v16)e1 * (v16)e2;  // GCC vector casts reinterpret the bits
}

// exp(w[t] - mx) for t < n in place, 16 at a time (the tail padded with -inf, whose exp is 0)
inline void exp_shifted(float* w, int64_t n, float mx) {
  int64_t t = 0;
  for (; t + 16 <= n; t += 16) store16(w + t, exp16(load16(w + t) - splat(mx)));
  if (t < n) {
    float tail[16];
    for (int l = 0; l < 16; ++l) tail[l] = t + l < n ? w[t + l] : -std::numeric_limits<float>::infinity();
    const v16 e = exp16(load16(tail) - splat(mx));
    for (int64_t l = 0; t + l < n; ++l) w[t + l] = e[l];
  }
}

// the 16 lanes summed by the fixed tree: l += l + 8, then l + 4, l + 2, l + 1
inline float tree_sum(v16 a) {
#if defined(__AVX512F__)
  __m512 z;
  std::memcpy(&z, &a, 64);
  const __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(z), _mm512_extractf32x8_ps(z, 1));
#elif defined(__AVX2__)
  __m256 lo, hi;
  std::memcpy(&lo, &a, 32);
  std::memcpy(&hi, reinterpret_cast<const char*>(&a) + 32, 32);
  const __m256 s8 = _mm256_add_ps(lo, hi);
#endif
#if defined(__AVX2__)
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
#else
  for (int w = 8; w >= 1; w /= 2)
    for (int l = 0; l < w; ++l) a[l] += a[l + w];
  return a[0];
#endif
}

// NH query dots against NK keys: per query and key, lane l sums q[i] * k[i] over i = l mod 16 in order, then
// tree_sum (the keys side by side share the loads of the queries; each dot is the same arithmetic alone)
template <int NH, int NK>
inline void dots(const float* const* q, const float* const* k, int64_t D, float (*out)[HEADS]) {
  v16 acc[NK][NH];
  for (int n = 0; n < NK; ++n)
    for (int h = 0; h < NH; ++h) acc[n][h] = v16{};
  int64_t i = 0;
  for (; i + 16 <= D; i += 16) {
    v16 kv[NK];
    for (int n = 0; n < NK; ++n) {
      kv[n] = load16(k[n] + i);
      in_register(kv[n]);
    }
    for (int h = 0; h < NH; ++h) {
      v16 qv = load16(q[h] + i);
      in_register(qv);
      for (int n = 0; n < NK; ++n) acc[n][h] = acc[n][h] + qv * kv[n];
    }
  }
  for (; i < D; ++i)
    for (int n = 0; n < NK; ++n)
      for (int h = 0; h < NH; ++h) acc[n][h][i & 15] += q[h][i] * k[n][i];
  for (int n = 0; n < NK; ++n)
    for (int h = 0; h < NH; ++h) out[n][h] = tree_sum(acc[n][h]);
}

// o[h][0:16 NV) += p[h][t] * v[key t][0:16 NV) for the nh heads, over positions t0 <= t < t1 of a row's key list in
// order: each value vector read once for the heads, the accumulators in registers
template <int NH, int NV>
inline void accumulate(const float* const* p, const int64_t* __restrict keys, int64_t t0, int64_t t1,
                       const float* __restrict v, int64_t vs, float* const* o) {
  v16 acc[NH][NV];
  for (int h = 0; h < NH; ++h)
    for (int c = 0; c < NV; ++c) acc[h][c] = load16(o[h] + 16 * c);
  for (int64_t t = t0; t < t1; ++t) {
    const float* vr = v + keys[t] * vs;
    for (int c = 0; c < NV; ++c) {
      v16 vc = load16(vr + 16 * c);
      in_register(vc);
      for (int h = 0; h < NH; ++h) acc[h][c] = acc[h][c] + p[h][t] * vc;
    }
  }
  for (int h = 0; h < NH; ++h)
    for (int c = 0; c < NV; ++c) store16(o[h] + 16 * c, acc[h][c]);
}

template <int NH>
void accumulate_nv(const float* const* p, const int64_t* keys, int64_t t0, int64_t t1, const float* v, int64_t vs,
                   int nv, float* const* o) {
  switch (nv) {
    case 1: return accumulate<NH, 1>(p, keys, t0, t1, v, vs, o);
    case 2: return accumulate<NH, 2>(p, keys, t0, t1, v, vs, o);
    case 3: return accumulate<NH, 3>(p, keys, t0, t1, v, vs, o);
    default: return accumulate<NH, 4>(p, keys, t0, t1, v, vs, o);
  }
}

void accumulate_any(const float* const* p, const int64_t* keys, int64_t t0, int64_t t1, const float* v, int64_t vs,
                    int nh, int nv, float* const* o) {
  switch (nh) {
    case 4: return accumulate_nv<4>(p, keys, t0, t1, v, vs, nv, o);
    case 3: return accumulate_nv<3>(p, keys, t0, t1, v, vs, nv, o);
    case 2: return accumulate_nv<2>(p, keys, t0, t1, v, vs, nv, o);
    default: return accumulate_nv<1>(p, keys, t0, t1, v, vs, nv, o);
  }
}

template <int NH>
void dots_nk(const float* const* q, const float* const* k, int64_t D, int nk, float (*out)[HEADS]) {
  switch (nk) {
#if defined(__AVX512F__)
    case 4: return dots<NH, 4>(q, k, D, out);
    case 3: return dots<NH, 3>(q, k, D, out);
    case 2: return dots<NH, 2>(q, k, D, out);
#endif
    default: return dots<NH, 1>(q, k, D, out);
  }
}

void dots_any(const float* const* q, const float* const* k, int64_t D, int nh, int nk, float (*out)[HEADS]) {
  switch (nh) {
    case 4: return dots_nk<4>(q, k, D, nk, out);
    case 3: return dots_nk<3>(q, k, D, nk, out);
    case 2: return dots_nk<2>(q, k, D, nk, out);
    default: return dots_nk<1>(q, k, D, nk, out);
  }
}

// One work item: rows of one sequence and one KV head. Each row keeps its own key list, scores and weights; the
// keys are visited once for all the rows (each row's arithmetic is what it does alone, in the same order).
struct Group {
  int64_t b, g;
  std::vector<int64_t> rows;
};

struct Scratch {
  std::vector<int64_t> keys, koff, cur;  // the rows' key lists, one after the other; row i's from koff[i]
  std::vector<float> w;                  // per row, (heads of the KV head, its keys): scores, then exp(score - max)
  std::vector<int64_t> woff;
};

at::Tensor attend_rows(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& seq,
                       const at::Tensor& lo, const at::Tensor& hi, const c10::optional<at::Tensor>& mask, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 4 && v.dim() == 4, "attend_rows: q (R, H, D), k / v (B, G, S, D)");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "attend_rows: float32 tensors");
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(3) == q.size(2) && k.stride(3) == 1 && v.stride(3) == 1,
              "attend_rows: k and v (B, G, S, D) with the head size of q, last dimension contiguous");
  const int64_t R = q.size(0), H = q.size(1), D = q.size(2), B = k.size(0), G = k.size(1), S = k.size(2);
  TORCH_CHECK(G > 0 && H % G == 0, "attend_rows: query heads must be a multiple of KV heads");
  auto qc = q.contiguous();
  auto seq_c = seq.to(at::kLong).contiguous(), lo_c = lo.to(at::kLong).contiguous(), hi_c = hi.to(at::kLong).contiguous();
  TORCH_CHECK(seq_c.numel() == R && lo_c.numel() == R && hi_c.numel() == R, "attend_rows: seq, lo, hi: one per row");
  at::Tensor m;
  if (mask.has_value()) {
    m = mask->to(at::kBool).contiguous();
    TORCH_CHECK(m.dim() == 2 && m.size(0) == R && m.size(1) <= S, "attend_rows: mask (R, <= S)");
  }
  auto out = at::zeros({R, H, D}, q.options());
  const float* qp = qc.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const int64_t *sp = seq_c.data_ptr<int64_t>(), *lp = lo_c.data_ptr<int64_t>(), *hp = hi_c.data_ptr<int64_t>();
  const bool* mp = m.defined() ? m.data_ptr<bool>() : nullptr;
  const int64_t mcols = m.defined() ? m.size(1) : 0;
  float* op = out.data_ptr<float>();
  const int64_t kb = k.stride(0), kg = k.stride(1), ks = k.stride(2), vb = v.stride(0), vg = v.stride(1), vs = v.stride(2);
  const int64_t per_kv = H / G;
  for (int64_t r = 0; r < R; ++r) {
    TORCH_CHECK(sp[r] >= 0 && sp[r] < B && lp[r] >= 0 && hp[r] < S && lp[r] <= hp[r] && (!mp || hp[r] < mcols),
                "attend_rows: row ", r, " sees keys ", lp[r], "..", hp[r], " of sequence ", sp[r], " outside (", B, ", ", S, ")");
  }
  // each sequence's rows, in call order, split into as many groups as gives every thread work (any split gives the
  // same bits: a row's arithmetic does not depend on its group)
  std::vector<std::vector<int64_t>> by_seq(B);
  for (int64_t r = 0; r < R; ++r) by_seq[sp[r]].push_back(r);
  int64_t nseq = 0;
  for (const auto& rows : by_seq) nseq += !rows.empty();
  const int64_t split = std::max<int64_t>(1, (at::get_num_threads() + nseq * G - 1) / std::max<int64_t>(1, nseq * G));
  std::vector<Group> groups;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = static_cast<int64_t>(by_seq[b].size());
    if (n == 0) continue;
    const int64_t size = (n + std::min(split, n) - 1) / std::min(split, n);
    for (int64_t a = 0; a < n; a += size)
      for (int64_t g = 0; g < G; ++g)
        groups.push_back({b, g, std::vector<int64_t>(by_seq[b].begin() + a, by_seq[b].begin() + std::min(n, a + size))});
  }
  const float sc = static_cast<float>(scale);
  const int64_t DV = D / 16 * 16;  // outputs accumulated as vectors; the rest (D % 16) one by one
  at::parallel_for(0, static_cast<int64_t>(groups.size()), 1, [&](int64_t begin, int64_t end) {
    Scratch s;
    for (int64_t item = begin; item < end; ++item) {
      const Group& grp = groups[item];
      const int64_t n = static_cast<int64_t>(grp.rows.size());
      const float* kbase = kp + grp.b * kb + grp.g * kg;
      const float* vbase = vp + grp.b * vb + grp.g * vg;
      s.keys.clear();
      s.koff.assign(n + 1, 0);
      s.woff.assign(n + 1, 0);
      int64_t first = S, last = -1;  // the keys any row sees lie in first..last
      for (int64_t i = 0; i < n; ++i) {
        const int64_t r = grp.rows[i];
        const bool* mr = mp ? mp + r * mcols : nullptr;
        for (int64_t j = lp[r]; j <= hp[r]; ++j)
          if (!mr || mr[j]) s.keys.push_back(j);
        s.koff[i + 1] = static_cast<int64_t>(s.keys.size());
        s.woff[i + 1] = s.woff[i] + per_kv * (s.koff[i + 1] - s.koff[i]);
        first = std::min(first, lp[r]);
        last = std::max(last, hp[r]);
      }
      s.w.resize(s.woff[n]);
      auto nk = [&](int64_t i) { return s.koff[i + 1] - s.koff[i]; };
      auto qrow = [&](int64_t i, int64_t h) { return qp + (grp.rows[i] * H + grp.g * per_kv + h) * D; };
      auto orow = [&](int64_t i, int64_t h) { return op + (grp.rows[i] * H + grp.g * per_kv + h) * D; };
      auto wrow = [&](int64_t i, int64_t h) { return s.w.data() + s.woff[i] + h * nk(i); };
      // scores: each key once, for every row that sees it; a row's keys among SIDE consecutive ones side by side
      s.cur.assign(s.koff.begin(), s.koff.end() - 1);
      for (int64_t j = first; j <= last; j += SIDE) {
        for (int64_t i = 0; i < n; ++i) {
          const int64_t c = s.cur[i], t = c - s.koff[i];
          const float* kj[SIDE];
          int nk_side = 0;
          while (s.cur[i] < s.koff[i + 1] && s.keys[s.cur[i]] < j + SIDE) kj[nk_side++] = kbase + s.keys[s.cur[i]++] * ks;
          if (nk_side == 0) continue;
          for (int64_t h0 = 0; h0 < per_kv; h0 += HEADS) {
            const int nh = static_cast<int>(std::min<int64_t>(HEADS, per_kv - h0));
            const float* qh[HEADS];
            float sv[SIDE][HEADS];
            for (int h = 0; h < nh; ++h) qh[h] = qrow(i, h0 + h);
            dots_any(qh, kj, D, nh, nk_side, sv);
            for (int h = 0; h < nh; ++h)
              for (int m = 0; m < nk_side; ++m) wrow(i, h0 + h)[t + m] = sv[m][h] * sc;
          }
        }
      }
      // each row's softmax in key order; total[i * per_kv + h] = 0 marks a head with no finite score (output zeros)
      std::vector<float> total(n * per_kv, 0.0f);
      for (int64_t i = 0; i < n; ++i) {
        for (int64_t h = 0; h < per_kv && nk(i) > 0; ++h) {
          float* wi = wrow(i, h);
          float mx = -std::numeric_limits<float>::infinity();
          for (int64_t t = 0; t < nk(i); ++t) mx = wi[t] > mx ? wi[t] : mx;
          if (mx == -std::numeric_limits<float>::infinity()) continue;
          exp_shifted(wi, nk(i), mx);
          float sum = 0.0f;
          for (int64_t t = 0; t < nk(i); ++t) sum += wi[t];
          total[i * per_kv + h] = sum;
        }
      }
      // values: KEYS keys at a time, each value vector read from memory once for every row and head (the
      // accumulators go back to the output between blocks: exact, so each row's sum runs in key order as alone)
      for (int64_t d0 = 0; d0 < DV; d0 += 16 * VCHUNK) {
        const int nv = static_cast<int>(std::min<int64_t>(VCHUNK, (DV - d0) / 16));
        s.cur.assign(s.koff.begin(), s.koff.end() - 1);
        for (int64_t j0 = first; j0 <= last; j0 += KEYS) {
          for (int64_t i = 0; i < n; ++i) {
            const int64_t t0 = s.cur[i];
            while (s.cur[i] < s.koff[i + 1] && s.keys[s.cur[i]] < j0 + KEYS) ++s.cur[i];
            if (s.cur[i] == t0) continue;
            for (int64_t h0 = 0; h0 < per_kv; h0 += HEADS) {
              const int nh = static_cast<int>(std::min<int64_t>(HEADS, per_kv - h0));
              const float* ph[HEADS];
              float* oh[HEADS];
              for (int h = 0; h < nh; ++h) ph[h] = wrow(i, h0 + h), oh[h] = orow(i, h0 + h) + d0;
              accumulate_any(ph, s.keys.data() + s.koff[i], t0 - s.koff[i], s.cur[i] - s.koff[i], vbase + d0, vs, nh,
                             nv, oh);
            }
          }
        }
      }
      for (int64_t i = 0; i < n; ++i) {
        const int64_t* ki = s.keys.data() + s.koff[i];
        for (int64_t h = 0; h < per_kv; ++h) {
          float* o = orow(i, h);
          const float sum = total[i * per_kv + h];
          if (sum == 0.0f) {  // no key, or no finite score: zeros
            std::fill(o, o + D, 0.0f);
            continue;
          }
          const float* wi = wrow(i, h);
          for (int64_t d = DV; d < D; ++d) {
            float a = 0.0f;
            for (int64_t t = 0; t < nk(i); ++t) a += wi[t] * vbase[ki[t] * vs + d];
            o[d] = a;
          }
          const float inv = 1.0f / sum;
          for (int64_t d = 0; d < D; ++d) o[d] *= inv;
        }
      }
    }
  });
  return out;
}

// exp16 of every element of a float32 tensor, the softmax's exp (for the tests)
at::Tensor exp_lanes(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "exp_lanes: a float32 tensor");
  auto y = x.contiguous().clone();
  float* p = y.data_ptr<float>();
  const int64_t n = y.numel();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) store16(p + i, exp16(load16(p + i)));
  for (; i < n; ++i) p[i] = exp16(splat(p[i]))[0];
  return y;
}

// The KV write of a compiled step: buf[b, h, pos[t]] = x[b, h, t] for k into k_buf and v into v_buf (B, nkv, S, hd),
// in place. Inside a graph the buffers are views of the cache input; this op is declared as mutating them, so
// inductor keeps it one in-place call (an in-place ATen write to a view of an input is functionalized into a copy of
// the whole span written out of place and copied back).
void write_rows(const at::Tensor& k_buf, const at::Tensor& v_buf, const at::Tensor& pos, const at::Tensor& k,
                const at::Tensor& v) {
  TORCH_CHECK(pos.dim() == 1 && pos.scalar_type() == at::kLong, "write_rows: pos must be (T,) int64");
  const at::Tensor p = pos.contiguous();
  const int64_t* pp = p.data_ptr<int64_t>();
  for (int i = 0; i < 2; ++i) {
    const at::Tensor& buf = i ? v_buf : k_buf;
    const at::Tensor& x = i ? v : k;
    TORCH_CHECK(buf.dim() == 4 && x.dim() == 4 && x.size(2) == p.size(0),
                "write_rows: buffers (B, nkv, S, hd), rows (B, nkv, T, hd)");
    TORCH_CHECK(x.size(0) == buf.size(0) && x.size(1) == buf.size(1) && x.size(3) == buf.size(3),
                "write_rows: rows and buffer differ in shape");
    if (buf.scalar_type() != x.scalar_type() || buf.stride(3) != 1 || x.stride(3) != 1) {
      buf.index_copy_(2, p, x);  // another layout: ATen's write
      continue;
    }
    const int64_t B = x.size(0), H = x.size(1), T = x.size(2), D = x.size(3), S = buf.size(2);
    const int64_t es = x.element_size();
    char* bp = static_cast<char*>(buf.data_ptr());
    const char* xp = static_cast<const char*>(x.data_ptr());
    for (int64_t t = 0; t < T; ++t) {
      const int64_t s = pp[t];
      TORCH_CHECK(s >= 0 && s < S, "write_rows: position ", s, " outside the buffer's ", S);
      for (int64_t b = 0; b < B; ++b)
        for (int64_t h = 0; h < H; ++h)
          std::memcpy(bp + (b * buf.stride(0) + h * buf.stride(1) + s * buf.stride(2)) * es,
                      xp + (b * x.stride(0) + h * x.stride(1) + t * x.stride(2)) * es, D * es);
    }
  }
}

}  // namespace

TORCH_LIBRARY(mtpspec_attention, m) {
  m.def("attend_rows(Tensor q, Tensor k, Tensor v, Tensor seq, Tensor lo, Tensor hi, Tensor? mask, float scale) -> Tensor");
  m.def("exp_lanes(Tensor x) -> Tensor");
  m.def("write_rows(Tensor(a!) k_buf, Tensor(b!) v_buf, Tensor pos, Tensor k, Tensor v) -> ()");
}

TORCH_LIBRARY_IMPL(mtpspec_attention, CPU, m) {
  m.impl("attend_rows", &attend_rows);
  m.impl("exp_lanes", &exp_lanes);
  m.impl("write_rows", &write_rows);
}
