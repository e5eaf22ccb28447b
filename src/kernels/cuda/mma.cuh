// Tensor-core helpers for the kernels that use them (the 4-bit matmul, paged attention).
// Each output element of an mma is a function of its row of A, its column of B and its C
// element alone, so a row's bits never depend on the other rows of its tile.

// c += A B on one 16x16 (A, row major) by 16x8 (B, column major) bf16 step, f32 sums:
// a0..a3 = A's (row g, k 2t..2t+1), (g + 8, 2t..), (g, 2t + 8..), (g + 8, 2t + 8..); b0, b1 =
// B's (k 2t..2t+1, column g), (2t + 8.., g); c = (g, 2t..2t+1), (g + 8, 2t..) (g = lane / 4,
// t = lane % 4)
__device__ __forceinline__ void mma_bf16(float* c, uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// four 8x8 bf16 matrices from shared memory: lane l gives the address of row l % 8 of
// matrix l / 8 and gets, of each matrix i, (row g, columns 2t, 2t + 1) in r[i] (an mma A
// fragment's four words, or two B fragments of a column-major B stored as N x K rows)
__device__ __forceinline__ void ldmatrix_x4(uint32_t* r, const void* smem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
}

// four 8x8 bf16 matrices from shared memory, transposed: lane l gives the address of row
// l % 8 of matrix l / 8 and gets, of each matrix i, (row 2t, column g) and (row 2t + 1,
// column g) in r[i] (an mma B fragment of a row-major K x N matrix)
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t* r, const void* smem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}
