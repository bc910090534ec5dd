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
// Work item: one row and one KV head, its query heads together (each key read once for all of them), the value
// accumulation in registers, CHUNK outputs at a time.

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
constexpr int HEADS = 4;    // query heads of one KV head per pass over the keys
constexpr int CHUNK = 8;    // 16-float vectors of the output accumulated in registers per pass over the keys

inline v16 load16(const float* p) {
  v16 v;
  std::memcpy(&v, p, 64);
  return v;
}
inline void store16(float* p, v16 v) { std::memcpy(p, &v, 64); }

inline v16 splat(float a) { return v16{} + a; }

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

// nh query dots against one key: per query, lane l sums q[i] * k[i] over i = l mod 16 in order, then tree_sum
template <int NH>
inline void dots(const float* const* q, const float* __restrict k, int64_t D, float* out) {
  v16 acc[NH];
  for (int h = 0; h < NH; ++h) acc[h] = v16{};
  int64_t i = 0;
  for (; i + 16 <= D; i += 16) {
    const v16 kv = load16(k + i);
    for (int h = 0; h < NH; ++h) acc[h] = acc[h] + load16(q[h] + i) * kv;
  }
  for (; i < D; ++i)
    for (int h = 0; h < NH; ++h) acc[h][i & 15] += q[h][i] * k[i];
  for (int h = 0; h < NH; ++h) out[h] = tree_sum(acc[h]);
}

// o[0:n) = sum over the listed keys of p[key] * v[key][0:n), in key order (n <= 16 * CHUNK, a multiple of 16)
template <int NV>
inline void accumulate(const float* __restrict p, const int64_t* __restrict keys, int64_t nk, const float* __restrict v,
                       int64_t vs, float* __restrict o) {
  v16 acc[NV];
  for (int c = 0; c < NV; ++c) acc[c] = v16{};
  for (int64_t t = 0; t < nk; ++t) {
    const float* vr = v + keys[t] * vs;
    const float pt = p[t];
    for (int c = 0; c < NV; ++c) acc[c] = acc[c] + pt * load16(vr + 16 * c);
  }
  for (int c = 0; c < NV; ++c) store16(o + 16 * c, acc[c]);
}

void accumulate_any(const float* p, const int64_t* keys, int64_t nk, const float* v, int64_t vs, int64_t n, float* o) {
  switch (n / 16) {
    case 1: return accumulate<1>(p, keys, nk, v, vs, o);
    case 2: return accumulate<2>(p, keys, nk, v, vs, o);
    case 3: return accumulate<3>(p, keys, nk, v, vs, o);
    case 4: return accumulate<4>(p, keys, nk, v, vs, o);
    case 5: return accumulate<5>(p, keys, nk, v, vs, o);
    case 6: return accumulate<6>(p, keys, nk, v, vs, o);
    case 7: return accumulate<7>(p, keys, nk, v, vs, o);
    default: return accumulate<8>(p, keys, nk, v, vs, o);
  }
}

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
  const float sc = static_cast<float>(scale);
  const int64_t DV = D / 16 * 16;  // outputs accumulated as vectors; the rest (D % 16) one by one
  at::parallel_for(0, R * G, 1, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> keys;
    std::vector<float> w;  // (heads, keys): scores, then exp(score - max)
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / G, g = item % G, b = sp[r];
      const float* kbase = kp + b * kb + g * kg;
      const float* vbase = vp + b * vb + g * vg;
      const bool* mr = mp ? mp + r * mcols : nullptr;
      keys.clear();
      for (int64_t j = lp[r]; j <= hp[r]; ++j)
        if (!mr || mr[j]) keys.push_back(j);
      const int64_t nk = static_cast<int64_t>(keys.size());
      if (nk == 0) continue;  // no key visible: zeros
      w.resize(HEADS * nk);
      for (int64_t h0 = 0; h0 < per_kv; h0 += HEADS) {
        const int nh = static_cast<int>(std::min<int64_t>(HEADS, per_kv - h0));
        const float* qh[HEADS];
        for (int i = 0; i < nh; ++i) qh[i] = qp + (r * H + g * per_kv + h0 + i) * D;
        for (int64_t t = 0; t < nk; ++t) {
          float s[HEADS];
          const float* kr = kbase + keys[t] * ks;
          switch (nh) {
            case 4: dots<4>(qh, kr, D, s); break;
            case 3: dots<3>(qh, kr, D, s); break;
            case 2: dots<2>(qh, kr, D, s); break;
            default: dots<1>(qh, kr, D, s); break;
          }
          for (int i = 0; i < nh; ++i) w[i * nk + t] = s[i] * sc;
        }
        for (int i = 0; i < nh; ++i) {
          float* wi = w.data() + i * nk;
          float mx = -std::numeric_limits<float>::infinity();
          for (int64_t t = 0; t < nk; ++t) mx = wi[t] > mx ? wi[t] : mx;
          if (mx == -std::numeric_limits<float>::infinity()) continue;  // every score -inf: zeros
          exp_shifted(wi, nk, mx);
          float total = 0.0f;
          for (int64_t t = 0; t < nk; ++t) total += wi[t];
          float* o = op + (r * H + g * per_kv + h0 + i) * D;
          for (int64_t d0 = 0; d0 < DV; d0 += 16 * CHUNK)
            accumulate_any(wi, keys.data(), nk, vbase + d0, vs, std::min<int64_t>(16 * CHUNK, DV - d0), o + d0);
          for (int64_t d = DV; d < D; ++d) {
            float a = 0.0f;
            for (int64_t t = 0; t < nk; ++t) a += wi[t] * vbase[keys[t] * vs + d];
            o[d] = a;
          }
          const float inv = 1.0f / total;
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

}  // namespace

TORCH_LIBRARY(mtpspec_attention, m) {
  m.def("attend_rows(Tensor q, Tensor k, Tensor v, Tensor seq, Tensor lo, Tensor hi, Tensor? mask, float scale) -> Tensor");
  m.def("exp_lanes(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(mtpspec_attention, CPU, m) {
  m.impl("attend_rows", &attend_rows);
  m.impl("exp_lanes", &exp_lanes);
}
