// Kernel instances of the tma-cluster2-128x256-4stage expert variant (bf16 and fp16).
#include "moe/launch_template.cuh"

FLASHDMOE_INSTANTIATE_VARIANT(TmaCluster256FourStages)
