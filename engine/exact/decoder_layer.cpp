// A Qwen2 or Llama decoder layer's operations around its attention, as engine/exact/decoder.py runs them from Python:
// the same ATen calls in the same order, so the same bits, without Python's cost per call (about 40 small calls a
// layer, which on our 2-core CPUs cost more than their arithmetic in a decoding step). The layer's Linears are
// grouped_int8.cpp's kernel; the attention and the KV cache stay in Python, between the two halves.
#include <torch/extension.h>

#include <tuple>
#include <vector>

torch::Tensor linear(torch::Tensor x, torch::Tensor code, torch::Tensor scale, torch::Tensor low,
                     c10::optional<torch::Tensor> bias, int64_t N, bool vnni);  // grouped_int8.cpp

namespace {

// what the kernel takes besides x (engine.exact.grouped_int8.GroupedInt8Linear.operands)
using Operands = std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, c10::optional<torch::Tensor>, int64_t, bool>;

torch::Tensor project(const Operands& w, const torch::Tensor& x) {
  return linear(x, std::get<0>(w), std::get<1>(w), std::get<2>(w), std::get<3>(w), std::get<4>(w), std::get<5>(w));
}

// decoder._rms_norm on float32 activations (its casts change nothing there)
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  return weight * (x * torch::rsqrt(x.pow(2).mean(-1, true) + eps));
}

// (x * cos) + (rotate_half(x) * sin), rotate_half as transformers writes it
torch::Tensor rotated(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  const int64_t half = x.size(-1) / 2;
  return (x * cos) + (torch::cat({-x.slice(-1, half), x.slice(-1, 0, half)}, -1) * sin);
}

struct DecoderLayer {
  torch::Tensor input_norm, post_norm;
  double input_eps, post_eps;
  Operands q, k, v, o, gate, up, down;
  int64_t head_dim;

  // x [1, T, hidden] -> q [1, heads, T, head_dim], k and v [1, kv heads, T, head_dim]; q and k rotated
  std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> attention_inputs(const torch::Tensor& x,
                                                                           const torch::Tensor& cos,
                                                                           const torch::Tensor& sin) const {
    TORCH_CHECK(x.scalar_type() == torch::kFloat32, "float32 activations (the norm's casts are left out)");
    const auto h = rms_norm(x, input_norm, input_eps);
    const std::vector<int64_t> shape = {1, x.size(1), -1, head_dim};
    auto qh = project(q, h).view(shape).transpose(1, 2);
    auto kh = project(k, h).view(shape).transpose(1, 2);
    auto vh = project(v, h).view(shape).transpose(1, 2);
    return {rotated(qh, cos, sin), rotated(kh, cos, sin), vh};
  }

  // x and the attention's output [1, T, heads, head_dim] -> the layer's output [1, T, hidden]
  torch::Tensor output(const torch::Tensor& x, const torch::Tensor& attention) const {
    TORCH_CHECK(x.scalar_type() == torch::kFloat32, "float32 activations (the norm's casts are left out)");
    const auto y = x + project(o, attention.reshape({1, x.size(1), -1}).contiguous());
    const auto h = rms_norm(y, post_norm, post_eps);
    return y + project(down, torch::silu(project(gate, h)) * project(up, h));
  }
};

}  // namespace

void register_decoder_layer(pybind11::module_& m) {
  pybind11::class_<DecoderLayer>(m, "DecoderLayer")
      .def(pybind11::init([](torch::Tensor input_norm, double input_eps, torch::Tensor post_norm, double post_eps,
                             std::vector<Operands> linears, int64_t head_dim) {
             TORCH_CHECK(linears.size() == 7, "the Linears q, k, v, o, gate, up, down");
             return DecoderLayer{input_norm, post_norm, input_eps, post_eps, linears[0], linears[1], linears[2],
                                 linears[3], linears[4], linears[5], linears[6], head_dim};
           }),
           "input_norm, its eps, post_attention_norm, its eps, the Linears' operands (q, k, v, o, gate, up, down), "
           "head_dim")
      .def("attention_inputs", &DecoderLayer::attention_inputs)
      .def("output", &DecoderLayer::output);
}
