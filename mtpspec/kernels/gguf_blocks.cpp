// y = x @ W^T for a few rows of x, W kept in its GGUF block type (Q8_0, Q4_0, Q5_0, Q4_K, Q5_K, Q6_K).
//
// Layout: pack() re-lays W out in panels of 16 outputs, (ceil(N/16), K/bs, block bytes): for each weight block (32 or
// 256 inputs) the 16 outputs' scales side by side, then per 32 inputs one tile of quants, 4 consecutive inputs of
// one output in one 32-bit word, the 16 outputs' words in a row (one 64-byte vector per 4 inputs: a VNNI vpdpbusd
// against a broadcast word of the activation gives the 16 outputs' 4-term integer dots in its 16 lanes). 4-bit values
// are nibbles (inputs 4g..4g+3 low, 4g+16.. high), a 5th/6th bit one 64-bit mask per 4 inputs. Bytes per block
// equal the GGUF file's, except Q4_K/Q5_K (scales unpacked to one byte each: +2-3%).
//
// Each row of x is quantized to 8 bits per 32 inputs (fp32 scale dx = max|x|/127, q = round(x/dx), and the sums of q
// per 16), row by row; each 32-input tile then adds, per output lane, float(integer dot) * (weight scale * dx) to an
// fp32 accumulator, tiles in order. The integer dots are exact and the float steps are the same two roundings in the
// AVX-512 VNNI, AVX2 and scalar paths (built with -ffp-contract=off, no FMA), so an output is the same number whatever
// the rows sharing the call, the thread count or the instruction set: row-invariant, bitwise.
//
// linear_many() runs several weights that read the same x (mixed block types) as one product: x quantized once, one
// split of all their panels between the threads, outputs side by side; each output bitwise what linear() gives.
//
// dequantize() reads the panels back to fp32 with ggml's formulas in numpy's operation order (gguf.quants): exact.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>
#if defined(__SSE2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t L = 16;           // outputs per panel
constexpr int GROWS = 10;           // most rows of x per pass over a panel: their accumulators stay in registers
constexpr int64_t PREFETCH = 2048;  // bytes ahead of the block being read

enum : int64_t { T_Q4_0 = 2, T_Q5_0 = 6, T_Q8_0 = 8, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14 };

struct Info {
  int64_t bs, raw, head, tile;  // inputs per block, GGUF bytes per block, packed header and tile bytes (16 outputs)
  int bits, off;                // bits per quant, offset subtracted from the unsigned quant (Q8_0: signed, 0)
  int64_t block() const { return head + bs / 32 * tile; }
};

constexpr Info info(int64_t t) {
  return t == T_Q8_0   ? Info{32, 34, 32, 512, 8, 0}
         : t == T_Q4_0 ? Info{32, 18, 32, 256, 4, 8}
         : t == T_Q5_0 ? Info{32, 22, 32, 320, 5, 16}
         : t == T_Q4_K ? Info{256, 144, 320, 256, 4, 0}
         : t == T_Q5_K ? Info{256, 176, 320, 320, 5, 0}
         : t == T_Q6_K ? Info{256, 210, 288, 384, 6, 32}
                       : Info{0, 0, 0, 0, 0, 0};
}

void check_type(int64_t t) {
  TORCH_CHECK(info(t).bs != 0, "gguf kernels: block type ", t, " is not one of Q4_0 (2), Q5_0 (6), Q8_0 (8), Q4_K (12), Q5_K (13), Q6_K (14)");
}

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
}

// ---- GGUF block -> unsigned quants u[bs] and scales (ggml's layouts, as gguf.quants reads them) ----

struct Decoded {
  uint8_t d[2], dmin[2];
  uint8_t sc[16], mn[8];  // K-quants: 6-bit scales and mins per 32 (Q6_K: int8 scales per 16)
  uint8_t u[256];         // Q8_0: the signed int8 byte
};

inline void scale_min_k4(const uint8_t* s, int j, uint8_t& sc, uint8_t& m) {
  if (j < 4) {
    sc = s[j] & 63;
    m = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
    m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

void decode(int64_t t, const uint8_t* b, Decoded& o) {
  switch (t) {
    case T_Q8_0:
      std::memcpy(o.d, b, 2);
      std::memcpy(o.u, b + 2, 32);
      break;
    case T_Q4_0:
      std::memcpy(o.d, b, 2);
      for (int k = 0; k < 32; ++k) o.u[k] = k < 16 ? b[2 + k] & 15 : b[2 + k - 16] >> 4;
      break;
    case T_Q5_0: {
      std::memcpy(o.d, b, 2);
      uint32_t qh;
      std::memcpy(&qh, b + 2, 4);
      for (int k = 0; k < 32; ++k) o.u[k] = (k < 16 ? b[6 + k] & 15 : b[6 + k - 16] >> 4) | (((qh >> k) & 1) << 4);
      break;
    }
    case T_Q4_K:
    case T_Q5_K: {
      std::memcpy(o.d, b, 2);
      std::memcpy(o.dmin, b + 2, 2);
      for (int j = 0; j < 8; ++j) scale_min_k4(b + 4, j, o.sc[j], o.mn[j]);
      const uint8_t* qh = b + 16;
      const uint8_t* qs = t == T_Q4_K ? b + 16 : b + 48;
      for (int j = 0; j < 8; ++j)
        for (int e = 0; e < 32; ++e) {
          uint8_t v = (qs[32 * (j / 2) + e] >> (4 * (j % 2))) & 15;
          if (t == T_Q5_K) v |= ((qh[e] >> j) & 1) << 4;
          o.u[32 * j + e] = v;
        }
      break;
    }
    case T_Q6_K: {
      const uint8_t *ql = b, *qh = b + 128;
      std::memcpy(o.sc, b + 192, 16);
      std::memcpy(o.d, b + 208, 2);
      for (int i = 0; i < 256; ++i) {
        const int a = i / 128, h = (i % 128) / 64, tt = i % 64, s = (i % 128) / 32, e = i % 32;
        o.u[i] = ((ql[64 * a + tt] >> (4 * h)) & 15) | (((qh[32 * a + e] >> (2 * s)) & 3) << 4);
      }
      break;
    }
    default: TORCH_CHECK(false, "gguf kernels: unknown block type ", t);
  }
}

// ---- the packed tile: 32 inputs x 16 outputs ----

// byte of input k (0..31), output o in a tile of `bits`-bit quants
inline uint8_t tile_get(const uint8_t* tile, int bits, int o, int k) {
  const int g = k / 4, i = k % 4;
  if (bits == 8) return tile[g * 64 + o * 4 + i];
  uint8_t v = g < 4 ? tile[g * 64 + o * 4 + i] & 15 : tile[(g - 4) * 64 + o * 4 + i] >> 4;
  for (int extra = 0; extra < bits - 4; ++extra) {
    uint64_t m;
    std::memcpy(&m, tile + 256 + 64 * extra + 8 * g, 8);
    v |= ((m >> (o * 4 + i)) & 1) << (4 + extra);
  }
  return v;
}

inline void tile_put(uint8_t* tile, int bits, int o, int k, uint8_t v) {
  const int g = k / 4, i = k % 4;
  if (bits == 8) {
    tile[g * 64 + o * 4 + i] = v;
    return;
  }
  if (g < 4) tile[g * 64 + o * 4 + i] |= v & 15;
  else tile[(g - 4) * 64 + o * 4 + i] |= (v & 15) << 4;
  for (int extra = 0; extra < bits - 4; ++extra) {
    uint64_t m;
    std::memcpy(&m, tile + 256 + 64 * extra + 8 * g, 8);
    m |= static_cast<uint64_t>((v >> (4 + extra)) & 1) << (o * 4 + i);
    std::memcpy(tile + 256 + 64 * extra + 8 * g, &m, 8);
  }
}

// raw (N, K/bs * raw bytes) -> panels (ceil(N/16), K/bs, block bytes); outputs past N are zero (scale 0)
at::Tensor pack(const at::Tensor& raw_in, int64_t t, int64_t N, int64_t K) {
  check_type(t);
  const Info I = info(t);
  TORCH_CHECK(K % I.bs == 0, "gguf pack: K=", K, " is not a multiple of the block size ", I.bs);
  const int64_t nb = K / I.bs;
  TORCH_CHECK(raw_in.scalar_type() == at::kByte && raw_in.numel() == N * nb * I.raw, "gguf pack: expected ", N * nb * I.raw,
              " uint8 bytes for (", N, ", ", K, "), got ", raw_in.numel());
  const at::Tensor raw = raw_in.contiguous();
  const uint8_t* rp = raw.data_ptr<uint8_t>();
  const int64_t NP = (N + L - 1) / L, bb = I.block();
  at::Tensor out = at::zeros({NP, nb, bb}, raw.options());
  uint8_t* op = out.data_ptr<uint8_t>();
  at::parallel_for(0, NP, 16, [&](int64_t p0, int64_t p1) {
    Decoded d;
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t o = 0; o < L && p * L + o < N; ++o)
        for (int64_t b = 0; b < nb; ++b) {
          decode(t, rp + ((p * L + o) * nb + b) * I.raw, d);
          uint8_t* blk = op + (p * nb + b) * bb;
          std::memcpy(blk + 2 * o, d.d, 2);
          if (t == T_Q4_K || t == T_Q5_K) {
            std::memcpy(blk + 32 + 2 * o, d.dmin, 2);
            for (int j = 0; j < 8; ++j) {
              blk[64 + 16 * j + o] = d.sc[j];
              blk[192 + 16 * j + o] = d.mn[j];
            }
          } else if (t == T_Q6_K) {
            for (int j = 0; j < 16; ++j) blk[32 + 16 * j + o] = d.sc[j];
          }
          for (int64_t k = 0; k < I.bs; ++k) tile_put(blk + I.head + k / 32 * I.tile, I.bits, o, k % 32, d.u[k]);
        }
  });
  return out;
}

// panels -> fp32 rows (all N, or the rows `ids`), each value as gguf.quants.dequantize computes it
at::Tensor dequantize(const at::Tensor& data, int64_t t, int64_t N, int64_t K, const c10::optional<at::Tensor>& ids_in) {
  check_type(t);
  const Info I = info(t);
  const int64_t nb = K / I.bs, bb = I.block(), NP = (N + L - 1) / L;
  TORCH_CHECK(K % I.bs == 0 && data.scalar_type() == at::kByte && data.numel() == NP * nb * bb, "gguf dequantize: data does not hold (",
              N, ", ", K, ") in packed blocks of this type");
  const at::Tensor w = data.contiguous();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  at::Tensor ids = ids_in.has_value() && ids_in->defined() ? ids_in->to(at::kLong).contiguous().view({-1}) : at::arange(N, at::kLong);
  const int64_t R = ids.size(0);
  const int64_t* ip = ids.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) TORCH_CHECK(ip[r] >= 0 && ip[r] < N, "gguf dequantize: row id ", ip[r], " outside 0..", N - 1);
  at::Tensor y = at::empty({R, K}, at::kFloat);
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, R, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t n = ip[r], p = n / L;
      const int o = static_cast<int>(n % L);
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = wp + (p * nb + b) * bb;
        const float d = half_at(blk + 2 * o);
        float* out = yp + r * K + b * I.bs;
        for (int64_t k = 0; k < I.bs; ++k) {
          const uint8_t u = tile_get(blk + I.head + k / 32 * I.tile, I.bits, o, static_cast<int>(k % 32));
          float v;
          if (t == T_Q8_0) v = static_cast<float>(static_cast<int8_t>(u)) * d;
          else if (t == T_Q4_0 || t == T_Q5_0) v = d * static_cast<float>(static_cast<int>(u) - I.off);
          else if (t == T_Q6_K) v = (d * static_cast<float>(static_cast<int8_t>(blk[32 + 16 * (k / 16) + o]))) * static_cast<float>(static_cast<int>(u) - 32);
          else {
            const int j = static_cast<int>(k / 32);
            const float dmin = half_at(blk + 32 + 2 * o);
            v = (d * static_cast<float>(blk[64 + 16 * j + o])) * static_cast<float>(u) - dmin * static_cast<float>(blk[192 + 16 * j + o]);
          }
          out[k] = v;
        }
      }
    }
  });
  return y;
}

// ---- 16 lanes (one per output of the panel), lowered to whatever vectors the CPU has ----

typedef float f16v __attribute__((vector_size(64)));
typedef int32_t i16v __attribute__((vector_size(64)));
typedef uint8_t u8x16 __attribute__((vector_size(16)));
typedef int8_t i8x16 __attribute__((vector_size(16)));

inline f16v halves(const uint8_t* p) {
  f16v v;
#if defined(__AVX512F__)
  const __m512 f = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));  // one register, no stack
  std::memcpy(&v, &f, 64);
#elif defined(__F16C__)
  __m128i a, b;
  std::memcpy(&a, p, 16);
  std::memcpy(&b, p + 16, 16);
  const __m256 fa = _mm256_cvtph_ps(a), fb = _mm256_cvtph_ps(b);
  std::memcpy(&v, &fa, 32);
  std::memcpy(reinterpret_cast<char*>(&v) + 32, &fb, 32);
#else
  for (int o = 0; o < 16; ++o) v[o] = half_at(p + 2 * o);
#endif
  return v;
}
// 16 bytes widened to 16 lanes (the compiler's own lowering of __builtin_convertvector here is scalar inserts)
inline i16v bytes_i(const uint8_t* p) {
  i16v v;
#if defined(__AVX512F__)
  __m128i b;
  std::memcpy(&b, p, 16);
  const __m512i w = _mm512_cvtepi8_epi32(b);
  std::memcpy(&v, &w, 64);
#elif defined(__AVX2__)
  __m128i b;
  std::memcpy(&b, p, 16);
  const __m256i lo = _mm256_cvtepi8_epi32(b), hi = _mm256_cvtepi8_epi32(_mm_srli_si128(b, 8));
  std::memcpy(&v, &lo, 32);
  std::memcpy(reinterpret_cast<char*>(&v) + 32, &hi, 32);
#else
  i8x16 c;
  std::memcpy(&c, p, 16);
  v = __builtin_convertvector(c, i16v);
#endif
  return v;
}
inline f16v bytes_u(const uint8_t* p) {
#if defined(__AVX512F__)
  __m128i b;
  std::memcpy(&b, p, 16);
  const __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b));
  f16v v;
  std::memcpy(&v, &w, 64);
  return v;
#elif defined(__AVX2__)
  __m128i b;
  std::memcpy(&b, p, 16);
  const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)), hi = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8)));
  f16v v;
  std::memcpy(&v, &lo, 32);
  std::memcpy(reinterpret_cast<char*>(&v) + 32, &hi, 32);
  return v;
#else
  u8x16 c;
  std::memcpy(&c, p, 16);
  return __builtin_convertvector(c, f16v);
#endif
}
inline f16v tof(i16v v) { return __builtin_convertvector(v, f16v); }

// Integer dots of one tile: dot(w, x, g0, g1) = per output, sum over inputs 4*g0..4*g1-1 of q * x, where q is the
// int8 quant for Q8_0 and the unsigned quant otherwise. Q8_BIAS: what the VNNI path adds to Q8_0 quants (caller
// subtracts Q8_BIAS * sum(x)).
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr int Q8_BIAS = 128;  // vpdpbusd multiplies unsigned weights by signed activations: q + 128 is unsigned
const char* ISA = "avx512vnni";
struct Tile { __m512i v[8]; };

template <int BITS>
inline void unpack(const uint8_t* t, Tile& w) {
  if (BITS == 8) {
    for (int g = 0; g < 8; ++g) w.v[g] = _mm512_xor_si512(_mm512_loadu_si512(t + 64 * g), _mm512_set1_epi8(static_cast<char>(0x80)));
    return;
  }
  const __m512i lo = _mm512_set1_epi8(15);
  for (int g = 0; g < 4; ++g) {
    const __m512i v = _mm512_loadu_si512(t + 64 * g);
    w.v[g] = _mm512_and_si512(v, lo);
    w.v[g + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo);
  }
  for (int extra = 0; extra < BITS - 4; ++extra) {
    const __m512i bit = _mm512_set1_epi8(static_cast<char>(16 << extra));
    for (int g = 0; g < 8; ++g) {
      uint64_t m;
      std::memcpy(&m, t + 256 + 64 * extra + 8 * g, 8);
      w.v[g] = _mm512_mask_add_epi8(w.v[g], _cvtu64_mask64(m), w.v[g], bit);  // the bit is clear before: + is |
    }
  }
}

template <bool Q8>
inline i16v dot(const Tile& w, const int8_t* x, int g0, int g1) {
  // two independent chains (integer sums: any order gives the same result), half the latency of one
  __m512i acc0 = _mm512_setzero_si512(), acc1 = _mm512_setzero_si512();
  for (int g = g0; g < g1; g += 2) {
    int32_t x0, x1;
    std::memcpy(&x0, x + 4 * g, 4);
    std::memcpy(&x1, x + 4 * g + 4, 4);
    acc0 = _mm512_dpbusd_epi32(acc0, w.v[g], _mm512_set1_epi32(x0));
    acc1 = _mm512_dpbusd_epi32(acc1, w.v[g + 1], _mm512_set1_epi32(x1));
  }
  const __m512i acc = _mm512_add_epi32(acc0, acc1);
  i16v r;
  std::memcpy(&r, &acc, 64);
  return r;
}

// io[r] += dot(w, x[r], g0, g1) for G rows, the rows' vpdpbusd interleaved: G independent chains keep the VNNI unit
// busy where one row's chain would wait on its latency (integer sums: the same result as dot, row by row)
#define MTPSPEC_INTERLEAVED 1
template <int G, bool Q8>
inline void dot_interleaved(const Tile& w, const int8_t* const* x, int g0, int g1, i16v* io) {
  __m512i acc[G];
#pragma GCC unroll 10
  for (int r = 0; r < G; ++r) std::memcpy(&acc[r], &io[r], 64);
  for (int g = g0; g < g1; ++g) {
#pragma GCC unroll 10
    for (int r = 0; r < G; ++r) {
      int32_t xv;
      std::memcpy(&xv, x[r] + 4 * g, 4);
      acc[r] = _mm512_dpbusd_epi32(acc[r], w.v[g], _mm512_set1_epi32(xv));
    }
  }
#pragma GCC unroll 10
  for (int r = 0; r < G; ++r) std::memcpy(&io[r], &acc[r], 64);
}
#elif defined(__AVX2__)
constexpr int Q8_BIAS = 0;
const char* ISA = "avx2";
struct Tile { __m256i v[16]; };  // group g: v[2g] outputs 0-7, v[2g+1] outputs 8-15

inline __m256i bits_to_bytes(uint32_t m) {  // byte j = 0xff where bit j of m is set
  const __m256i shuf = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m256i sel = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ULL));
  const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(m)), shuf);
  return _mm256_cmpeq_epi8(_mm256_and_si256(v, sel), sel);
}

template <int BITS>
inline void unpack(const uint8_t* t, Tile& w) {
  if (BITS == 8) {
    for (int h = 0; h < 16; ++h) w.v[h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + 32 * h));
    return;
  }
  const __m256i lo = _mm256_set1_epi8(15);
  for (int h = 0; h < 8; ++h) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + 32 * h));
    w.v[h] = _mm256_and_si256(v, lo);
    w.v[h + 8] = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo);
  }
  for (int extra = 0; extra < BITS - 4; ++extra) {
    const __m256i bit = _mm256_set1_epi8(static_cast<char>(16 << extra));
    for (int g = 0; g < 8; ++g) {
      uint64_t m;
      std::memcpy(&m, t + 256 + 64 * extra + 8 * g, 8);
      w.v[2 * g] = _mm256_or_si256(w.v[2 * g], _mm256_and_si256(bits_to_bytes(static_cast<uint32_t>(m)), bit));
      w.v[2 * g + 1] = _mm256_or_si256(w.v[2 * g + 1], _mm256_and_si256(bits_to_bytes(static_cast<uint32_t>(m >> 32)), bit));
    }
  }
}

template <bool Q8>
inline i16v dot(const Tile& w, const int8_t* x, int g0, int g1) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i a0 = _mm256_setzero_si256(), a1 = _mm256_setzero_si256();
  for (int g = g0; g < g1; g += 2) {
    int32_t xv0, xv1;
    std::memcpy(&xv0, x + 4 * g, 4);
    std::memcpy(&xv1, x + 4 * g + 4, 4);
    const __m256i xb0 = _mm256_set1_epi32(xv0), xb1 = _mm256_set1_epi32(xv1);
    const __m256i w00 = w.v[2 * g], w01 = w.v[2 * g + 1], w10 = w.v[2 * g + 2], w11 = w.v[2 * g + 3];
    // maddubs saturates at 16 bits: int8 quants go in as |q| against x with q's sign (2 * 128 * 127 fits); 4-bit
    // to 6-bit quants as they are (2 * 63 * 127 fits), two inputs' pairs summed in 16 bits (4 * 63 * 127 fits)
    __m256i p0, p1;
    if (Q8) {
      p0 = _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w00, w00), _mm256_sign_epi8(xb0, w00)), ones),
                            _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w10, w10), _mm256_sign_epi8(xb1, w10)), ones));
      p1 = _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w01, w01), _mm256_sign_epi8(xb0, w01)), ones),
                            _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w11, w11), _mm256_sign_epi8(xb1, w11)), ones));
    } else {
      p0 = _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(w00, xb0), _mm256_maddubs_epi16(w10, xb1)), ones);
      p1 = _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(w01, xb0), _mm256_maddubs_epi16(w11, xb1)), ones);
    }
    a0 = _mm256_add_epi32(a0, p0);
    a1 = _mm256_add_epi32(a1, p1);
  }
  i16v r;
  std::memcpy(&r, &a0, 32);
  std::memcpy(reinterpret_cast<char*>(&r) + 32, &a1, 32);
  return r;
}
#else
constexpr int Q8_BIAS = 0;
const char* ISA = "scalar";
struct Tile { uint8_t u[8][64]; };  // [group][output * 4 + input]

template <int BITS>
inline void unpack(const uint8_t* t, Tile& w) {
  for (int o = 0; o < 16; ++o)
    for (int k = 0; k < 32; ++k) w.u[k / 4][o * 4 + k % 4] = tile_get(t, BITS, o, k);
}

template <bool Q8>
inline i16v dot(const Tile& w, const int8_t* x, int g0, int g1) {
  i16v r;
  for (int o = 0; o < 16; ++o) {
    int32_t s = 0;
    for (int g = g0; g < g1; ++g)
      for (int i = 0; i < 4; ++i) s += (Q8 ? static_cast<int32_t>(static_cast<int8_t>(w.u[g][o * 4 + i])) : static_cast<int32_t>(w.u[g][o * 4 + i])) * x[4 * g + i];
    r[o] = s;
  }
  return r;
}
#endif

// ---- activations: 8 bits per 32 inputs ----

// One row's 32 inputs as the kernels read them: the quants, their scale, and what each weight type's integer dot
// starts from (its offset times the quants' sum, worked out once per row, not once per panel). Stored
// block-major, block kb of row m at kb * M + m: the rows of a pass over a tile sit side by side, one base pointer.
struct alignas(64) XBlock {
  int8_t q[32];
  float d;           // dx = max|x| / 127
  float sum;         // sum of q, as a float (the Q4_K / Q5_K min term)
  int32_t start[5];  // -off * sum of q: Q8_0 (the VNNI bias), Q4_0, Q5_0; Q6_K: -32 * sum over inputs 0-15, 16-31
};
enum { S_Q8_0, S_Q4_0, S_Q5_0, S_Q6_LO, S_Q6_HI };

struct Act {
  const XBlock* b;  // (K / 32, M)
  int64_t M, K;
};

void quantize_rows(const float* x, int64_t M, int64_t K, XBlock* out) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t kb = 0; kb < K / 32; ++kb) {
      const float* xb = x + m * K + kb * 32;
      XBlock& o = out[kb * M + m];
      float amax = 0.0f;
      for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(xb[i]));
      const float db = amax / 127.0f, id = db != 0.0f ? 1.0f / db : 0.0f;
      int32_t s0 = 0, s1 = 0;
      for (int i = 0; i < 32; ++i) {
        const float v = std::nearbyint(xb[i] * id);
        const int8_t qi = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, v)));
        o.q[i] = qi;
        (i < 16 ? s0 : s1) += qi;
      }
      const int32_t sum = s0 + s1;
      o.d = db;
      o.sum = static_cast<float>(sum);
      o.start[S_Q8_0] = -Q8_BIAS * sum;
      o.start[S_Q4_0] = -info(T_Q4_0).off * sum;
      o.start[S_Q5_0] = -info(T_Q5_0).off * sum;
      o.start[S_Q6_LO] = -info(T_Q6_K).off * s0;
      o.start[S_Q6_HI] = -info(T_Q6_K).off * s1;
    }
}

// io[r] += dot(w, x[r], g0, g1) for G rows: interleaved where the ISA has it and 3+ rows hide its latency, else row by
// row (each row's own chains, dot)
template <int G, bool Q8>
inline void dot_rows(const Tile& w, const int8_t* const* x, int g0, int g1, i16v* io) {
#ifdef MTPSPEC_INTERLEAVED
  if (G >= 3) return dot_interleaved<G, Q8>(w, x, g0, g1, io);
#endif
  for (int r = 0; r < G; ++r) io[r] += dot<Q8>(w, x[r], g0, g1);
}

// Rows m0..m0+G-1 of x against panel p of an N-output weight, into y (row stride ldy, this weight's first column):
// per output lane, tiles in order, acc += float(isum) * scale (Q4_K/Q5_K: then acc -= float(sum x) * min scale). G, the
// exact row count at compile time, lets the row loops unroll and the accumulators stay in registers; the arithmetic
// of a row is the same whatever G.
template <int64_t T, int G>
void panel_rows(const Act& a, const uint8_t* w, float* y, int64_t N, int64_t ldy, int64_t p, int64_t m0) {
  constexpr Info I = info(T);
  constexpr bool KQ = T == T_Q4_K || T == T_Q5_K;
  const int64_t nb = a.K / I.bs;
  f16v acc[G];
#pragma GCC unroll 10
  for (int r = 0; r < G; ++r) acc[r] = f16v{};
  const uint8_t* wp = w + p * nb * I.block();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = wp + b * I.block();
#if defined(__SSE2__)
    for (int64_t c = 0; c < I.block(); c += 64) _mm_prefetch(reinterpret_cast<const char*>(blk + PREFETCH + c), _MM_HINT_T0);
#endif
    const f16v d = halves(blk);
    f16v dmin{};
    if (KQ) dmin = halves(blk + 32);
    for (int64_t t = 0; t < I.bs / 32; ++t) {
      Tile tw;
      unpack<I.bits>(blk + I.head + t * I.tile, tw);
      const int64_t kb = b * (I.bs / 32) + t;  // activation block
      f16v ws = d, wm{};
      i16v sa{}, sb{};
      if (KQ) {
        ws = d * bytes_u(blk + 64 + 16 * t);
        wm = dmin * bytes_u(blk + 192 + 16 * t);
      }
      if (T == T_Q6_K) {
        sa = bytes_i(blk + 32 + 16 * (2 * t));
        sb = bytes_i(blk + 32 + 16 * (2 * t + 1));
      }
      const XBlock* xb = a.b + kb * a.M + m0;  // the G rows' blocks, side by side
      const int8_t* xs[G];
      i16v isum[G], hi[G];
#pragma GCC unroll 10
      for (int r = 0; r < G; ++r) {
        xs[r] = xb[r].q;
        constexpr int S = T == T_Q8_0 ? S_Q8_0 : T == T_Q4_0 ? S_Q4_0 : T == T_Q5_0 ? S_Q5_0 : S_Q6_LO;
        isum[r] = i16v{} + (KQ ? 0 : xb[r].start[S]);  // the integer dots start from it
        if (T == T_Q6_K) hi[r] = i16v{} + xb[r].start[S_Q6_HI];
      }
      if (T == T_Q6_K) {  // isum = sa * (dot of inputs 0-15 - 32 s0) + sb * (dot of 16-31 - 32 s1)
        dot_rows<G, false>(tw, xs, 0, 4, isum);
        dot_rows<G, false>(tw, xs, 4, 8, hi);
#pragma GCC unroll 10
        for (int r = 0; r < G; ++r) isum[r] = sa * isum[r] + sb * hi[r];
      } else {
        dot_rows<G, T == T_Q8_0>(tw, xs, 0, 8, isum);
      }
#pragma GCC unroll 10
      for (int r = 0; r < G; ++r) {
        const float dx = xb[r].d;
        acc[r] = acc[r] + tof(isum[r]) * (ws * dx);
        if (KQ) acc[r] = acc[r] - xb[r].sum * (wm * dx);
      }
    }
  }
  const int64_t n0 = p * L, valid = std::min(L, N - n0);
  for (int r = 0; r < G; ++r) std::memcpy(y + (m0 + r) * ldy + n0, &acc[r], valid * sizeof(float));
}

// One weight of a product: its panels, block type, outputs, first column of y, first panel in the flat panel index
struct Part {
  const uint8_t* w;
  int64_t t, n, col, first;
  int64_t panels() const { return (n + L - 1) / L; }
};

// All M rows against panel p of one weight, in ceil(M / GROWS) passes of near-equal size (12 rows: 6 + 6), the panel
// re-read from cache after the first
template <int64_t T>
void panel_passes(const Act& a, const Part& w, float* y, int64_t M, int64_t ldy, int64_t p) {
  const int64_t passes = (M + GROWS - 1) / GROWS;
  float* yw = y + w.col;
  for (int64_t i = 0, m0 = 0; i < passes; ++i) {
    const int g = static_cast<int>(M / passes + (i < M % passes ? 1 : 0));
    switch (g) {
      case 1: panel_rows<T, 1>(a, w.w, yw, w.n, ldy, p, m0); break;
      case 2: panel_rows<T, 2>(a, w.w, yw, w.n, ldy, p, m0); break;
      case 3: panel_rows<T, 3>(a, w.w, yw, w.n, ldy, p, m0); break;
      case 4: panel_rows<T, 4>(a, w.w, yw, w.n, ldy, p, m0); break;
      case 5: panel_rows<T, 5>(a, w.w, yw, w.n, ldy, p, m0); break;
      case 6: panel_rows<T, 6>(a, w.w, yw, w.n, ldy, p, m0); break;
      case 7: panel_rows<T, 7>(a, w.w, yw, w.n, ldy, p, m0); break;
      case 8: panel_rows<T, 8>(a, w.w, yw, w.n, ldy, p, m0); break;
      case 9: panel_rows<T, 9>(a, w.w, yw, w.n, ldy, p, m0); break;
      default: panel_rows<T, 10>(a, w.w, yw, w.n, ldy, p, m0); break;
    }
    m0 += g;
  }
}

// Panels [f0, f1) of the flat index over the weights' panels.
void run_range(const Act& a, const std::vector<Part>& parts, float* y, int64_t M, int64_t ldy, int64_t f0, int64_t f1) {
  size_t i = 0;
  for (int64_t f = f0; f < f1; ++f) {
    while (f >= parts[i].first + parts[i].panels()) ++i;  // parts in order of `first`
    const Part& w = parts[i];
    const int64_t p = f - w.first;
    switch (w.t) {
      case T_Q8_0: panel_passes<T_Q8_0>(a, w, y, M, ldy, p); break;
      case T_Q4_0: panel_passes<T_Q4_0>(a, w, y, M, ldy, p); break;
      case T_Q5_0: panel_passes<T_Q5_0>(a, w, y, M, ldy, p); break;
      case T_Q4_K: panel_passes<T_Q4_K>(a, w, y, M, ldy, p); break;
      case T_Q5_K: panel_passes<T_Q5_K>(a, w, y, M, ldy, p); break;
      case T_Q6_K: panel_passes<T_Q6_K>(a, w, y, M, ldy, p); break;
      default: break;
    }
  }
}

// y (M, ldy) = the weights' products side by side: one flat index over all their panels, split between torch's
// threads; weights of several block types are split by bytes (a Q8_0 panel costs more than a Q5_0 one), one range
// per thread. Each output is computed by panel_rows alone, so it is the same number whichever weights share the call
// and however the panels are split.
void run(const Act& a, const std::vector<Part>& parts, float* y, int64_t M, int64_t ldy) {
  const int64_t total = parts.back().first + parts.back().panels();
  bool mixed = false;
  for (const Part& w : parts) mixed |= w.t != parts[0].t;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), total);
  if (!mixed || threads < 2) {
    at::parallel_for(0, total, 2, [&](int64_t f0, int64_t f1) { run_range(a, parts, y, M, ldy, f0, f1); });
    return;
  }
  std::vector<double> cost(parts.size());  // bytes of one panel of each weight
  double all = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    const Info I = info(parts[i].t);
    cost[i] = static_cast<double>(a.K / I.bs * I.block());
    all += cost[i] * parts[i].panels();
  }
  std::vector<int64_t> bound(threads + 1, total);  // thread j runs panels [bound[j], bound[j + 1])
  bound[0] = 0;
  double sum = 0;
  int64_t j = 1;
  for (size_t i = 0; i < parts.size() && j < threads; ++i)
    for (int64_t p = 0; p < parts[i].panels() && j < threads; ++p) {
      sum += cost[i];
      if (sum >= all * j / threads) bound[j++] = parts[i].first + p + 1;
    }
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) run_range(a, parts, y, M, ldy, bound[t], bound[t + 1]);
  });
}

// x (M, K) contiguous fp32, K a multiple of 32 -> its 8-bit blocks in the calling thread's scratch (no allocation per call)
Act quantize_scratch(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(1) % 32 == 0, "gguf ", op,
              ": x must be contiguous float32 (M, K) with K a multiple of 32");
  const int64_t M = x.size(0), K = x.size(1);
  static thread_local std::vector<XBlock> blocks;
  blocks.resize(M * K / 32);
  quantize_rows(x.data_ptr<float>(), M, K, blocks.data());
  return Act{blocks.data(), M, K};
}

// The quants and scales the kernels multiply by, (M, K) int8 and (M, K / 32) fp32, for tests
std::tuple<at::Tensor, at::Tensor> quantize_activations(const at::Tensor& x) {
  const Act a = quantize_scratch(x.contiguous(), "quantize_activations");
  at::Tensor q = at::empty({a.M, a.K}, at::kChar), d = at::empty({a.M, a.K / 32}, at::kFloat);
  for (int64_t m = 0; m < a.M; ++m)
    for (int64_t kb = 0; kb < a.K / 32; ++kb) {
      const XBlock& o = a.b[kb * a.M + m];
      std::memcpy(q.data_ptr<int8_t>() + m * a.K + kb * 32, o.q, 32);
      d.data_ptr<float>()[m * (a.K / 32) + kb] = o.d;
    }
  return {q, d};
}

// One weight's checks: a known type, K a multiple of its block, data exactly its packed (n, K) bytes
Part part(const at::Tensor& data, int64_t t, int64_t N, int64_t K, const char* op, const std::string& name) {
  check_type(t);
  const Info I = info(t);
  TORCH_CHECK(K % I.bs == 0, "gguf ", op, ": K=", K, " is not a multiple of the block size ", I.bs, " of ", name);
  TORCH_CHECK(N >= 0 && data.scalar_type() == at::kByte && data.is_contiguous() && data.numel() == (N + L - 1) / L * (K / I.bs) * I.block(),
              "gguf ", op, ": ", name, " data does not hold (", N, ", ", K, ") in packed blocks of type ", t);
  return Part{data.data_ptr<uint8_t>(), t, N, 0, 0};
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& data, int64_t t, int64_t N) {
  const Act a = quantize_scratch(x, "linear");
  const std::vector<Part> parts{part(data, t, N, a.K, "linear", "weight")};
  at::Tensor y = at::empty({x.size(0), N}, at::kFloat);
  if (N > 0) run(a, parts, y.data_ptr<float>(), x.size(0), N);
  return y;
}

// y (M, sum of ns): linear(x, data[i], qtypes[i], ns[i]) side by side, x quantized once, one split of all the panels
at::Tensor linear_many(const at::Tensor& x, at::TensorList data, at::IntArrayRef qtypes, at::IntArrayRef ns) {
  TORCH_CHECK(!data.empty() && data.size() == qtypes.size() && data.size() == ns.size(), "gguf linear_many: expected as many qtypes and ns as ",
              "weights (at least one), got ", data.size(), " weights, ", qtypes.size(), " qtypes, ", ns.size(), " ns");
  const Act a = quantize_scratch(x, "linear_many");
  std::vector<Part> parts;
  int64_t col = 0, first = 0;
  for (size_t i = 0; i < data.size(); ++i) {
    Part w = part(data[i], qtypes[i], ns[i], a.K, "linear_many", "weight " + std::to_string(i));
    w.col = col;
    w.first = first;
    col += w.n;
    first += w.panels();
    parts.push_back(w);
  }
  at::Tensor y = at::empty({x.size(0), col}, at::kFloat);
  if (first > 0) run(a, parts, y.data_ptr<float>(), x.size(0), col);
  return y;
}

std::string isa() { return ISA; }

}  // namespace

TORCH_LIBRARY(mtpspec_gguf, m) {
  m.def("pack(Tensor raw, int qtype, int n, int k) -> Tensor", &pack);
  m.def("dequantize(Tensor data, int qtype, int n, int k, Tensor? ids) -> Tensor");
  m.def("quantize_activations(Tensor x) -> (Tensor, Tensor)", &quantize_activations);
  m.def("linear(Tensor x, Tensor data, int qtype, int n) -> Tensor");
  m.def("linear_many(Tensor x, Tensor[] data, int[] qtypes, int[] ns) -> Tensor");
  m.def("isa() -> str", &isa);
}

TORCH_LIBRARY_IMPL(mtpspec_gguf, CPU, m) {
  m.impl("linear", &linear);
  m.impl("linear_many", &linear_many);
  m.impl("dequantize", &dequantize);
}
