// Attention for a few query rows, each computed alone: row-invariant, bitwise.
//
// o[r, h] = sum_j softmax_j(scale * q[r, h] . k[b, g, j]) v[b, g, j], b = seq[r], g = h / (heads per KV head), over
// the keys j a row sees: lo[r] <= j <= hi[r], and mask[r, j] where a mask is given (a token tree's ancestors).
// The keys are visited in index order, every dot product over the head size accumulates in 16 fixed lanes summed by
// a fixed tree, the softmax's max and sum run in key order, and the output accumulates the values in key order:
// so a row's output depends only on the keys it sees, not on the other rows of the call, the padding of the cache,
// the thread count, or the instruction set (built with -ffp-contract=off: no fused multiply-adds; the 16 lanes are
// a GCC vector, lowered to AVX-512, AVX2 or scalar code with the same per-lane operations). A verify row and the
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
constexpr int HEADS = 4;    // query heads of one KV head per pass over the keys
constexpr int CHUNK = 8;    // 16-float vectors of the output accumulated in registers per pass over the keys

inline v16 load16(const float* p) {
  v16 v;
  std::memcpy(&v, p, 64);
  return v;
}
inline void store16(float* p, v16 v) { std::memcpy(p, &v, 64); }

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
          float total = 0.0f;
          for (int64_t t = 0; t < nk; ++t) {
            wi[t] = std::exp(wi[t] - mx);
            total += wi[t];
          }
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
  m.def("write_rows(Tensor(a!) k_buf, Tensor(b!) v_buf, Tensor pos, Tensor k, Tensor v) -> ()");
}

TORCH_LIBRARY_IMPL(mtpspec_attention, CPU, m) {
  m.impl("attend_rows", &attend_rows);
  m.impl("write_rows", &write_rows);
}
