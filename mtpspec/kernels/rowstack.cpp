// A dense decoder stack (Llama / Qwen3 / Gemma 3 layers on GGUF block weights) over one sequence's rows (in order or a
// token tree), in one call. Each layer runs the ops of models/forward.py's row path (RowPlan) in its order with its
// arguments: the block products (mtpspec_gguf), the row norms and norm + rotation (mtpspec_rownorm), the row attention
// (mtpspec_attention), ATen's activation, product and sums; so every output is bitwise that path's. What goes is the
// Python between the ops, most of a small quantized model's decode step.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

using Linear = at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, int64_t);
using LinearMany = at::Tensor(const at::Tensor&, at::TensorList, at::IntArrayRef, at::IntArrayRef);
using Norm = at::Tensor(const at::Tensor&, const at::Tensor&, double, bool);
using NormRope = at::Tensor(const at::Tensor&, const c10::optional<at::Tensor>&, double, bool, const at::Tensor&,
                            const at::Tensor&);
using Attend = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                          const at::Tensor&, const c10::optional<at::Tensor>&, double);
using Write = void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&);

template <typename F>
c10::TypedOperatorHandle<F> find(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<F>();
}

// The ops, looked up once (their extensions are loaded before this one is called).
struct Ops {
  c10::TypedOperatorHandle<Linear> linear = find<Linear>("mtpspec_gguf::linear");
  c10::TypedOperatorHandle<LinearMany> linear_many = find<LinearMany>("mtpspec_gguf::linear_many");
  c10::TypedOperatorHandle<Norm> norm = find<Norm>("mtpspec_rownorm::rms_norm");
  c10::TypedOperatorHandle<NormRope> norm_rope = find<NormRope>("mtpspec_rownorm::norm_rope");
  c10::TypedOperatorHandle<Attend> attend = find<Attend>("mtpspec_attention::attend_rows");
  c10::TypedOperatorHandle<Write> write = find<Write>("mtpspec_attention::write_rows");
};

const Ops& ops() {
  static const Ops o;
  return o;
}

constexpr int64_t W = 7;  // weights per layer: q, k, v, o, gate, up, down

// x (N, H) fp32, the residual stream entering layer `first` -> the stream after the layers given. Per layer: its 7
// weights' block data, types and output counts; its norms (input, [q, k,] post-attention, [pre-, post-feedforward]);
// its rotary rows cos, sin (N, rot); the first key lo (N,) each row sees; for a token tree, its mask (N, <= S) of the
// keys each row sees (else no masks). k_bufs / v_bufs (L, B, nkv, S, hd): row i written into layer first + l's
// buffers of sequence seq[i] at slot[i]; hi (N,) each row's last key. dims: nh, nkv, hd, qk_norm, sandwich, activation
// (0 silu, 1 gelu tanh).
at::Tensor dense_stack(const at::Tensor& x0, at::TensorList weights, at::IntArrayRef qtypes, at::IntArrayRef ns,
                       at::TensorList norms, const at::Tensor& k_bufs, const at::Tensor& v_bufs, int64_t first,
                       at::TensorList rotary, at::TensorList lo, at::TensorList masks, const at::Tensor& seq,
                       const at::Tensor& slot, const at::Tensor& hi, at::IntArrayRef dims, double eps, bool zero_centred,
                       double scale) {
  TORCH_CHECK(dims.size() == 6, "dense_stack: dims (nh, nkv, hd, qk_norm, sandwich, act)");
  const int64_t nh = dims[0], nkv = dims[1], hd = dims[2];
  const bool qk_norm = dims[3] != 0, sandwich = dims[4] != 0, gelu = dims[5] != 0;
  const int64_t per_norms = 2 + (qk_norm ? 2 : 0) + (sandwich ? 2 : 0);
  const int64_t layers = static_cast<int64_t>(weights.size()) / W;
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == layers * W && static_cast<int64_t>(qtypes.size()) == layers * W &&
                  static_cast<int64_t>(ns.size()) == layers * W && static_cast<int64_t>(norms.size()) == layers * per_norms &&
                  static_cast<int64_t>(rotary.size()) == 2 * layers && static_cast<int64_t>(lo.size()) == layers,
              "dense_stack: per layer 7 weights, ", per_norms, " norms, cos and sin, and lo");
  TORCH_CHECK(masks.empty() || static_cast<int64_t>(masks.size()) == layers, "dense_stack: a mask per layer, or none");
  TORCH_CHECK(x0.dim() == 2 && x0.scalar_type() == at::kFloat && x0.is_contiguous(), "dense_stack: x (N, H) contiguous fp32");
  TORCH_CHECK(first >= 0 && first + layers <= k_bufs.size(0) && first + layers <= v_bufs.size(0), "dense_stack: layers outside the buffers");
  const int64_t n = x0.size(0);
  TORCH_CHECK(seq.scalar_type() == at::kLong && slot.scalar_type() == at::kLong && seq.is_contiguous() && slot.is_contiguous() &&
                  seq.numel() == n && slot.numel() == n, "dense_stack: seq and slot, one int64 per row");
  const int64_t* sq = seq.data_ptr<int64_t>();
  const int64_t* sl = slot.data_ptr<int64_t>();
  int64_t end = 0;  // the keys any row reads lie below
  std::vector<int64_t> runs{0};  // rows [runs[j], runs[j + 1]): consecutive rows of one sequence
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(sq[i] >= 0 && sq[i] < k_bufs.size(1) && sl[i] >= 0 && sl[i] < k_bufs.size(3), "dense_stack: row ", i, " at (", sq[i],
                ", ", sl[i], ") outside the buffers");
    end = std::max(end, sl[i] + 1);
    if (i > 0 && sq[i] != sq[i - 1]) runs.push_back(i);
  }
  runs.push_back(n);
  const Ops& o = ops();
  const c10::optional<at::Tensor> none;
  at::Tensor x = x0;
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor* w = weights.data() + l * W;
    const int64_t* t = qtypes.data() + l * W;
    const int64_t* m = ns.data() + l * W;
    const at::Tensor* nm = norms.data() + l * per_norms;
    const at::Tensor &cos = rotary[2 * l], &sin = rotary[2 * l + 1];
    // attention: norm, q | k | v in one product, each head normed and rotated, the KV write, the row attention
    const at::Tensor h = o.norm.call(x, nm[0], eps, zero_centred);
    const at::Tensor qkv = o.linear_many.call(h, at::TensorList(w, 3), at::IntArrayRef(t, 3), at::IntArrayRef(m, 3));
    const at::Tensor q = o.norm_rope.call(qkv.narrow(1, 0, m[0]).view({n, nh, hd}),
                                          qk_norm ? c10::optional<at::Tensor>(nm[1]) : none, qk_norm ? eps : 0.0,
                                          qk_norm && zero_centred, cos, sin);
    const at::Tensor k = o.norm_rope.call(qkv.narrow(1, m[0], m[1]).view({n, nkv, hd}),
                                          qk_norm ? c10::optional<at::Tensor>(nm[2]) : none, qk_norm ? eps : 0.0,
                                          qk_norm && zero_centred, cos, sin);
    const at::Tensor v = qkv.narrow(1, m[0] + m[1], m[2]).view({n, nkv, hd});
    const at::Tensor kb = k_bufs.select(0, first + l), vb = v_bufs.select(0, first + l);
    for (size_t j = 0; j + 1 < runs.size(); ++j) {  // each sequence's rows into its buffers at their slots
      const int64_t a = runs[j], len = runs[j + 1] - a, b = sq[a];
      o.write.call(kb.narrow(0, b, 1), vb.narrow(0, b, 1), slot.narrow(0, a, len),
                   k.narrow(0, a, len).transpose(0, 1).unsqueeze(0), v.narrow(0, a, len).transpose(0, 1).unsqueeze(0));
    }
    const c10::optional<at::Tensor> mask = masks.empty() ? none : c10::optional<at::Tensor>(masks[l]);
    const at::Tensor y = o.attend.call(q, kb.slice(2, 0, end), vb.slice(2, 0, end), seq, lo[l], hi, mask, scale);
    const at::Tensor a = o.linear.call(y.view({n, -1}), w[3], t[3], m[3]);
    const int64_t next = qk_norm ? 3 : 1;  // the post-attention norm's index
    at::Tensor f;  // the MLP's input
    if (sandwich) {
      x = at::add(x, o.norm.call(a, nm[next], eps, zero_centred));
      f = o.norm.call(x, nm[next + 1], eps, zero_centred);
    } else {
      x = at::add(x, a);
      f = o.norm.call(x, nm[next], eps, zero_centred);
    }
    // the gated MLP: gate | up in one product, act(gate) * up, down
    const at::Tensor gu = o.linear_many.call(f, at::TensorList(w + 4, 2), at::IntArrayRef(t + 4, 2), at::IntArrayRef(m + 4, 2));
    const at::Tensor g = gu.narrow(1, 0, m[4]), u = gu.narrow(1, m[4], m[5]);
    const at::Tensor d = o.linear.call(at::mul(gelu ? at::gelu(g, "tanh") : at::silu(g), u), w[6], t[6], m[6]);
    x = at::add(x, sandwich ? o.norm.call(d, nm[next + 2], eps, zero_centred) : d);
  }
  return x;
}

}  // namespace

TORCH_LIBRARY(mtpspec_rowstack, m) {
  m.def("dense_stack(Tensor x, Tensor[] weights, int[] qtypes, int[] ns, Tensor[] norms, Tensor(a!) k_bufs, "
        "Tensor(b!) v_bufs, int first, Tensor[] rotary, Tensor[] lo, Tensor[] masks, Tensor seq, Tensor slot, Tensor hi, int[] dims, "
        "float eps, bool zero_centred, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(mtpspec_rowstack, CPU, m) { m.impl("dense_stack", &dense_stack); }
