// bf16 instantiation (one file per dtype so they compile in parallel).
#include "moe/launch_template.cuh"

namespace flashdmoe {
template LaunchInfo launch_forward_typed<__nv_bfloat16>(const ForwardArgs&, cudaStream_t);
template KernelAttributes kernel_attributes_typed<__nv_bfloat16>(int);
}  // namespace flashdmoe
