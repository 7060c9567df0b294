// Hopper warpgroup MMA (wgmma, sm_90a) through PTX: shared-memory matrix descriptors and the
// m64nNk16 instruction (N = 128 or 256), both operands from shared memory, 128-byte swizzled, each
// K-major or MN-major (transposed): the forward's GEMMs take A K-major and B MN-major, the backward's
// weight gradients A MN-major and its row GEMMs B K-major.
#pragma once
#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace flashdmoe::wgmma {

// Matrix descriptor: start address, leading / stride byte offsets (16-byte units), 128B swizzle.
__device__ __forceinline__ uint64_t smem_descriptor(uint32_t smem_address, uint32_t leading_bytes,
                                                    uint32_t stride_bytes) {
  uint64_t desc = (smem_address & 0x3FFFFu) >> 4;
  desc |= static_cast<uint64_t>((leading_bytes >> 4) & 0x3FFFu) << 16;
  desc |= static_cast<uint64_t>((stride_bytes >> 4) & 0x3FFFu) << 32;
  desc |= 1ull << 62;  // 128-byte swizzle
  return desc;
}

__device__ __forceinline__ void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void commit_group() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wait_group() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Keeps the compiler from moving accumulator accesses across wgmma issue/wait points.
template <int N>
__device__ __forceinline__ void fence_operands(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// D[64xN] += A[64x16] (desc_a) * B[16xN] (desc_b), accumulating (scale-d = 1). kTransA: A is MN-major
// (else K-major); kTransB: B is MN-major (else K-major). The accumulator holds N/2 floats per thread.
template <int N, typename Element, bool kTransA = false, bool kTransB = true>
struct Mma;

// One asm body per instruction shape; PTX_TYPE is the operand type's PTX name ("bf16" or "f16").
#define FLASHDMOE_WGMMA_M64N128K16(PTX_TYPE, TRANS)                                                        \
  asm volatile(                                                                                   \
      "{\n"                                                                                       \
      ".reg .pred accumulate;\n"                                                                  \
      "setp.ne.b32 accumulate, %66, 0;\n"                                                   \
      "wgmma.mma_async.sync.aligned.m64n128k16.f32." PTX_TYPE "." PTX_TYPE " "                     \
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "                                                                                \
      "%64, %65, accumulate, 1, 1, " TRANS ";\n"                                              \
      "}\n"                                                                                       \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])                                                                                      \
      : "l"(desc_a), "l"(desc_b), "r"(1))

#define FLASHDMOE_WGMMA_M64N256K16(PTX_TYPE, TRANS)                                                        \
  asm volatile(                                                                                   \
      "{\n"                                                                                       \
      ".reg .pred accumulate;\n"                                                                  \
      "setp.ne.b32 accumulate, %130, 0;\n"                                                   \
      "wgmma.mma_async.sync.aligned.m64n256k16.f32." PTX_TYPE "." PTX_TYPE " "                     \
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "                                                                                \
      "%128, %129, accumulate, 1, 1, " TRANS ";\n"                                              \
      "}\n"                                                                                       \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])                                                                                      \
      : "l"(desc_a), "l"(desc_b), "r"(1))

#define FLASHDMOE_WGMMA_SPECIALISE(N, ELEMENT, PTX_TYPE, TA, TB, TRANS)                             \
  template <>                                                                                     \
  struct Mma<N, ELEMENT, TA, TB> {                                                                \
    __device__ __forceinline__ static void run(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b) { \
      FLASHDMOE_WGMMA_M64N##N##K16(PTX_TYPE, TRANS);                                               \
    }                                                                                             \
  };
#define FLASHDMOE_WGMMA_ALL_LAYOUTS(N, ELEMENT, PTX_TYPE)                \
  FLASHDMOE_WGMMA_SPECIALISE(N, ELEMENT, PTX_TYPE, false, true, "0, 1")  \
  FLASHDMOE_WGMMA_SPECIALISE(N, ELEMENT, PTX_TYPE, false, false, "0, 0") \
  FLASHDMOE_WGMMA_SPECIALISE(N, ELEMENT, PTX_TYPE, true, true, "1, 1")
FLASHDMOE_WGMMA_ALL_LAYOUTS(128, __nv_bfloat16, "bf16")
FLASHDMOE_WGMMA_ALL_LAYOUTS(128, __half, "f16")
FLASHDMOE_WGMMA_ALL_LAYOUTS(256, __nv_bfloat16, "bf16")
FLASHDMOE_WGMMA_ALL_LAYOUTS(256, __half, "f16")

#undef FLASHDMOE_WGMMA_ALL_LAYOUTS
#undef FLASHDMOE_WGMMA_SPECIALISE
#undef FLASHDMOE_WGMMA_M64N128K16
#undef FLASHDMOE_WGMMA_M64N256K16

}  // namespace flashdmoe::wgmma
