// Host entry points of the backward's element-wise kernels (the GEMMs between them are grouped GEMMs
// issued from Python). Plain C++ so the pybind11 module can include it.
#pragma once
#include <cuda_runtime.h>
#include <cstdint>
#include "moe/launch.h"

namespace flashdmoe {

// Per packed row r of an expert FFN (rows rows, I = ffn; pre has 2I columns for swiglu, gate half first):
//   h = act(pre[r]),  dweight[r] = <g[r], h>,  hw[r] = w[r] h,  dpre[r] = w[r] g[r] * act'(pre[r])
// g [rows, I] is dy's row times W2^T (unscaled), w [rows] float32 the combine weight. Half-precision
// storage (dtype BFloat16 / Float16), float32 arithmetic; ffn must be a multiple of 8. dweight's sum
// runs in a fixed order (deterministic). Asynchronous on `stream`.
void launch_activation_grad(DType dtype, Activation activation, const void* pre, const void* g, const float* weight,
                            void* hw, void* dpre, float* dweight, int64_t rows, int ffn, cudaStream_t stream);

// dx[t] = sum over j < k with row[t, j] >= 0 of dx_rows[row[t, j]] (in j order, float32), plus extra[t]
// (float32, may be null), rounded to dtype. hidden must be a multiple of 8.
void launch_combine_grad(DType dtype, const void* dx_rows, const int* row, const float* extra, void* dx, int64_t tokens,
                         int top_k, int hidden, cudaStream_t stream);

}  // namespace flashdmoe
