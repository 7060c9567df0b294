// Host side of the fused expert backward: shape rules, the sync / scratch layout, TMA descriptors and
// the cooperative launch of the (dtype, tile width) instance.
#include <string>
#include "backward/expert_grad.h"
#include "backward/fused_backward.cuh"
#include "backward/vector.cuh"
#include "common/host_launch.h"

namespace flashdmoe {
namespace {

int w1_columns(int ffn, Activation activation) { return activation == Activation::Swiglu ? 2 * ffn : ffn; }

template <typename Element, int BN>
LaunchInfo launch_instance(const FusedBackwardArgs& a, cudaStream_t stream) {
  using Config = FusedBackwardConfig<Element, BN>;
  const int w1_cols = w1_columns(a.ffn, a.activation);
  const int64_t choices = static_cast<int64_t>(a.tokens) * a.top_k;
  const BackwardSyncLayout sync = make_backward_sync_layout(choices, a.experts);
  const BackwardScratchLayout scratch =
      make_backward_scratch_layout(choices, a.hidden, a.ffn, w1_cols, a.experts, 2);

  BackwardParams p{};
  p.tokens = a.tokens, p.hidden = a.hidden, p.ffn = a.ffn, p.w1_cols = w1_cols, p.experts = a.experts;
  p.top_k = a.top_k;
  p.activation = a.activation;
  p.need_dx = a.need_dx, p.need_dw1 = a.need_dw1, p.need_dw2 = a.need_dw2;
  p.x = a.x, p.dy = a.dy, p.pre = a.pre;
  p.topk_expert = a.expert, p.topk_row = a.row, p.topk_weight = a.weight;
  p.dw1 = a.dw1, p.dw2 = a.dw2, p.dx_rows = a.dx_rows, p.dweight_row = a.dweight_row;
  char* s = static_cast<char*>(a.scratch);
  p.dy_rows = s + scratch.dy_rows;
  p.x_rows = s + scratch.x_rows;
  p.wh = s + scratch.wh;
  p.dpre = s + scratch.dpre;
  p.w_pad = reinterpret_cast<float*>(s + scratch.w_pad);
  p.dweight_part = reinterpret_cast<float*>(s + scratch.dweight_part);
  p.row_of_choice = reinterpret_cast<int*>(s + scratch.row_of_choice);
  char* w = static_cast<char*>(a.sync);
  p.error_word = reinterpret_cast<unsigned long long*>(w + kStatusErrorWord);
  p.phase_clock = reinterpret_cast<unsigned long long*>(w + kStatusPhaseClock);
  p.barrier_counter = reinterpret_cast<uint32_t*>(w + sync.barrier_counter);
  p.task_counter = reinterpret_cast<uint32_t*>(w + sync.task_counter);
  p.exit_counter = reinterpret_cast<uint32_t*>(w + sync.exit_counter);
  p.kept_count = reinterpret_cast<uint32_t*>(w + sync.kept_count);
  p.expert_done = reinterpret_cast<uint32_t*>(w + sync.expert_done);
  p.row_tile_done = reinterpret_cast<uint32_t*>(w + sync.row_tile_done);
  p.sync_words = reinterpret_cast<uint32_t*>(w);
  p.sync_words_count = static_cast<int>(sync.sync_bytes / 4);
  p.status_host = a.status_host;
  p.rank = 0, p.first_block = 0;
  p.timeout_ns = a.timeout_ns;
  p.debug_withhold_phase = a.debug_withhold_phase;

  const uint64_t rows = static_cast<uint64_t>(scratch.padded_rows);
  const uint64_t H = a.hidden, I = a.ffn, cols = w1_cols, E = a.experts;
  const TmaBox box2{{64, 64, 1}, 2};
  const uint64_t w1_dims[3] = {cols, H, E}, w2_dims[3] = {H, I, E};
  const uint64_t hidden_rows[2] = {H, rows}, ffn_rows[2] = {I, rows}, w1_rows[2] = {cols, rows};
  p.maps.w1 = make_tensor_map(a.w1, w1_dims, kWeightPanelBox, a.dtype, "w1");
  p.maps.w2 = make_tensor_map(a.w2, w2_dims, kWeightPanelBox, a.dtype, "w2");
  p.maps.dy_rows = make_tensor_map(p.dy_rows, hidden_rows, box2, a.dtype, "dy's rows");
  p.maps.x_rows = make_tensor_map(p.x_rows, hidden_rows, box2, a.dtype, "x's rows");
  p.maps.wh = make_tensor_map(p.wh, ffn_rows, box2, a.dtype, "w * act(pre)");
  p.maps.dpre = make_tensor_map(p.dpre, w1_rows, box2, a.dtype, "dpre");

  auto kernel = fused_backward_kernel<Element, BN>;
  int device = 0;
  throw_on_cuda_error(cudaGetDevice(&device), "cudaGetDevice");
  const ResidentGrid resident =
      resident_grid(reinterpret_cast<const void*>(kernel), device, Config::kSmemBytes, Config::kBlockThreads);
  int grid = resident.blocks_per_sm * resident.sms;
  if (a.max_blocks > 0 && a.max_blocks < grid) grid = a.max_blocks;
  p.blocks = grid;

  launch_cooperative(kernel, grid, Config::kBlockThreads, Config::kSmemBytes, stream, p, "launching fused_backward_kernel");
  return {grid, resident.blocks_per_sm, Config::kSmemBytes};
}

}  // namespace

std::string fused_backward_unsupported(int tokens, int hidden, int ffn, int experts, int top_k) {
  if (hidden <= 0 || hidden % 64) return "H=" + std::to_string(hidden) + " is not a positive multiple of 64";
  if (ffn <= 0 || ffn % 64) return "I=" + std::to_string(ffn) + " is not a positive multiple of 64";
  if (experts < 1 || experts > kMaxExperts)
    return "E=" + std::to_string(experts) + " is outside 1.." + std::to_string(kMaxExperts);
  if (top_k < 1 || top_k > experts) return "k=" + std::to_string(top_k) + " is outside 1..E";
  if (tokens < 0) return "T=" + std::to_string(tokens) + " is negative";
  // Row coordinates of the TMA boxes and packed rows are 32-bit.
  if (backward_padded_rows(static_cast<int64_t>(tokens) * top_k, experts) >= (int64_t{1} << 31))
    return "T*k=" + std::to_string(static_cast<int64_t>(tokens) * top_k) + " rows do not fit 32-bit row indices";
  return "";
}

FusedBackwardLayout fused_backward_layout(int tokens, int hidden, int ffn, int experts, int top_k,
                                          Activation activation) {
  const std::string why = fused_backward_unsupported(tokens, hidden, ffn, experts, top_k);
  if (!why.empty()) throw std::invalid_argument("fused backward: " + why);
  const int64_t choices = static_cast<int64_t>(tokens) * top_k;
  const BackwardSyncLayout sync = make_backward_sync_layout(choices, experts);
  const BackwardScratchLayout scratch =
      make_backward_scratch_layout(choices, hidden, ffn, w1_columns(ffn, activation), experts, 2);
  return {sync.sync_bytes, scratch.total_bytes, scratch.row_of_choice, scratch.padded_rows};
}

LaunchInfo launch_fused_backward(const FusedBackwardArgs& a, cudaStream_t stream) {
  const std::string why = fused_backward_unsupported(a.tokens, a.hidden, a.ffn, a.experts, a.top_k);
  if (!why.empty()) throw std::invalid_argument("fused backward: " + why);
  if (a.tokens == 0) throw std::invalid_argument("fused backward: T=0 has nothing to launch");
  if ((a.need_dw1 && a.dw1 == nullptr) || (a.need_dw2 && a.dw2 == nullptr) || (a.need_dx && a.dx_rows == nullptr) ||
      a.dweight_row == nullptr || a.sync == nullptr || a.scratch == nullptr || a.pre == nullptr)
    throw std::invalid_argument("fused backward: a needed output, pre, sync or scratch pointer is null");
  LaunchInfo info{};
  backward::visit_half_dtype(a.dtype, [&](auto element) {
    using Element = decltype(element);
    info = launch_instance<Element, kBackwardTileN>(a, stream);
  });
  return info;
}

}  // namespace flashdmoe
