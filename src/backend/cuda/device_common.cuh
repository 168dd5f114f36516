#pragma once
// Internal to the CUDA kernels (included by .cu files only): pieces the matmul and attention kernels
// share. The grouped launches (kernels.h: GroupedMatmulJob, GroupedMatmulPlan) give each job a
// contiguous range of blocks, row blocks fastest: block b of job j covers row block
// (b - block0) % row_blocks and token tile (b - block0) / row_blocks.
#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/kernels.h"

namespace strata::cuda::detail {

/// Host: numbers the blocks of a grouped launch. Sets jobs[i].block0 (jobs in order, each taking
/// row_blocks x ceil(n_tok / tile_tokens) blocks) and returns the blocks in all. Callers check
/// that the total fits a grid (INT32_MAX blocks).
inline int64_t assign_job_blocks(GroupedMatmulJob* jobs, int n_jobs, int64_t row_blocks, int tile_tokens) {
  int64_t blocks = 0;
  for (int i = 0; i < n_jobs; ++i) {
    jobs[i].block0 = blocks;
    blocks += row_blocks * ((jobs[i].n_tok + tile_tokens - 1) / tile_tokens);
  }
  return blocks;
}

/// Which job block b of a grouped launch belongs to: the last j with jobs[j].block0 <= b (binary
/// search over the n_jobs >= 1 jobs, which assign_job_blocks numbered in increasing order).
__device__ __forceinline__ const GroupedMatmulJob& find_job(const GroupedMatmulJob* __restrict__ jobs, int n_jobs,
                                                            int64_t b) {
  int lo = 0, hi = n_jobs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (jobs[mid].block0 <= b)
      lo = mid;
    else
      hi = mid - 1;
  }
  return jobs[lo];
}

/// The tile block b of job jb covers: first weight row r0, first token t0 (a row of x and y) and
/// nt <= TOK tokens, for tiles of RB rows x TOK tokens (the numbering of assign_job_blocks).
struct JobTile {
  int64_t r0;
  int64_t t0;
  int nt;
};
template <int RB, int TOK>
__device__ __forceinline__ JobTile job_tile(const GroupedMatmulJob& jb, int64_t b, int64_t rows) {
  const int64_t row_blocks = (rows + RB - 1) / RB;
  const int64_t local = b - jb.block0, rb = local % row_blocks, tb = local / row_blocks;
  const int64_t t0 = jb.row0 + tb * TOK;
  return {rb * RB, t0, int(min(int64_t(TOK), jb.row0 + jb.n_tok - t0))};
}

/// The shared-memory address of p (a generic pointer into shared memory).
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
/// cp.async (Ampere and later) of `bytes` (4, 8 or 16) with src_bytes (< bytes: the rest zero-filled).
template <int BYTES>
__device__ __forceinline__ void cp_async(void* dst, const void* src, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(smem_addr(dst)), "l"(src), "n"(BYTES),
               "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

/// Four 8x8 b16 matrices from shared memory (ldmatrix .x4; TRANS: .trans, each matrix
/// transposed): lane l gives the address of row l % 8 of matrix l / 8 (16-byte aligned); r[j]
/// receives matrix j's elements (row lane / 4, columns 2 (lane % 4) and + 1; transposed with TRANS),
/// exactly the 32-bit words the per-lane loads of the mma.sync m16n8k16 fragments read.
template <bool TRANS = false>
__device__ __forceinline__ void ldsm_x4(uint32_t r[4], const void* p) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p));
  if constexpr (TRANS)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a)
                 : "memory");
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a)
                 : "memory");
}

}  // namespace strata::cuda::detail
