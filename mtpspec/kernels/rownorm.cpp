// RMSNorm of a few rows in one call (and, for attention, with the rotary embedding after it):
// y = x / sqrt(mean(x^2) + eps) * w (or * (1 + w), zero-centred norms).
//
// One torch call in place of the six a norm takes in eager torch (the decode step of a small quantized model is
// dispatch-bound), and row-invariant by construction: each row's sum of squares accumulates in 16 fixed lanes (a GCC
// vector, the same per-lane operations on AVX-512, AVX2 or scalar code) summed by a fixed tree, then one division,
// one square root and two products per element, built with -ffp-contract=off.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

typedef float v16 __attribute__((vector_size(64)));

// One row's norm: o = x / sqrt(mean(x^2) + eps) * w (or * (1 + w)), the sum of squares in 16 fixed lanes.
inline void norm_row(const float* xr, int64_t d, const float* wp, float e, bool zero_centred, float* o) {
  v16 acc = {0};
  int64_t i = 0;
  for (; i + 16 <= d; i += 16) {
    v16 v;
    std::memcpy(&v, xr + i, 64);
    acc += v * v;
  }
  for (; i < d; ++i) acc[i & 15] += xr[i] * xr[i];
  for (int s = 8; s >= 1; s /= 2)
    for (int l = 0; l < s; ++l) acc[l] += acc[l + s];
  const float inv = 1.0f / std::sqrt(acc[0] / static_cast<float>(d) + e);
  for (int64_t j = 0; j < d; ++j) o[j] = (xr[j] * inv) * (zero_centred ? 1.0f + wp[j] : wp[j]);
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps, bool zero_centred) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "rms_norm: float32 x and w");
  const int64_t d = x.size(-1);
  TORCH_CHECK(w.dim() == 1 && w.size(0) == d, "rms_norm: w (", d, ",)");
  auto xc = x.contiguous();
  auto wc = w.contiguous();
  auto out = at::empty_like(xc);
  const int64_t rows = d ? xc.numel() / d : 0;
  const float* xp = xc.data_ptr<float>();
  const float* wp = wc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) norm_row(xp + r * d, d, wp, e, zero_centred, op + r * d);
  });
  return out;
}

// Each head of each row normed (rms_norm's arithmetic; no w: as it is) and rotated on its first `rot` dims in the
// half-split layout with that row's cos / sin: o = n * cos + rotate_half(n) * sin, a product, a product and a sum per
// element, as torch computes them one op at a time. x (N, h, hd) with unit stride inside a head (a column slice of a
// fused q|k|v product), cos / sin (N, rot) -> (N, h, hd) contiguous.
at::Tensor norm_rope(const at::Tensor& x, const c10::optional<at::Tensor>& w, double eps, bool zero_centred,
                     const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat && x.stride(2) == 1, "norm_rope: float32 x (N, h, hd), unit stride inside a head");
  const int64_t n = x.size(0), h = x.size(1), d = x.size(2), rot = cos.size(-1);
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == n && sin.sizes() == cos.sizes() && rot <= d && rot % 2 == 0 &&
              cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat, "norm_rope: float32 cos / sin (N, rot), rot even and <= hd");
  at::Tensor wc;
  if (w.has_value()) {
    wc = w->contiguous();
    TORCH_CHECK(wc.scalar_type() == at::kFloat && wc.dim() == 1 && wc.size(0) == d, "norm_rope: float32 w (", d, ",)");
  }
  const auto cc = cos.contiguous(), sc = sin.contiguous();
  auto out = at::empty({n, h, d}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.has_value() ? wc.data_ptr<float>() : nullptr;
  const float *cp = cc.data_ptr<float>(), *sp = sc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t s0 = x.stride(0), s1 = x.stride(1), half = rot / 2;
  const float e = static_cast<float>(eps);
  at::parallel_for(0, n * h, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> nrm(d);
    for (int64_t r = begin; r < end; ++r) {
      const int64_t i = r / h;
      const float* xr = xp + i * s0 + (r % h) * s1;
      if (wp) norm_row(xr, d, wp, e, zero_centred, nrm.data());
      else std::memcpy(nrm.data(), xr, d * sizeof(float));
      const float *c = cp + i * rot, *s = sp + i * rot;
      float* o = op + r * d;
      for (int64_t j = 0; j < half; ++j) o[j] = nrm[j] * c[j] + (-nrm[j + half]) * s[j];
      for (int64_t j = half; j < rot; ++j) o[j] = nrm[j] * c[j] + nrm[j - half] * s[j];
      for (int64_t j = rot; j < d; ++j) o[j] = nrm[j];
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(mtpspec_rownorm, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps, bool zero_centred) -> Tensor");
  m.def("norm_rope(Tensor x, Tensor? w, float eps, bool zero_centred, Tensor cos, Tensor sin) -> Tensor");
}

TORCH_LIBRARY_IMPL(mtpspec_rownorm, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("norm_rope", &norm_rope);
}
