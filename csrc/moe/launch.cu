// Dtype dispatch and the shape rules of the fused forward.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
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
  (void)dtype;  // both supported dtypes are 2 bytes wide
  return make_workspace_layout(tokens, hidden, ffn, experts, top_k, 2, kGateTileM, kExpertTileM, world_size,
                               stream_rows);
}

LaunchInfo launch_forward(const ForwardArgs& args, cudaStream_t stream) {
  if (args.dtype == DType::BFloat16) return launch_forward_typed<__nv_bfloat16>(args, stream);
  return launch_forward_typed<__half>(args, stream);
}

KernelAttributes kernel_attributes(DType dtype, int expert_variant) {
  if (dtype == DType::BFloat16) return kernel_attributes_typed<__nv_bfloat16>(expert_variant);
  return kernel_attributes_typed<__half>(expert_variant);
}

}  // namespace flashdmoe
