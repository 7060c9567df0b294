// Kernel instances of the mma-sync-128x128-3stage expert variant (bf16, fp16, and fp32 as TF32).
#include "moe/launch_template.cuh"

FLASHDMOE_INSTANTIATE_VARIANT(MmaSync128ThreeStages)
FLASHDMOE_INSTANTIATE_FP32(MmaSync128ThreeStages)
