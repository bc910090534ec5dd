// RMSNorm of a few rows in one call: y = x / sqrt(mean(x^2) + eps) * w (or * (1 + w), zero-centred norms).
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

namespace {

typedef float v16 __attribute__((vector_size(64)));

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
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = xp + r * d;
      float* o = op + r * d;
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
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(mtpspec_rownorm, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps, bool zero_centred) -> Tensor");
}

TORCH_LIBRARY_IMPL(mtpspec_rownorm, CPU, m) {
  m.impl("rms_norm", &rms_norm);
}
