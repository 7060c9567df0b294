// (dtype, expert variant) dispatch and the shape rules of the fused forward.
#include <algorithm>
#include <stdexcept>
#include "generated/expert_variants.h"  // written by the builder from flashdmoe/kernel/expert_variants.py
#include "moe/launch.h"
#include "moe/tile_config.cuh"

namespace flashdmoe {

std::string check_shapes(int tokens, int hidden, int ffn, int experts, int top_k, int world_size) {
  if (world_size < 1 || world_size > kMaxRanks)
    return "world_size P=" + std::to_string(world_size) + " must be in [1, " + std::to_string(kMaxRanks) + "]";
  if (experts % world_size != 0)
    return "experts E=" + std::to_string(experts) + " must be a multiple of world_size P=" + std::to_string(world_size);
  if (tokens < 0) return "tokens must be >= 0, got " + std::to_string(tokens);
  if (hidden <= 0 || hidden % kHiddenMultiple != 0)
    return "hidden size H=" + std::to_string(hidden) + " must be a positive multiple of " +
           std::to_string(kHiddenMultiple) + " for the fused kernel";
  if (ffn <= 0 || ffn % kFfnMultiple != 0)
    return "ffn size I=" + std::to_string(ffn) + " must be a positive multiple of " + std::to_string(kFfnMultiple) +
           " for the fused kernel";
  if (experts < 1 || experts > kMaxExperts)
    return "experts E=" + std::to_string(experts) + " must be in [1, " + std::to_string(kMaxExperts) + "]";
  if (top_k < 1 || top_k > experts || top_k > kMaxTopK)
    return "top_k=" + std::to_string(top_k) + " must be in [1, min(E, " + std::to_string(kMaxTopK) + ")]";
  if (static_cast<long long>(tokens) * top_k * (hidden > ffn ? hidden : ffn) >= (1ll << 40))
    return "tokens*top_k*max(H, I) is too large for one launch";
  return "";
}

WorkspaceLayout workspace_layout(int tokens, int hidden, int ffn, int experts, int top_k, DType dtype, int world_size,
                                 int stream_rows) {
  return make_workspace_layout(tokens, hidden, ffn, experts, top_k, dtype == DType::Float32 ? 4 : 2, kGateTileM,
                               kExpertTileM, world_size,
                               stream_rows);
}

void throw_no_instance(DType dtype, int variant) {
  if (dtype != DType::BFloat16 && dtype != DType::Float16 && dtype != DType::Float32)
    throw std::invalid_argument("dtype code must be 0 (bf16), 1 (fp16) or 2 (fp32), got " +
                                std::to_string(static_cast<int>(dtype)));
  if (variant < 0 || variant >= kExpertVariantCount)
    throw std::invalid_argument("expert_variant must be 0.." + std::to_string(kExpertVariantCount - 1) + ", got " +
                                std::to_string(variant));
  // fp32 inputs: TF32 mma.sync tiles (wgmma's TF32 form needs K-major weights, which [K, N] weights are not).
  if (dtype == DType::Float32)
    throw std::invalid_argument(std::string("fp32 inputs run on expert variant ") + std::to_string(kFp32ExpertVariant) +
                                " (" + kExpertVariantNames[kFp32ExpertVariant] + ", TF32) only, got " +
                                std::to_string(variant) + " (" + kExpertVariantNames[variant] + ")");
  throw std::invalid_argument(std::string("expert variant ") + kExpertVariantNames[variant] +
                              " has no kernel for dtype code " + std::to_string(static_cast<int>(dtype)));
}

std::vector<std::string> expert_variant_names() {
  return std::vector<std::string>(kExpertVariantNames, kExpertVariantNames + kExpertVariantCount);
}

// One rank's parameters: everything but the per-call addresses (the workspace pieces as offsets).
static void prepare_rank(const ForwardArgs& a, const RankArgs& r, PreparedRank& out) {
  const std::string shape_error = check_shapes(r.tokens, a.hidden, a.ffn, a.experts, a.top_k, a.world_size);
  if (!shape_error.empty()) throw std::invalid_argument(shape_error);
  const WorkspaceLayout ws =
      workspace_layout(r.tokens, a.hidden, a.ffn, a.experts, a.top_k, a.dtype, a.world_size, a.stream_rows);
  if (r.workspace_bytes < ws.total_bytes)
    throw std::invalid_argument("rank " + std::to_string(r.rank) + ": workspace holds " +
                                std::to_string(r.workspace_bytes) + " bytes, needs " + std::to_string(ws.total_bytes));
  const int local_experts = a.experts / a.world_size;
  if (static_cast<long long>(r.tokens) * std::min(a.top_k, local_experts) > a.stream_rows)
    throw std::invalid_argument("rank " + std::to_string(r.rank) + ": " + std::to_string(r.tokens) +
                                " tokens do not fit stream_rows=" + std::to_string(a.stream_rows));
  if (r.rank < 0 || r.rank >= a.world_size) throw std::invalid_argument("rank out of range");

  MoEParams p{};
  p.tokens = r.tokens; p.hidden = a.hidden; p.ffn = a.ffn; p.experts = a.experts; p.top_k = a.top_k;
  p.w1_cols = a.activation == Activation::Swiglu ? 2 * a.ffn : a.ffn;
  p.capacity = r.capacity < r.tokens ? r.capacity : r.tokens;
  p.activation = a.activation;
  p.normalize_topk = a.normalize_topk;
  p.rank = r.rank; p.world_size = a.world_size; p.local_experts = local_experts;
  p.stream_rows = a.stream_rows;
  p.silent = r.silent;
  p.team_words = r.team_words;
  if (r.relay.ranks_per_node > 0) {
    const int G = r.relay.ranks_per_node;
    if (a.world_size % G != 0 || a.world_size / G < 2 || r.relay.buffer == nullptr || r.relay.max_rows < r.tokens ||
        r.relay.rows_offset < relay_record_bytes(r.relay.max_rows, a.top_k) ||
        r.relay.batch_bytes < r.relay.rows_offset + static_cast<size_t>(r.relay.max_rows) * a.hidden * (a.dtype == DType::Float32 ? 4 : 2))
      throw std::invalid_argument("relay: ranks_per_node=" + std::to_string(G) + " with " +
                                  std::to_string(a.world_size) + " ranks, max_rows=" + std::to_string(r.relay.max_rows) +
                                  " for " + std::to_string(r.tokens) + " tokens: expected >= 2 nodes, a buffer and "
                                  "batch regions holding every token's row and records");
  }
  p.relay = r.relay;
  if (a.world_size > 1) {
    for (int q = 0; q < a.world_size; ++q) {
      if (!r.peer_recv[q] || !r.peer_comb[q] || !r.peer_signals[q])
        throw std::invalid_argument("rank " + std::to_string(r.rank) + ": missing buffers of peer " + std::to_string(q));
      p.peers[q] = {r.peer_recv[q], r.peer_comb[q], r.peer_signals[q]};
    }
  }
  p.gate_tiles = ws.gate_tiles;
  p.gate_splits = 1;  // set once the grid is known
  p.small_tile_epilogue = a.small_tile_epilogue;
  p.max_row_tiles = ws.max_row_tiles;
  p.timeout_ns = a.timeout_ns;
  p.debug_withhold_phase = a.debug_withhold_phase;
  out.params = p;
  out.layout = ws;
  for (const void*& base : out.map_base) base = nullptr;
}

void prepare_launch(PreparedLaunch& prepared) {
  const ForwardArgs& a = prepared.args;
  if (a.num_ranks < 1 || a.num_ranks > kMaxRanks || a.num_ranks > a.world_size)
    throw std::invalid_argument("num_ranks=" + std::to_string(a.num_ranks) + " must be in [1, min(world_size, " +
                                std::to_string(kMaxRanks) + ")]");
  for (int i = 0; i < a.num_ranks; ++i) prepare_rank(a, a.ranks[i], prepared.ranks[i]);
  prepared.grid = GridChoice{};
}

LaunchInfo launch_prepared(PreparedLaunch& prepared, const uintptr_t* addresses, uint32_t sequence,
                           void* status_host, cudaStream_t stream) {
  return visit_expert_instance(prepared.args.dtype, prepared.args.expert_variant, [&](auto element, auto variant) {
    using Element = decltype(element);
    using Variant = decltype(variant);
    return prepared.args.num_ranks == 1
               ? launch_forward_variant<Element, Variant, 1>(prepared, addresses, sequence, status_host, stream)
               : launch_forward_variant<Element, Variant, kMaxRanks>(prepared, addresses, sequence, status_host,
                                                                      stream);
  });
}

KernelAttributes kernel_attributes(DType dtype, int expert_variant) {
  return visit_expert_instance(dtype, expert_variant, [](auto element, auto variant) {
    return kernel_attributes_variant<decltype(element), decltype(variant)>();
  });
}

}  // namespace flashdmoe
