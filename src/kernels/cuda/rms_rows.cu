// slotserve_rms_rows: y [M, K] = rms_norm(x [M, K]) * w [K], one block per row (its thread
// count is 32 * the 4-bit matmul's K split, see norm_row.cuh). Template: EPS (the float's
// bits). The body of an mx.fast.cuda_kernel: MLX writes the signature from the input and
// output names (x, w -> y) and the template arguments.

  const int K = x_shape[1];
  norm_row(x + (size_t)blockIdx.x * K, w, K, __int_as_float(EPS), y + (size_t)blockIdx.x * K);
