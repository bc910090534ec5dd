// Which tokens can win a Gumbel-max draw (sampling.gumbel_max): argmax_v p(v) / E(v), E(v) = -log u(v), with u(v) the
// position-keyed SplitMix64 uniform of token v (sampling.gumbel_uniforms, the same integer arithmetic).
//
// Since -log u >= 1 - u on (0, 1), p(v) / (1 - u(v)) bounds token v's score from above. One pass hashes every token
// and takes that bound (the cost is the 64-bit hash, not a logarithm); the token with the largest bound is scored
// exactly; every token whose bound reaches that score (less a 1e-9 margin, far beyond the roundings) is a candidate.
// The winner is always one, and the caller scores the few candidates as it scores any support.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr uint64_t GOLDEN = 0x9E3779B97F4A7C15ull, MIX1 = 0xBF58476D1CE4E5B9ull, MIX2 = 0x94D049BB133111EBull;

inline double uniform(uint64_t key, uint64_t v) {
  uint64_t z = (v + 1) * GOLDEN + key;
  z = (z ^ (z >> 30)) * MIX1;
  z = (z ^ (z >> 27)) * MIX2;
  z ^= z >> 31;
  return (static_cast<double>(z >> 12) + 0.5) * 0x1p-52;  // (0, 1), never 0 or 1
}

at::Tensor gumbel_candidates(const at::Tensor& probs, int64_t key) {
  TORCH_CHECK(probs.dim() == 1 && probs.scalar_type() == at::kFloat && probs.is_contiguous(),
              "gumbel_candidates takes a contiguous (V,) float32 tensor");
  const int64_t n = probs.size(0);
  const float* p = probs.data_ptr<float>();
  const uint64_t k = static_cast<uint64_t>(key);
  std::vector<double> bound(n);
  for (int64_t v = 0; v < n; ++v) bound[v] = static_cast<double>(p[v]) / (1.0 - uniform(k, v));  // p = 0: 0
  int64_t top = 0;
  for (int64_t v = 1; v < n; ++v) top = bound[v] > bound[top] ? v : top;
  const double best = static_cast<double>(p[top]) / -std::log(uniform(k, top));  // a score reached: the max is >= it
  const double floor = best * (1.0 - 1e-9);
  std::vector<int64_t> ids;
  for (int64_t v = 0; v < n; ++v)
    if (p[v] > 0 && bound[v] >= floor) ids.push_back(v);
  auto out = at::empty({static_cast<int64_t>(ids.size())}, probs.options().dtype(at::kLong));
  std::copy(ids.begin(), ids.end(), out.data_ptr<int64_t>());
  return out;
}

}  // namespace

TORCH_LIBRARY(mtpspec_noise, m) { m.def("gumbel_candidates(Tensor probs, int key) -> Tensor"); }

TORCH_LIBRARY_IMPL(mtpspec_noise, CPU, m) { m.impl("gumbel_candidates", &gumbel_candidates); }
