// Kernel instances of the wgmma-128x128-4stage expert variant (bf16 and fp16).
#include "moe/launch_template.cuh"

FLASHDMOE_INSTANTIATE_VARIANT(Wgmma128FourStages)
