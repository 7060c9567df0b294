// The backward's step between the two row GEMMs: from the pre-activations and g = dy W2^T of each
// packed row, the combine weight's gradient <g, act(pre)>, the weighted activation (dW2's operand) and
// dpre (dW1's and dx's operand), in one pass over the rows.
#include "backward/expert_grad.h"
#include "backward/vector.cuh"
#include "moe/activation.cuh"

namespace flashdmoe {
namespace {

using backward::Vec8;

constexpr int kRowsPerBlock = 8;  // one warp per row

template <typename Element, Activation kKind>
__global__ void __launch_bounds__(32 * kRowsPerBlock, 4)
    activation_grad_kernel(const Element* __restrict__ pre, const Element* __restrict__ g,
                           const float* __restrict__ weight, Element* __restrict__ hw, Element* __restrict__ dpre,
                           float* __restrict__ dweight, int64_t rows, int ffn, const int* __restrict__ live_rows) {
  constexpr bool kGated = kKind == Activation::Swiglu;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + (threadIdx.x >> 5);
  if (row >= rows || (live_rows != nullptr && row >= __ldg(live_rows))) return;
  const int lane = threadIdx.x & 31;
  const int64_t pre_ld = kGated ? 2 * ffn : ffn;
  const Element* pre_row = pre + row * pre_ld;
  const Element* g_row = g + row * ffn;
  Element* dpre_row = dpre + row * pre_ld;
  Element* hw_row = hw + row * ffn;
  const float w = weight[row];
  float dot = 0.f;  // this lane's share of <g, h>, its chunks in order
  for (int col = lane * 8; col < ffn; col += 32 * 8) {
    float gv[8], pv[8], hv[8], dv[8];
    Vec8<Element>::load(g_row + col).to_float(gv);
    Vec8<Element>::load(pre_row + col).to_float(pv);
    if constexpr (kGated) {
      float uv[8], du[8];
      Vec8<Element>::load(pre_row + ffn + col).to_float(uv);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const float silu_v = silu(pv[i]);
        hv[i] = silu_v * uv[i];
        dv[i] = w * gv[i] * uv[i] * activation_slope(kKind, pv[i]);
        du[i] = w * gv[i] * silu_v;
      }
      Vec8<Element>::from_float(du).store(dpre_row + ffn + col);
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        hv[i] = activate(kKind, pv[i]);
        dv[i] = w * gv[i] * activation_slope(kKind, pv[i]);
      }
    }
    float scaled[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      dot += gv[i] * hv[i];
      scaled[i] = w * hv[i];
    }
    Vec8<Element>::from_float(dv).store(dpre_row + col);
    Vec8<Element>::from_float(scaled).store(hw_row + col);
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, offset);
  if (lane == 0) dweight[row] = dot;
}

}  // namespace

void launch_activation_grad(DType dtype, Activation activation, const void* pre, const void* g, const float* weight,
                            void* hw, void* dpre, float* dweight, int64_t rows, int ffn, const int* live_rows,
                            cudaStream_t stream) {
  if (ffn <= 0 || ffn % 8 != 0) throw std::invalid_argument("ffn I=" + std::to_string(ffn) + " must be a positive multiple of 8");
  if (rows <= 0) return;
  const int64_t blocks = (rows + kRowsPerBlock - 1) / kRowsPerBlock;
  if (blocks > 0x7fffffff) throw std::invalid_argument("rows=" + std::to_string(rows) + " is too many for one launch");
  backward::visit_half_dtype(dtype, [&](auto element) {
    using Element = decltype(element);
    backward::visit_activation(activation, [&](auto kind) {
      activation_grad_kernel<Element, decltype(kind)::value><<<static_cast<int>(blocks), 32 * kRowsPerBlock, 0, stream>>>(
          static_cast<const Element*>(pre), static_cast<const Element*>(g), weight, static_cast<Element*>(hw),
          static_cast<Element*>(dpre), dweight, rows, ffn, live_rows);
    });
  });
  backward::check_launch("activation_grad launch");
}

}  // namespace flashdmoe
