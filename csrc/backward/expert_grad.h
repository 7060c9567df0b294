// Host entry points of the backward's element-wise kernels (the GEMMs between them are grouped GEMMs
// issued from Python). Plain C++ so the pybind11 module can include it.
#pragma once
#include <cuda_runtime.h>
#include <cstdint>
#include <string>
#include <vector>
#include "moe/launch.h"

namespace flashdmoe {

// Per packed row r of an expert FFN (rows rows, I = ffn; pre has 2I columns for swiglu, gate half first):
//   h = act(pre[r]),  dweight[r] = <g[r], h>,  hw[r] = w[r] h,  dpre[r] = w[r] g[r] * act'(pre[r])
// g [rows, I] is dy's row times W2^T (unscaled), w [rows] float32 the combine weight. Half-precision
// storage (dtype BFloat16 / Float16), float32 arithmetic; ffn must be a multiple of 8. dweight's sum
// runs in a fixed order (deterministic). Asynchronous on `stream`.
// live_rows (device, may be null): rows at or past *live_rows are left alone (a captured backward sized for
// a bound, whose rows in use are known on the device only).
void launch_activation_grad(DType dtype, Activation activation, const void* pre, const void* g, const float* weight,
                            void* hw, void* dpre, float* dweight, int64_t rows, int ffn, const int* live_rows,
                            cudaStream_t stream);

// dx[t] = sum over j < k with row[t, j] >= 0 of dx_rows[row[t, j]] (in j order, float32), plus extra[t]
// (float32, may be null), rounded to dtype. hidden must be a multiple of 8.
void launch_combine_grad(DType dtype, const void* dx_rows, const int* row, const float* extra, void* dx, int64_t tokens,
                         int top_k, int hidden, cudaStream_t stream);

}  // namespace flashdmoe

namespace flashdmoe {

// The packed row table of one rank's backward from the forward's routing (expert, row, weight [T*k]
// int32 / int32 / float32, row -1 = dropped): for every kept choice c with row r,
// token_of_row[r] = c / top_k and w_row[r] = weight[c]; row_of_choice[c] = r, -1 for a dropped choice
// or one whose expert or row is out of range (routing of a failed forward is only ever read in bounds);
// expert_end[e] = max over e's rows of r + 1 (a running maximum over e then gives each expert's end).
// token_of_row, w_row and expert_end must be zeroed beforehand (rows holding no choice keep token 0 and
// weight 0).
void launch_backward_rows(const int* expert, const int* row, const float* weight, int64_t choices, int top_k,
                          int experts, int64_t* token_of_row, float* w_row, int* row_of_choice, int* expert_end,
                          cudaStream_t stream);

// The router's logit gradient from the combine weights' gradient, one warp per token: p = softmax(logits)
// (float32 [T, E]); dweight_j = dweight_row[row_of_choice[t, j]] (0 when -1); with normalize_topk the
// weights are p_j / S (S the sum of the k chosen p), so dp_j = (dweight_j - sum_i dweight_i p_i / S) / S,
// else dp_j = dweight_j; dlogits = p * (dP - sum_j p_j dp_j), dP the dp scattered to the chosen experts.
// dlogits [T, E] in dtype (16-bit: the operand of the router's gradient GEMMs).
void launch_router_grad(DType dtype, const float* logits, const int* expert, const int* row_of_choice,
                        const float* dweight_row, void* dlogits, int64_t tokens, int top_k, int experts,
                        bool normalize_topk, cudaStream_t stream);

}  // namespace flashdmoe

namespace flashdmoe {

// The fused expert backward of one rank (backward/fused_backward.cuh): one cooperative launch computes
// dw1, dw2, each kept row's dx (dx_rows, packed numbering) and the combine weights' gradient by packed
// row (dweight_row), and writes the checked row table (row_of_choice [T, k] i32, -1 where dropped) into
// the scratch. The router's gradient and the sum of a token's rows stay with launch_router_grad and
// launch_combine_grad.
struct FusedBackwardArgs {
  DType dtype;
  Activation activation;
  int tokens, hidden, ffn, experts, top_k;
  bool need_dx, need_dw1, need_dw2;
  const void* x;       // [T, H]
  const void* dy;      // [T, H]
  const void* w1;      // [E, H, w1_cols]
  const void* w2;      // [E, I, H]
  const void* pre;     // [>= kept rows, w1_cols], the forward's saved pre-activations
  const int* expert;   // [T, k] the forward's routing
  const int* row;      // [T, k]
  const float* weight; // [T, k]
  void* dw1;           // like w1 (null when !need_dw1)
  void* dw2;           // like w2 (null when !need_dw2)
  void* dx_rows;       // [T * k, H] (null when !need_dx)
  float* dweight_row;  // [T * k]
  void* sync;          // fused_backward_sync_bytes() zero bytes; zero again after the launch
  void* scratch;       // fused_backward_scratch_bytes() bytes
  void* status_host;   // pinned status slot (kStatusBytes), or null
  uint64_t timeout_ns;
  int debug_withhold_phase;  // 10 or 11: block 0 withholds that grid barrier (tests the watchdog)
  int max_blocks;            // 0: the whole resident grid
};

struct FusedBackwardLayout {
  size_t sync_bytes, scratch_bytes, row_of_choice_offset;
  int64_t padded_rows;
};

// Empty when the fused backward takes these shapes, else why not.
std::string fused_backward_unsupported(int tokens, int hidden, int ffn, int experts, int top_k);
FusedBackwardLayout fused_backward_layout(int tokens, int hidden, int ffn, int experts, int top_k,
                                          Activation activation);
// Asynchronous on `stream` (one cooperative launch); throws std::invalid_argument on bad arguments.
LaunchInfo launch_fused_backward(const FusedBackwardArgs& args, cudaStream_t stream);

}  // namespace flashdmoe

namespace flashdmoe {

// The backward's row exchange across a team (backward/ep_rows.cuh): direction 0 sends each kept
// choice's x and dy rows and combine weight to the expert's owner, in the owner's expert-major order
// (the owner's `place` table says where each source's rows go), direction 1 sends each row the
// owner's experts took (dx row, weight gradient) back to its source, direction 2 sums a float32 share
// over the ranks in rank order. One cooperative launch; the host reads nothing from it. The peer table:
// NVLink / same-GPU pointers, or for a peer reached by NVSHMEM puts (the NVSHMEM build only) this rank's
// own addresses (its signals are the mark), as the forward's.
struct EpRowsArgs {
  int direction;  // 0: to the owners, 1: back to the sources, 2: sum over the ranks
  int rank, world_size, local_experts, stream_rows, hidden, element_bytes;
  bool silent;
  std::vector<uintptr_t> peer_recv, peer_comb, peer_signals;  // world_size each (an NVSHMEM peer: own addresses)
  void* stage;                                                // own symmetric staging (EpStage), NVSHMEM peers only
  int stage_rows;                                             // its rows (max tokens * k)
  const int* sent;                                            // [2, P, L] direction 0 with NVSHMEM peers: first
                                                              // stage row and rows of each (owner, local) run
  const int* from_rows;                                       // [P] direction 1 with NVSHMEM peers: rows per source
  int tokens, top_k;                                          // direction 0
  const void* x;                                              // [T, H]
  const void* dy;                                             // [T, H]
  const int* expert;                                          // [T, k]
  const int* row;                                             // [T, k]
  const float* weight;                                        // [T, k]
  const int* place;                                           // [P, L] as an owner: packed row - stream row
  int rows;                                                   // direction 1
  const int* received;                                        // [rows]
  const void* dx_rows;                                        // [rows, H] (null: no dx wanted)
  const float* dweight_row;                                   // [rows]
  int64_t n;                                                  // direction 2: floats of the share
  const float* share;                                         // [n] this rank's share
  float* sum;                                                 // [n] the sum over ranks, in rank order
  void* sync;         // ep_rows_sync_bytes() zero bytes, zero again after the launch
  void* status_host;  // pinned status slot, or null
  void* team_words;   // the rank's TeamRankWords (moe/params.cuh), or null
  uint64_t timeout_ns;
  int debug_withhold_phase;
  int grid_percent;  // share of the SMs (MPS), 100: all
};

// Zeroed sync bytes one launch needs (the status block, barrier and exit counters).
size_t ep_rows_sync_bytes();
// The signal words of a rank of a team that runs this exchange (the forward's and the backward's), and
// where the backward's start: Python's BufferPlan must agree (checked by the tests).
int64_t ep_signal_words(int world, int local_experts, int stream_rows);
int64_t ep_signal_offset(const char* what, int world, int local_experts, int stream_rows, int index_a, int index_b);
// One launch of the exchange for one rank (a process of a team), or for every rank of an emulated team in
// order (all peers load/store pointers), each rank on its own share of the grid.
LaunchInfo launch_ep_rows(const std::vector<EpRowsArgs>& ranks, cudaStream_t stream);
// Bytes of a rank's staging for NVSHMEM peers (EpStage); Python's BufferPlan must agree.
int64_t ep_stage_bytes(int world, int stream_rows, int stage_rows, int64_t row_bytes);
// Whether this build's exchange reaches a peer by NVSHMEM puts (the NVSHMEM build).
bool ep_rows_puts();

}  // namespace flashdmoe
