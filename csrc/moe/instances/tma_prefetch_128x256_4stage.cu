// Kernel instances of the tma-prefetch-128x256-4stage expert variant (bf16 and fp16).
#include "moe/launch_template.cuh"

FLASHDMOE_INSTANTIATE_VARIANT(TmaPrefetch256FourStages)
