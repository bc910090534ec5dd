// Attention for a few query rows, each computed alone: row-invariant, bitwise.
//
// o[r, h] = sum_j softmax_j(scale * q[r, h] . k[b, g, j]) v[b, g, j], b = seq[r], g = h / (heads per KV head), over
// the keys j a row sees: lo[r] <= j <= hi[r], and mask[r, j] where a mask is given (a token tree's ancestors).
// The keys are visited in index order, every dot product over the head size accumulates in 16 fixed lanes summed by
// a fixed tree, the softmax's max and sum run in key order, and the output accumulates the values in key order:
// so a row's output depends only on the keys it sees, not on the other rows of the call, the padding of the cache,
// the thread count, or the instruction set (built with -ffp-contract=off: no fused multiply-adds). A verify row and
// the plain step at the same position (the same keys, in the same order) give the same bits.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

inline float dot(const float* a, const float* b, int64_t n) {
  float acc[16] = {0};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int l = 0; l < 16; ++l) acc[l] += a[i + l] * b[i + l];
  for (; i < n; ++i) acc[i & 15] += a[i] * b[i];
  for (int w = 8; w >= 1; w /= 2)
    for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
  return acc[0];
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
  at::parallel_for(0, R * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> w;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / H, h = item % H, g = h / per_kv, b = sp[r];
      const float* qr = qp + (r * H + h) * D;
      const float* kbase = kp + b * kb + g * kg;
      const float* vbase = vp + b * vb + g * vg;
      const bool* mr = mp ? mp + r * mcols : nullptr;
      const int64_t first = lp[r], last = hp[r];
      w.assign(last - first + 1, -std::numeric_limits<float>::infinity());
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t j = first; j <= last; ++j) {
        if (mr && !mr[j]) continue;
        const float s = dot(qr, kbase + j * ks, D) * sc;
        w[j - first] = s;
        mx = s > mx ? s : mx;
      }
      float* o = op + (r * H + h) * D;
      if (mx == -std::numeric_limits<float>::infinity()) continue;  // no key visible: zeros
      float total = 0.0f;
      for (int64_t j = first; j <= last; ++j) {
        if (mr && !mr[j]) continue;
        const float p = std::exp(w[j - first] - mx);
        w[j - first] = p;
        total += p;
        const float* vr = vbase + j * vs;
        for (int64_t d = 0; d < D; ++d) o[d] += p * vr[d];
      }
      const float inv = 1.0f / total;
      for (int64_t d = 0; d < D; ++d) o[d] *= inv;
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(mtpspec_attention, m) {
  m.def("attend_rows(Tensor q, Tensor k, Tensor v, Tensor seq, Tensor lo, Tensor hi, Tensor? mask, float scale) -> Tensor",
        &attend_rows);
}
