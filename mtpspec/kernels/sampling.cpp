// Passes over a large vocabulary's row that let sampling.py skip whole-row sorts and scores.
//
// leading_ids: the ids of every token whose logit is at least some threshold, at least k of them and few more: a
// prefix of the row's descending order, whatever the threshold, so top-p can be settled on them
// (sampling._prefix_nucleus). One pass takes the max; vectorized counts below it find a threshold with k to 8k tokens
// (k when ties leave no fewer); one pass collects them.
//
// gumbel_candidates: which tokens can win a Gumbel-max draw (sampling.gumbel_max): argmax_v p(v) / E(v),
// E(v) = -log u(v), u(v) the position-keyed SplitMix64 uniform of token v (sampling.gumbel_uniforms, the same integer
// arithmetic). Since -log u >= 1 - u on (0, 1), p(v) / (1 - u(v)) bounds token v's score from above. One pass hashes
// every token and takes that bound (the cost is the 64-bit hash, not a logarithm); the token with the largest bound is
// scored exactly; every token whose bound reaches that score (less a 1e-9 margin, far beyond the roundings) is a
// candidate. The winner is always one, and the caller scores the few candidates as it scores any support.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
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

at::Tensor ids_tensor(const std::vector<int64_t>& ids, const at::Tensor& like) {
  auto out = at::empty({static_cast<int64_t>(ids.size())}, like.options().dtype(at::kLong));
  std::copy(ids.begin(), ids.end(), out.data_ptr<int64_t>());
  return out;
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
  return ids_tensor(ids, probs);
}

typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

// How many of x[0..n) are >= r (16 lanes, a compare and an add per 16 tokens).
int64_t count_at_least(const float* x, int64_t n, float r) {
  const v16f rr = r - (v16f){};
  v16i acc = {0};
  int64_t v = 0;
  for (; v + 16 <= n; v += 16) {
    v16f a;
    std::memcpy(&a, x + v, 64);
    acc += (a >= rr);  // -1 where true
  }
  int64_t c = 0;
  for (int i = 0; i < 16; ++i) c -= acc[i];
  for (; v < n; ++v) c += x[v] >= r;
  return c;
}

at::Tensor leading_ids(const at::Tensor& logits, int64_t k) {
  TORCH_CHECK(logits.dim() == 1 && logits.scalar_type() == at::kFloat && logits.is_contiguous() && k >= 1,
              "leading_ids takes a contiguous (V,) float32 tensor and k >= 1");
  const int64_t n = logits.size(0);
  const float* x = logits.data_ptr<float>();
  v16f mx = -INFINITY - (v16f){};
  v16i nan = {0};
  int64_t v = 0;
  for (; v + 16 <= n; v += 16) {
    v16f a;
    std::memcpy(&a, x + v, 64);
    mx = a > mx ? a : mx;
    nan |= (a != a);
  }
  float top = -INFINITY;
  bool any_nan = false;
  for (int i = 0; i < 16; ++i) {
    top = mx[i] > top ? mx[i] : top;
    any_nan |= nan[i] != 0;
  }
  for (; v < n; ++v) {
    any_nan |= std::isnan(x[v]);
    top = x[v] > top ? x[v] : top;
  }
  if (any_nan || !std::isfinite(top)) return ids_tensor({}, logits);  // left to the caller's other ways
  // a threshold top - step with k to 8k tokens at or above it: step doubled from 2 logits, then bisected
  float lo = 0.0f, hi = INFINITY, step = 2.0f, r = top;
  int64_t c = 0;
  for (int it = 0; it < 40; ++it) {
    r = top - step;
    c = count_at_least(x, n, r);
    if (c < k) {
      if (!std::isfinite(r)) return ids_tensor({}, logits);  // fewer than k finite tokens
      lo = step;
      step = std::isfinite(hi) ? 0.5f * (lo + hi) : 2.0f * step;
    } else if (c > 8 * k && hi - lo > 1e-3f) {
      hi = step;
      step = 0.5f * (lo + hi);
    } else {
      break;
    }
  }
  if (c < k) return ids_tensor({}, logits);
  std::vector<int64_t> ids;
  ids.reserve(static_cast<size_t>(c));
  for (int64_t t = 0; t < n; ++t)
    if (x[t] >= r) ids.push_back(t);
  return ids_tensor(ids, logits);
}

}  // namespace

TORCH_LIBRARY(mtpspec_sampling, m) {
  m.def("gumbel_candidates(Tensor probs, int key) -> Tensor");
  m.def("leading_ids(Tensor logits, int k) -> Tensor");
}

TORCH_LIBRARY_IMPL(mtpspec_sampling, CPU, m) {
  m.impl("gumbel_candidates", &gumbel_candidates);
  m.impl("leading_ids", &leading_ids);
}
