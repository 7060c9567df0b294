// (dtype, expert variant) dispatch and the shape rules of the fused forward.
#include <stdexcept>
#include "generated/expert_variants.h"  // written by the builder from flashdmoe/expert_variants.py
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

LaunchInfo launch_forward(const ForwardArgs& args, cudaStream_t stream) {
  return visit_expert_instance(args.dtype, args.expert_variant, [&](auto element, auto variant) {
    return launch_forward_variant<decltype(element), decltype(variant)>(args, stream);
  });
}

KernelAttributes kernel_attributes(DType dtype, int expert_variant) {
  return visit_expert_instance(dtype, expert_variant, [](auto element, auto variant) {
    return kernel_attributes_variant<decltype(element), decltype(variant)>();
  });
}

}  // namespace flashdmoe
