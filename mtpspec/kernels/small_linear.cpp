// y = x @ W^T (+ bias) for a few rows of x: the decode step's and the verify pass's matrix products.
//
// At batch 1 a linear layer is a matrix-vector product: reading W is the whole cost. Row-major W read one
// output row at a time leaves this CPU's memory bandwidth mostly idle (MKL's sgemv read weights from memory at
// ~8 GB/s on the AMD EPYC this was measured on, this kernel at ~30), so W is stored in panels: (N/32, K, 32), panel p holding outputs 32p..32p+31 with each input
// column's 32 weights side by side. One pass streams W once, front to back, and every row of x reuses the
// panel from L1, so 2-5 rows cost little more than one.
//
// Each output is one FMA chain over k = 0..K-1 in order, whatever the number of rows, the row's place in
// the batch, the thread count or the vector width the compiler picks: the product is row-invariant
// (a row's result does not depend on what else shares the call), bitwise. bfloat16 weights are widened to
// float32 in registers (exactly, by integer ops) and read at half the bytes, or, where the CPU has AVX512_BF16,
// multiplied in pairs by vdpbf16ps (panel_pairs below). The panels are split between threads by at::parallel_for,
// which needs the extension built with -fopenmp (without it, it runs on the calling thread alone).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#ifdef __AVX512BF16__
#include <immintrin.h>
#endif

namespace {

constexpr int64_t P = 32;  // outputs per panel: two vectors of 16 floats, or four of 8
typedef float v8 __attribute__((vector_size(32)));
typedef float v16 __attribute__((vector_size(64)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

// One panel row's 32 weights as floats. fp32: in output order. bf16: pack() interleaves each 16 outputs as
// o0 o8 o1 o9 .. o7 o15, so a 32-bit word holds outputs i and i+8, and (a bfloat16 being the top half of a float)
// word << 16 is output i and word & 0xffff0000 output i+8, exactly: one load and two integer ops per 16 weights.
inline void row8(const float* p, v8& a, v8& b) { std::memcpy(&a, p, sizeof a); std::memcpy(&b, p + 8, sizeof b); }
inline void row8(const at::BFloat16* p, v8& a, v8& b) {  // a: outputs 0-7 of the 16, b: 8-15
  u32x8 w; std::memcpy(&w, p, sizeof w);
  const u32x8 lo = w << 16, hi = w & 0xffff0000u;
  std::memcpy(&a, &lo, sizeof a); std::memcpy(&b, &hi, sizeof b);
}
inline void row16(const float* p, v16& a, v16& b) { std::memcpy(&a, p, sizeof a); std::memcpy(&b, p + 16, sizeof b); }
inline void row16(const at::BFloat16* p, v16& a, v16& b) {  // a: outputs 0-7 and 16-23, b: 8-15 and 24-31
  u32x16 w; std::memcpy(&w, p, sizeof w);
  const u32x16 lo = w << 16, hi = w & 0xffff0000u;
  std::memcpy(&a, &lo, sizeof a); std::memcpy(&b, &hi, sizeof b);
}
// The 32 outputs of a 16-float pair (a, b) in order.
inline void outputs16(const v16& a, const v16& b, float* out, const float*) {
  std::memcpy(out, &a, sizeof a); std::memcpy(out + 16, &b, sizeof b);
}
inline void outputs16(const v16& a, const v16& b, float* out, const at::BFloat16*) {
  float fa[16], fb[16];
  std::memcpy(fa, &a, sizeof fa); std::memcpy(fb, &b, sizeof fb);
  std::memcpy(out, fa, 32); std::memcpy(out + 8, fb, 32); std::memcpy(out + 16, fa + 8, 32); std::memcpy(out + 24, fb + 8, 32);
}

// Rows m0..m0+G-1 of x against panel p: G x 32 accumulators, one FMA chain each, in 8-float vectors (1-3 rows: measured
// ~2% faster per demo step than the 16-float form) or 16-float ones (one AVX-512 register, or two AVX2 ones: more rows
// per pass). Each lane's arithmetic, and so every result, is the same in both forms.
template <int G, typename W>
void panel_rows8(const float* x, const W* w, const float* bias, float* y, int64_t K, int64_t N, int64_t p, int64_t m0) {
  v8 acc[G][4];
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < 4; ++j) acc[g][j] = v8{};
  const W* wp = w + p * K * P;
  for (int64_t k = 0; k < K; ++k) {
    const W* wk = wp + k * P;
    v8 w0, w1, w2, w3;
    row8(wk, w0, w1);
    row8(wk + 16, w2, w3);
    for (int g = 0; g < G; ++g) {
      const v8 xb = v8{} + x[(m0 + g) * K + k];
      acc[g][0] += w0 * xb;
      acc[g][1] += w1 * xb;
      acc[g][2] += w2 * xb;
      acc[g][3] += w3 * xb;
    }
  }
  const int64_t n0 = p * P, valid = std::min(P, N - n0);
  for (int g = 0; g < G; ++g) {
    float out[P];
    std::memcpy(out, acc[g], sizeof out);
    if (bias != nullptr)
      for (int64_t i = 0; i < valid; ++i) out[i] += bias[n0 + i];
    std::memcpy(y + (m0 + g) * N + n0, out, valid * sizeof(float));
  }
}

template <int G, typename W>
void panel_rows(const float* x, const W* w, const float* bias, float* y, int64_t K, int64_t N, int64_t p, int64_t m0) {
  v16 acc[G][2];
  for (int g = 0; g < G; ++g) { acc[g][0] = v16{}; acc[g][1] = v16{}; }
  const W* wp = w + p * K * P;
  // no software prefetch: the panel is one sequential stream, which the hardware prefetcher follows better
  // (prefetching 16 rows ahead measured 10-25% slower at 1-3 rows)
  for (int64_t k = 0; k < K; ++k) {
    const W* wk = wp + k * P;
    v16 w0, w1;
    row16(wk, w0, w1);
    for (int g = 0; g < G; ++g) {
      const v16 xb = v16{} + x[(m0 + g) * K + k];
      acc[g][0] += w0 * xb;
      acc[g][1] += w1 * xb;
    }
  }
  const int64_t n0 = p * P, valid = std::min(P, N - n0);
  for (int g = 0; g < G; ++g) {
    float out[P];
    outputs16(acc[g][0], acc[g][1], out, w);
    if (bias != nullptr)
      for (int64_t i = 0; i < valid; ++i) out[i] += bias[n0 + i];
    std::memcpy(y + (m0 + g) * N + n0, out, valid * sizeof(float));
  }
}

#ifdef __AVX512BF16__
// bfloat16 weights on a CPU with AVX512_BF16: vdpbf16ps multiplies 32 pairs of bfloat16 exactly and adds each pair of
// products into one of 16 float lanes, twice the multiply-adds per instruction of widening the weights and using FMAs,
// and x stays bfloat16 (no widening at all). pack() then lays each panel out as (ceil(K/2), 32, 2): for each pair of
// input columns (2j, 2j+1), every output's two weights side by side, so one 64-byte load is 16 outputs' pairs and one
// 32-bit broadcast is x's pair. Each output is one chain over j = 0..ceil(K/2)-1 in order, whatever the rows: the
// product stays row-invariant, bitwise (its roundings differ from the FMA chain's: this CPU's bf16 results are its own).
constexpr bool BF16_PAIRS = true;

template <int G>
void panel_pairs(const uint32_t* x, const at::BFloat16* w, const float* bias, float* y, int64_t K2, int64_t N, int64_t p, int64_t m0) {
  __m512 acc[G][2];
  for (int g = 0; g < G; ++g) { acc[g][0] = _mm512_setzero_ps(); acc[g][1] = _mm512_setzero_ps(); }
  const at::BFloat16* wp = w + p * K2 * 2 * P;
  for (int64_t j = 0; j < K2; ++j) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wp + j * 2 * P), w1 = (__m512bh)_mm512_loadu_si512(wp + j * 2 * P + P);
    for (int g = 0; g < G; ++g) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[(m0 + g) * K2 + j]));
      acc[g][0] = _mm512_dpbf16_ps(acc[g][0], w0, xb);
      acc[g][1] = _mm512_dpbf16_ps(acc[g][1], w1, xb);
    }
  }
  const int64_t n0 = p * P, valid = std::min(P, N - n0);
  for (int g = 0; g < G; ++g) {
    float out[P];
    _mm512_storeu_ps(out, acc[g][0]);
    _mm512_storeu_ps(out + 16, acc[g][1]);
    if (bias != nullptr)
      for (int64_t i = 0; i < valid; ++i) out[i] += bias[n0 + i];
    std::memcpy(y + (m0 + g) * N + n0, out, valid * sizeof(float));
  }
}

constexpr int GPAIRS = 8;  // 16 accumulators, 2 weights, 1 broadcast: 19 of the 32 registers

void run_pairs(const uint32_t* xp, const at::BFloat16* wp, const float* bp, float* yp, int64_t M, int64_t K2, int64_t n, int64_t NP) {
  at::parallel_for(0, NP, 4, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      int64_t m = 0;
      for (; m + GPAIRS <= M; m += GPAIRS) panel_pairs<GPAIRS>(xp, wp, bp, yp, K2, n, p, m);
      switch (M - m) {
        case 1: panel_pairs<1>(xp, wp, bp, yp, K2, n, p, m); break;
        case 2: panel_pairs<2>(xp, wp, bp, yp, K2, n, p, m); break;
        case 3: panel_pairs<3>(xp, wp, bp, yp, K2, n, p, m); break;
        case 4: panel_pairs<4>(xp, wp, bp, yp, K2, n, p, m); break;
        case 5: panel_pairs<5>(xp, wp, bp, yp, K2, n, p, m); break;
        case 6: panel_pairs<6>(xp, wp, bp, yp, K2, n, p, m); break;
        case 7: panel_pairs<7>(xp, wp, bp, yp, K2, n, p, m); break;
        default: break;
      }
    }
  });
}
#else
constexpr bool BF16_PAIRS = false;
#endif

#ifdef __AVX512F__
constexpr int GMAX = 6;  // 12 accumulators of 16 floats, 2 weights, 1 broadcast: 15 of the 32 registers
#else
constexpr int GMAX = 3;  // (each 16-float vector is two of AVX2's 16 registers)
#endif

template <typename W>
void run(const float* xp, const W* wp, const float* bp, float* yp, int64_t M, int64_t K, int64_t n, int64_t NP) {
  at::parallel_for(0, NP, 4, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      if (M <= 3) {
        if (M == 1) panel_rows8<1>(xp, wp, bp, yp, K, n, p, 0);
        else if (M == 2) panel_rows8<2>(xp, wp, bp, yp, K, n, p, 0);
        else panel_rows8<3>(xp, wp, bp, yp, K, n, p, 0);
        continue;
      }
      int64_t m = 0;
      for (; m + GMAX <= M; m += GMAX) panel_rows<GMAX>(xp, wp, bp, yp, K, n, p, m);
      switch (M - m) {
        case 1: panel_rows<1>(xp, wp, bp, yp, K, n, p, m); break;
        case 2: panel_rows<2>(xp, wp, bp, yp, K, n, p, m); break;
        case 3: panel_rows<3>(xp, wp, bp, yp, K, n, p, m); break;
        case 4: panel_rows<4>(xp, wp, bp, yp, K, n, p, m); break;
        case 5: panel_rows<5>(xp, wp, bp, yp, K, n, p, m); break;
        default: break;
      }
    }
  });
}

// x (M, K) and panels of one dtype, float32 or bfloat16; a bfloat16 call accumulates in float32 and rounds
// each output to bfloat16 once, at the end, as torch's bfloat16 matmul does.
// The fp32 results rounded to bfloat16 in place, kept as floats (widen: the LM head's logits, read in fp32 anyway).
void round_to_bf16(at::Tensor& y) {
  float* p = y.data_ptr<float>();
  const int64_t n = y.numel();
  for (int64_t i = 0; i < n; ++i) p[i] = static_cast<float>(c10::BFloat16(p[i]));  // round to nearest even
}

// widen (bfloat16 only): return the bfloat16-rounded outputs as float32, sparing the conversions (and the fresh
// pages of two more buffers) of y.to(bfloat16).to(float32): 3 ms of a 5-row step at the Qwen3.5-0.8B shape's head.
at::Tensor packed_linear(const at::Tensor& x_in, const at::Tensor& panels, int64_t n, const c10::optional<at::Tensor>& bias_in,
                         bool widen) {
  TORCH_CHECK(x_in.dim() == 2 && panels.dim() == 3, "packed_linear: x (M, K) and panels (N/32, K, 32), or (N/32, K/2, 64) for bf16 pairs");
  const auto dtype = panels.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && x_in.scalar_type() == dtype,
              "packed_linear: float32 only, or bfloat16 only (x and panels of one dtype)");
  const bool pairs = BF16_PAIRS && dtype == at::kBFloat16;
  const int64_t K = x_in.size(1);
  TORCH_CHECK((pairs ? panels.size(1) == (K + 1) / 2 && panels.size(2) == 2 * P : x_in.size(1) == panels.size(1) && panels.size(2) == P)
              && (n + P - 1) / P == panels.size(0), "packed_linear: shapes do not match");
  at::Tensor bias;
  if (bias_in.has_value() && bias_in->defined()) {
    TORCH_CHECK(bias_in->scalar_type() == dtype && bias_in->numel() == n, "packed_linear: bias (N,) of the weights' dtype");
    bias = bias_in->to(at::kFloat).contiguous();
  }
  const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
  const at::Tensor w = panels.contiguous();
  const int64_t M = x_in.size(0), NP = w.size(0);
  at::Tensor y = at::empty({M, n}, x_in.options().dtype(at::kFloat));
#ifdef __AVX512BF16__
  if (pairs) {  // x stays bfloat16, read as (M, ceil(K/2)) pairs: an odd K gets a zero column
    at::Tensor x = K % 2 == 0 ? x_in.contiguous() : at::constant_pad_nd(x_in, {0, 1}).contiguous();
    run_pairs(reinterpret_cast<const uint32_t*>(x.data_ptr<at::BFloat16>()), w.data_ptr<at::BFloat16>(), bp,
              y.data_ptr<float>(), M, (K + 1) / 2, n, NP);
    if (!widen) return y.to(dtype);
    round_to_bf16(y);
    return y;
  }
#endif
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  if (dtype == at::kFloat) run(x.data_ptr<float>(), w.data_ptr<float>(), bp, y.data_ptr<float>(), M, K, n, NP);
  else run(x.data_ptr<float>(), w.data_ptr<at::BFloat16>(), bp, y.data_ptr<float>(), M, K, n, NP);
  if (dtype == at::kFloat) return y;
  if (!widen) return y.to(dtype);
  round_to_bf16(y);
  return y;
}

// The panels' layout for bfloat16 weights: true when this build multiplies them in pairs (pack() asks once).
bool bf16_pairs() { return BF16_PAIRS; }

}  // namespace

TORCH_LIBRARY(mtpspec, m) {
  m.def("packed_linear(Tensor x, Tensor panels, int n, Tensor? bias, bool widen=False) -> Tensor");
  m.def("bf16_pairs() -> bool", &bf16_pairs);
}

TORCH_LIBRARY_IMPL(mtpspec, CPU, m) {
  m.impl("packed_linear", &packed_linear);
}
